"""A call's inputs against the compiled plan: the graph's device, 0-dim host scalars moved to it, and
the errors that name a bad input (split from runtime/executable.py, which checks inputs with these)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from streamfuse.ir.constant_fold import returned_nodes
from streamfuse.ir.graph import Graph, Node


def graph_device(graph: Graph, example_inputs: Sequence[Any]) -> torch.device:
    """The device of the graph's tensors: the first accelerator among inputs and constants (0-dim
    CPU tensors, such as SDPA's host Philox seed or a traced literal, come beside device tensors),
    else the CPU."""
    return accelerator_of(list(example_inputs) + list(graph.constants.values()))


def accelerator_of(values: Sequence[Any]) -> torch.device:
    """The device of the first tensor among `values` that is not on the CPU, else the CPU."""
    return next((t.device for t in values if isinstance(t, torch.Tensor) and t.device.type != "cpu"),
                torch.device("cpu"))


def scalars_to_device(inputs: list[Any] | tuple[Any, ...], at: Sequence[int], device: torch.device,
                      cache: dict[int, tuple[Any, torch.Tensor]]) -> list[Any]:
    """`inputs` with each 0-dim CPU tensor at the positions `at` (the plan's 0-dim inputs) on `device`;
    the same sequence when there is none. Such tensors arrive where a trace recorded a device tensor:
    SDPA's memory-efficient and flash kernels return their Philox seed and offset on the host outside
    CUDA-graph capture (on the device inside it, and a fake-tensor trace says the device), and their
    backward takes either; transformers' generation passes 0-dim host integers (run 64). A generated
    kernel cannot read host memory, and a CUDA graph cannot copy from it safely. The device copy is
    filled from the host value (a fill kernel: a copy from pageable memory would synchronize the
    stream), and kept in `cache` by position: a call passing the same value reuses it, with no launch
    (the plan only reads these inputs)."""
    moved: list[Any] | None = None
    for i in at:
        t = inputs[i]
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() == 0:
            value = t.item()
            kept = cache.get(i)
            if kept is None or kept[0] != value or kept[1].dtype != t.dtype:
                kept = cache[i] = (value, torch.full((), value, dtype=t.dtype, device=device))
            moved = list(inputs) if moved is None else moved
            moved[i] = kept[1]
    return list(inputs) if moved is None else moved


def move_cpu_snapshots(graph: Graph, device: torch.device) -> None:
    """CPU tensors the trace or streamfuse made (snapshots), in a graph on `device`, moved there once: a
    kernel cannot read host memory and streams cannot record it. They come from literals (`mask[:4] = 1`
    traces `tensor(1.)` on the CPU whatever the model's device: swin_t's attention mask ran eagerly)
    and from constant folding over factories called without a device (ConViT's relative indices,
    built with `torch.zeros`/`arange` on the CPU and moved with `.to(device)`: the kernel reading them
    failed to launch on an H100 and its group ran eagerly, run 182). The plan places every other
    tensor on the graph's device. Live tensors of the caller's stay where they are (an optimizer's
    CPU step count changes between calls), and so do those an output returns or views (a caller
    gets them where eager puts them)."""
    returned = returned_nodes(graph)
    for node, value in list(graph.constants.items()):
        if node in graph.snapshots and value.device.type == "cpu" and node not in returned:
            graph.constants[node] = value.to(device)


class BadInput(ValueError):
    """A call's inputs do not fit the compiled plan (the message names the input and what was expected)."""


class InputMismatch(BadInput):
    """A call's tensor differs from the compiled one in shape, dtype or device (a plan for it may be
    built: CompiledGraph's specializations)."""


def raise_bad_count(expected: int, got: int, names: Sequence[str] | None) -> None:
    """BadInput for a call with the wrong number of tensors, naming the inputs the plan takes and
    those missing (a model compiled with an attention mask, called without one)."""
    if not names or len(names) != expected:
        raise BadInput(f"expected {expected} input tensor(s), got {got}")
    missing = f"; missing: {', '.join(names[got:])}" if got < expected else ""
    raise BadInput(f"expected {expected} input tensor(s) ({', '.join(names)}), got {got}{missing}: the "
                   "compiled model takes the inputs it was compiled with (compile again for others)")


def raise_bad_input(i: int, t: Any, node: Node, device: torch.device, names: Sequence[str] | None,
                    batch_note: str = "") -> None:
    name = names[i] if names else node.name
    where = f"input {i} ({name})"
    if isinstance(t, torch.Tensor):
        _raise_mismatch(where, t, node, device, batch_note)
    raise BadInput(f"{where}: expected a {node.dtype} tensor of shape {tuple(node.shape)} on "
                   f"{device}, got {type(t).__name__}")


def _raise_mismatch(where: str, t: torch.Tensor, node: Node, device: torch.device, batch_note: str) -> None:
    if tuple(t.shape) != node.shape:
        raise InputMismatch(f"{where}: expected shape {tuple(node.shape)}, got {tuple(t.shape)}"
                            + (batch_note or " (shapes are fixed: Config.max_specializations is 0)"))
    if t.dtype != node.dtype:
        raise InputMismatch(f"{where}: expected dtype {node.dtype}, got {t.dtype}")
    raise InputMismatch(f"{where}: expected device {device}, got {t.device}")


def pad_rows(buf: torch.Tensor, x: torch.Tensor) -> None:
    """`buf` holds `x` in its first rows, and the rows beyond repeat x's last row: an op valid on the
    real rows is valid on them (zeros made ATen's CPU integer division raise on an integer divisor,
    and `emb(ids - 1)` gather at index -1). A 0-d or full-size `x` is copied as is."""
    n = x.shape[0] if x.dim() else 0
    if buf.dim() == 0 or n == buf.shape[0]:
        buf.copy_(x)
        return
    buf[:n].copy_(x)
    buf[n:].copy_(buf[n - 1:n].expand_as(buf[n:]))
