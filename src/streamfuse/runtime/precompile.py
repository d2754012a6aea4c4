"""Compile a plan's generated kernels before its first call, several at once.

Triton compiles a kernel on its first launch, one after another: a model with a hundred fused
kernels spent most of its first call compiling them. Here each KernelStep's kernel is compiled
ahead (codegen/cache.compile_ahead) on Config.compile_threads threads. The arguments are
described, not allocated: a torch dtype stands for a tensor (assumed 16-byte aligned) and the
strides are the traced ones, so the specialization matches the launches' in the common case;
where it does not (an input at an odd offset), the launch compiles its own as before. A kernel
that fails to compile here is left to its first launch, which falls back to ATen
(runtime/steps.py). Triton's disk cache makes a warm process's precompile a lookup.
"""

from __future__ import annotations

from typing import Any

import torch

from streamfuse.codegen.cache import compile_ahead
from streamfuse.ir.graph import Node
from streamfuse.ir.indexing import channels_last_strides
from streamfuse.runtime.steps import ChannelsLastConvStep, KernelStep, Step


def warmup_args(step: KernelStep, layouts: dict[Node, tuple[int, ...]]) -> list[Any]:
    """The launch arguments of `step` as Triton's warmup takes them (dtypes for tensors); an input's
    strides are the traced ones unless `layouts` says the step producing it lays it out otherwise."""
    src = step.source
    args: list[Any] = []
    for node, dims in zip(src.inputs, src.input_stride_dims, strict=True):
        strides = layouts.get(node, node.strides)
        args.append(node.dtype)
        args += [strides[d] for d in dims]
    args += [o.dtype for o in src.outputs]
    if step.rng is not None:
        args += [step.rng.seed, torch.int64]  # the offset: a pointer to one int64
    args += [t.dtype for t in step.scratch]
    return args


def runtime_layouts(steps: list[Step]) -> dict[Node, tuple[int, ...]]:
    """Results whose strides at run time differ from the traced ones: convolutions run in
    channels_last whose result is handed on as it is (ChannelsLastConvStep.convert_back False)."""
    out: dict[Node, tuple[int, ...]] = {}
    for step in steps:
        if isinstance(step, ChannelsLastConvStep) and not step.convert_back:
            node = step.call.node
            out[node] = channels_last_strides(node.shape)
    return out


def precompile(steps: list[Step], device: torch.device, threads: int) -> list[str]:
    """Compile every distinct generated kernel of `steps` for `device`; returns the failures."""
    todo: dict[str, KernelStep] = {}
    for step in steps:
        if isinstance(step, KernelStep) and step.source.fn_name not in todo:
            todo[step.source.fn_name] = step
    layouts = runtime_layouts(steps)
    jobs = [(s.kernel, warmup_args(s, layouts), s.source.grid, s.launch_options()) for s in todo.values()]
    results = compile_ahead(jobs, device, threads)
    return [f"{name}: {r}" for name, r in zip(todo, results, strict=True) if r is not None]
