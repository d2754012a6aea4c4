"""CUDA-graph capture and replay of one Executable at fixed (possibly padded) shapes.

The whole multi-stream schedule is captured as one graph: the StreamRunner's fork and join
events become graph edges. Inputs are copied into static buffers. Each recorded graph has a memory
pool of its own, and its buffers are released during capture as in a step-by-step call (a buffer
read on another stream is recorded on that stream, so the allocator holds it until the capture
ends), so a graph keeps about the memory a step-by-step call peaks at, plus its outputs. (Until
session 17 the graphs of a CompiledGraph shared one pool and nothing was freed during capture:
every intermediate of the plan stayed allocated, and a 0.85 B Llama at batch 49 x 430 tokens kept
tens of GB per shape: run 69 ran out of the H200's 140 GB after three shapes.) A pool is never
shared, so no graph can place its buffers in memory another graph's replay writes.

Fresh outputs without a copy: a runner records up to Config.output_sets instances of its graph
(the same kernels, each with its own buffers, all reading the shared static inputs) and hands a
call the output buffers of an instance the caller no longer references: neither the tensors it
returned nor any view of them is alive (Python reference counts and the storages' use counts
against their values right after capture). So `y = model(x)` in a loop alternates between two
instances and never copies; a caller that keeps every result (appending to a list) gets copies
from one more instance whose buffers are never handed out. A result is therefore never
overwritten while the caller can still see it. Outputs that alias an input or a constant are
always copied.

The input copy inside the graph (Config.input_copy_node): each instance's graph starts with one
device-to-device memcpy node per input, into the static input (captured from a scratch source that
the instance frees after its first call). A call points those nodes at its own tensors
(cudaGraphExecMemcpyNodeSetParams1D, runtime/cudart.py) and replays: one host call of ~1.8 µs per
input instead of a cudaMemcpyAsync before the replay, most of a call's host time (PERF.md sessions
11-12). Each instance holds the tensors its nodes point at until a call points them elsewhere, so
a replay never reads freed memory. A non-contiguous input is made contiguous first. Where the
nodes cannot be made (no CUDA runtime found through ctypes, an input without elements, a capture
that yields no memcpy node), the runner copies before the replay as without them, and says why
(CompiledGraph.input_copy, explain). With the copy as the graph's single root node, CUPTI no
longer starts the first kernels of its streams one after another (PERF.md session 12).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from streamfuse.runtime import cudart
from streamfuse.runtime.executable import Executable
from streamfuse.runtime.memory import storage_bytes

_use_count = torch._C._storage_Use_Count


class _Instance:
    """One recorded graph of the runner's plan with its own intermediate and output buffers;
    with `sources`, the graph first copies each source into its static input (memcpy nodes)."""

    def __init__(self, exe: Executable, static_inputs: list[torch.Tensor], sources: list[torch.Tensor] | None = None):
        caller = torch.cuda.current_stream(exe.device)
        warm = torch.cuda.Stream(device=exe.device)
        warm.wait_stream(caller)
        with exe.writebacks_undone(static_inputs):
            with torch.cuda.stream(warm):  # compiles Triton kernels and settles the allocator outside capture
                for _ in range(2):
                    exe.run(static_inputs)
            caller.wait_stream(warm)
        self.graph = torch.cuda.CUDAGraph(keep_graph=sources is not None)
        reserved = torch.cuda.memory_reserved(exe.device)
        with torch.cuda.graph(self.graph, pool=torch.cuda.graph_pool_handle()):
            if sources is not None:
                stream = torch.cuda.current_stream(exe.device).cuda_stream
                for dst, src in zip(static_inputs, sources, strict=True):
                    cudart.memcpy_d2d_async(dst.data_ptr(), src.data_ptr(), dst.nbytes, stream)
            results = exe.run(static_inputs)
        self.reserved_bytes = torch.cuda.memory_reserved(exe.device) - reserved
        """What capture reserved: the graph's pool (its buffers' peak and its outputs)."""
        # the outputs the caller sees; those written back into inputs (Graph.writebacks) were copied
        # or stored there inside the graph, and keep_alive holds them (nothing else may be placed
        # there: the pool is this graph's alone, but the buffers stay where the replay writes)
        self.outputs: list[Any] = results[: exe.graph.user_outputs]
        self.keep_alive: list[Any] = results[exe.graph.user_outputs:]
        del results
        self.copy_nodes: list[int] = []
        self.exec = 0
        self.held: list[torch.Tensor] = list(sources or [])
        """What the copy nodes read now (a replay of the graph alone reads them)."""
        if sources is not None:
            self.graph.instantiate()
            nodes = cudart.memcpy_nodes(self.graph.raw_cuda_graph())
            missing = [i for i, dst in enumerate(static_inputs) if dst.data_ptr() not in nodes]
            if missing:
                raise cudart.CudartError(f"no memcpy node for input(s) {missing} in the captured graph")
            self.copy_nodes = [nodes[dst.data_ptr()] for dst in static_inputs]
            self.exec = self.graph.raw_cuda_graph_exec()
        self.guard = OutputGuard(self.outputs)


class OutputGuard:
    """Whether anyone beyond the owner references `outputs`' tensors or any view of their memory:
    Python reference counts of the tensors, use counts of the tensors themselves (C++ holders such as
    autograd's saved tensors hold the tensor, not its Python object) and of their storages, against
    their values when the guard was made (while only the owner held them)."""

    def __init__(self, outputs: list[Any]):
        # no local may hold an output while the baseline is taken (run 25: a list did, so every
        # count sat one above what a later check sees, and a held result read as free)
        self._guards = [(t, t.untyped_storage()._cdata) for t in outputs if isinstance(t, torch.Tensor)]
        self._baseline = self._counts()

    def _counts(self) -> list[tuple[int, int, int]]:
        return [(sys.getrefcount(t), t._use_count(), _use_count(cdata)) for t, cdata in self._guards]

    def held(self) -> bool:
        return self._counts() != self._baseline


class GraphRunner:
    def __init__(self, exe: Executable, batch_slices: Sequence[int | None], reuse_outputs: bool,
                 output_sets: int = 0, input_copy_node: bool = False):
        """`batch_slices[j]` is the number of rows per batch element of flat output j (its dim 0 is
        batch * that), or None for an output that does not depend on the batch. `output_sets`: how
        many instances may hand out their own output buffers (Config.output_sets).
        `input_copy_node`: copy the inputs inside the graph (Config.input_copy_node)."""
        self.exe = exe
        self.reuse_outputs = reuse_outputs
        self.batch_slices = list(batch_slices)[: exe.graph.user_outputs]
        self.static_inputs = [torch.zeros(n.shape, dtype=n.dtype, device=exe.device) for n in exe.graph.inputs]
        self.padded_batch = exe.graph.inputs[0].shape[0] if exe.graph.inputs and exe.graph.inputs[0].shape else 0
        self.written = exe.graph.written_inputs
        """Inputs the graph updates in place (Graph.writebacks; a static KV cache passed as an input):
        the graph updates its static copy, and each call copies that back into the caller's tensor."""
        self.copy_node_failure: str | None = None
        """Why the input copy is not inside the graph although Config.input_copy_node asked for it."""
        self.use_copy_nodes = input_copy_node and self._copy_nodes_possible()
        self._static_ptrs = [t.data_ptr() for t in self.static_inputs]  # where the copy nodes write
        self.reserved_bytes = storage_bytes(self.static_inputs)
        """Device memory this runner keeps: its static inputs and every instance's pool (runtime/memory.py)."""
        first = self._record_instance()
        self.first = first
        """The first recorded instance: reuse_outputs replays it, profiling replays its graph."""
        self.output_sets = output_sets if not reuse_outputs and not self._aliases_fixed(first) else 0
        self.handout: list[_Instance] = [first] if self.output_sets else []
        """Instances whose output buffers calls hand out, in recording order."""
        self.copy_source: _Instance | None = None if self.output_sets else first
        """The instance whose outputs are copied (never handed out), recorded when first needed."""

    def _copy_nodes_possible(self) -> bool:
        if not self.static_inputs:
            return False
        if any(s.numel() == 0 for s in self.static_inputs):
            self.copy_node_failure = "an input has no elements"
            return False
        if not cudart.available():
            self.copy_node_failure = "the CUDA runtime library was not found through ctypes"
            return False
        return True

    def _record_instance(self) -> _Instance:
        """A new instance; the first whose copy nodes cannot be made turns them off for the runner."""
        if self.use_copy_nodes:
            # the sources the nodes are captured with: held by the instance until its first call
            # points the nodes at the caller's tensors, then freed
            sources = [torch.zeros_like(s) for s in self.static_inputs]
            try:
                return self._counted(_Instance(self.exe, self.static_inputs, sources))
            except Exception as exc:  # noqa: BLE001 - the nodes are an optimization: record without them
                self.copy_node_failure = f"{type(exc).__name__}: {exc}"
                self.use_copy_nodes = False
                torch.cuda.synchronize(self.exe.device)
        return self._counted(_Instance(self.exe, self.static_inputs))

    def _counted(self, inst: _Instance) -> _Instance:
        self.reserved_bytes += inst.reserved_bytes
        return inst

    def _aliases_fixed(self, inst: _Instance) -> bool:
        """Some output shares memory with a static input or a constant: it must be copied."""
        fixed = {t.untyped_storage().data_ptr() for t in self.static_inputs}
        fixed |= {t.untyped_storage().data_ptr() for t in self.exe.graph.constants.values()
                  if isinstance(t, torch.Tensor) and t.device.type == "cuda"}
        return any(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in fixed for o in inst.outputs)

    @property
    def graph(self) -> torch.cuda.CUDAGraph:
        return self.first.graph

    @property
    def static_outputs(self) -> list[Any]:
        return self.first.outputs

    @property
    def instances(self) -> int:
        return len(self.handout) + (self.copy_source is not None and self.copy_source not in self.handout)

    def __call__(self, inputs: Sequence[torch.Tensor], batch: int) -> list[Any]:
        """Copy `inputs` (batch rows, at most the padded batch) in, replay, return the outputs."""
        exact = batch == self.padded_batch
        if self.reuse_outputs:
            self._replay(self.first, inputs, batch, exact)
            return self._views(self.first.outputs, batch, exact)
        inst = self._free_instance()
        if inst is not None:
            self._replay(inst, inputs, batch, exact)
            return self._views(inst.outputs, batch, exact)
        if self.copy_source is None:
            self.copy_source = self._record_instance()
        self._replay(self.copy_source, inputs, batch, exact)
        return fresh_copies(self._views(self.copy_source.outputs, batch, exact))

    def _replay(self, inst: _Instance, inputs: Sequence[torch.Tensor], batch: int, exact: bool) -> None:
        if inst.copy_nodes:
            held = [x if x.is_contiguous() else x.contiguous() for x in inputs]
            for node, dst, x in zip(inst.copy_nodes, self._static_ptrs, held, strict=True):
                cudart.set_memcpy_source(inst.exec, node, dst, x.data_ptr(), x.nbytes)
            inst.held = held  # its graph reads them: alive until a call points it elsewhere
        elif len(inputs) == 1:
            (self.static_inputs[0] if exact else self.static_inputs[0][:batch]).copy_(inputs[0])
        elif inputs:
            statics = self.static_inputs if exact else [s[:batch] for s in self.static_inputs]
            torch._foreach_copy_(statics, list(inputs))
        inst.graph.replay()
        if self.written:  # the graph updated its copies of these inputs: the caller's tensors get the update
            if not exact:
                raise RuntimeError("a graph that updates its inputs in place ran padded to a batch bucket")
            torch._foreach_copy_([inputs[i] for i in self.written], [self.static_inputs[i] for i in self.written])

    def _free_instance(self) -> _Instance | None:
        for inst in self.handout:
            if not inst.guard.held():
                return inst
        if len(self.handout) < self.output_sets:
            inst = self._record_instance()
            self.handout.append(inst)
            return inst
        return None

    def _views(self, outputs: list[Any], batch: int, exact: bool) -> list[Any]:
        if exact:
            return list(outputs)
        return [o[: batch * rows] if rows is not None and isinstance(o, torch.Tensor) else o
                for o, rows in zip(outputs, self.batch_slices, strict=True)]


def fresh_copies(values: Sequence[Any]) -> list[Any]:
    """Copies of the tensors in `values` (one launch for all of them), other values as they are."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if len(tensors) == 1:
        copies = [tensors[0].clone()]
    elif tensors:
        copies = _carve(tensors)  # one allocation per dtype instead of one per output
        torch._foreach_copy_(copies, tensors)
    else:
        copies = []
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
