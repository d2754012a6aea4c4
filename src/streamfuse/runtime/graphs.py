"""CUDA-graph capture and replay of one Executable at fixed (possibly padded) shapes.

The whole multi-stream schedule is captured as one graph: the StreamRunner's fork and join
events become graph edges. Inputs are copied into static buffers; the graph's memory comes from a
pool shared by every graph of a CompiledGraph. Nothing is freed during capture and the runner
keeps every buffer alive, so no memory is reused inside a graph or across graphs sharing the
pool, whichever order they replay in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from streamfuse.runtime.devcopy import copy_into, fresh_copy
from streamfuse.runtime.executable import Executable


class GraphRunner:
    def __init__(self, exe: Executable, pool: Any, batch_slices: Sequence[int | None], reuse_outputs: bool):
        """`batch_slices[j]` is the number of rows per batch element of flat output j (its dim 0 is
        batch * that), or None for an output that does not depend on the batch."""
        self.exe = exe
        self.reuse_outputs = reuse_outputs
        self.batch_slices = list(batch_slices)
        self.static_inputs = [torch.zeros(n.shape, dtype=n.dtype, device=exe.device) for n in exe.graph.inputs]
        self.padded_batch = exe.graph.inputs[0].shape[0] if exe.graph.inputs and exe.graph.inputs[0].shape else 0
        self.device_index = exe.device.index if exe.device.index is not None else torch.cuda.current_device()
        caller = torch.cuda.current_stream(exe.device)
        warm = torch.cuda.Stream(device=exe.device)
        warm.wait_stream(caller)
        with torch.cuda.stream(warm):  # compiles Triton kernels and settles the allocator outside capture
            for _ in range(2):
                exe.run(self.static_inputs)
        caller.wait_stream(warm)
        self.keep_alive: list[Any] = []
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.static_outputs = exe.run(self.static_inputs, keep_alive=self.keep_alive)

    def __call__(self, inputs: Sequence[torch.Tensor], batch: int) -> list[Any]:
        """Copy `inputs` (batch rows, at most the padded batch) in, replay, return the outputs.
        Copies go through the driver (runtime/devcopy.py) on the caller's stream; a batch below the
        padded one fills the front rows (the rest keep stale values: rows are independent)."""
        stream = torch._C._cuda_getCurrentRawStream(self.device_index)
        for static, x in zip(self.static_inputs, inputs, strict=True):
            copy_into(static, x, stream)
        self.graph.replay()
        if batch == self.padded_batch:
            views = self.static_outputs
        else:
            views = [o[: batch * rows] if rows is not None and isinstance(o, torch.Tensor) else o
                     for o, rows in zip(self.static_outputs, self.batch_slices, strict=True)]
        if self.reuse_outputs:
            return list(views)
        if len(views) == 1 and isinstance(views[0], torch.Tensor):
            return [fresh_copy(views[0], stream)]
        return fresh_copies(views, stream)


def fresh_copies(values: Sequence[Any], stream: int) -> list[Any]:
    """Copies of the tensors in `values` (one allocation per dtype), other values as they are."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    dense = [t for t in tensors if t.is_contiguous()]
    carved = iter(_carve(dense) if dense else [])
    copies = []
    for t in tensors:
        if t.is_contiguous():
            copies.append(next(carved))
            copy_into(copies[-1], t, stream)
        else:
            copies.append(t.clone())
    it = iter(copies)
    return [next(it) if isinstance(v, torch.Tensor) else v for v in values]


def _carve(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fresh contiguous tensors shaped like `tensors`, as disjoint views of one buffer per dtype."""
    totals: dict[torch.dtype, int] = {}
    for t in tensors:
        totals[t.dtype] = totals.get(t.dtype, 0) + t.numel()
    buffers = {dt: torch.empty(n, dtype=dt, device=tensors[0].device) for dt, n in totals.items()}
    offsets = dict.fromkeys(totals, 0)
    out = []
    for t in tensors:
        start = offsets[t.dtype]
        out.append(buffers[t.dtype][start: start + t.numel()].view(t.shape))
        offsets[t.dtype] = start + t.numel()
    return out
