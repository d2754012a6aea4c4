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

Inputs the graph updates in place (Graph.writebacks: a static KV cache handed to the forward,
a buffer passed as an argument) are read and written where they are: the graph is recorded on the
caller's own tensor, as eager updates it, instead of copying it into a static buffer before the
replay and back after it (GPT-2's decode step copied its 24 caches twice per token: 48 copies and
a host-side batched copy, session 18). Such an input must be contiguous at recording and sit at the
same address on every later call. No reference to it is kept (a result in its memory is rebuilt
from the call's tensor), so a caller that frees it and makes a new one of the same size, as
transformers does for every generate() call, usually gets the same memory back. A call where it
moved raises InputsMoved; the owner records the graph again, with copies for such inputs once they
moved MAX_MOVES times.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from streamfuse.profile.timing import recording
from streamfuse.runtime import cudart
from streamfuse.runtime.executable import Executable
from streamfuse.runtime.inputs import pad_rows
from streamfuse.runtime.memory import storage_bytes

_use_count = torch._C._storage_Use_Count


MAX_MOVES = 1
"""Recordings a CompiledGraph makes for in-place inputs that moved before it copies them instead."""


class InputsMoved(Exception):
    """An input the graph reads in place is not where the graph was recorded: record it again."""


class _Instance:
    """One recorded graph of the runner's plan with its own intermediate and output buffers;
    with `sources`, the graph first copies each source into the static input at the same position of
    `copied` (memcpy nodes); the other static inputs are the caller's tensors, read in place."""

    def __init__(self, exe: Executable, static_inputs: list[torch.Tensor], sources: list[torch.Tensor] | None = None,
                 copied: list[int] | None = None):
        copied = list(range(len(static_inputs))) if copied is None else copied
        caller = torch.cuda.current_stream(exe.device)
        warm = torch.cuda.Stream(device=exe.device)
        with exe.writebacks_undone(static_inputs):
            # after the caller's stream took its saved copies: an input read in place is the caller's
            # own tensor, which the warm-up updates (session 18: waiting before the copies were taken
            # let the warm-up's update race them, and the "restore" kept the update)
            warm.wait_stream(caller)
            with torch.cuda.stream(warm):  # compiles Triton kernels and settles the allocator outside capture
                for _ in range(2):
                    exe.run(static_inputs)
            caller.wait_stream(warm)
        self.graph = torch.cuda.CUDAGraph(keep_graph=sources is not None)
        # the capture's cuBLAS workspaces in its own pool (not the warm-up's, from the default pool)
        # thread_local as in runtime/pinned.py: other threads' CUDA calls stay legal while this one records
        with recording(self.graph):
            # measured inside: entering the capture empties the allocator's cache, so a count taken
            # before it could fall by more than the pool grows (run 73: a negative size kept a graph
            # beyond Config.graph_memory_fraction)
            reserved = torch.cuda.memory_reserved(exe.device)
            if sources is not None:
                stream = torch.cuda.current_stream(exe.device).cuda_stream
                for dst, src in zip([static_inputs[i] for i in copied], sources, strict=True):
                    cudart.memcpy_d2d_async(dst.data_ptr(), src.data_ptr(), dst.nbytes, stream)
            results = exe.run(static_inputs)
        self.reserved_bytes = max(0, torch.cuda.memory_reserved(exe.device) - reserved)
        """What capture reserved: the graph's pool (its buffers' peak and its outputs)."""
        self._adopt(exe, results, static_inputs, copied)
        del results
        self.copy_nodes: list[int] = []
        self.exec = 0
        self.held: list[torch.Tensor] = list(sources or [])
        """What the copy nodes read now (a replay of the graph alone reads them)."""
        if sources is not None:
            self.graph.instantiate()
            nodes = cudart.memcpy_nodes(self.graph.raw_cuda_graph())
            missing = [i for i in copied if static_inputs[i].data_ptr() not in nodes]
            if missing:
                raise cudart.CudartError(f"no memcpy node for input(s) {missing} in the captured graph")
            self.copy_nodes = [nodes[static_inputs[i].data_ptr()] for i in copied]
            self.exec = self.graph.raw_cuda_graph_exec()
        self.pointed: list[tuple[int, int] | None] = [None] * len(self.copy_nodes)
        """(source pointer, bytes) each copy node was last pointed at (None: the capture's sources): a
        call whose input is where the last call's was skips the driver call (6-14 µs per node under
        cProfile on an H100 host, session 49; a loop that reloads its inputs into memory the caching
        allocator hands back, or passes the same tensor, is the common case)."""
        self.guard = OutputGuard(self.outputs)

    def _adopt(self, exe: Executable, results: list[Any], static_inputs: list[torch.Tensor], copied: list[int]) -> None:
        """Keep the recorded run's results: the outputs the caller sees; those written back into
        inputs (Graph.writebacks) were copied or stored there inside the graph, and keep_alive holds
        them (nothing else may be placed there: the pool is this graph's alone, but the buffers stay
        where the replay writes). Nothing may hold an input read in place: a result in its memory
        (the cache an in-place update returns, a view of it) is rebuilt from the call's own tensor
        (run 74: keep_alive held the caller's cache, so each new cache landed elsewhere)."""
        kept = set(copied)
        pinned = {static_inputs[i].untyped_storage().data_ptr(): i for i in range(len(static_inputs)) if i not in kept}

        def owner(t: Any) -> int | None:
            return pinned.get(t.untyped_storage().data_ptr()) if isinstance(t, torch.Tensor) else None

        user = results[: exe.graph.user_outputs]
        self.aliases: dict[int, tuple[int, tuple[int, ...], tuple[int, ...], int]] = {
            j: (i, tuple(t.shape), tuple(t.stride()), t.storage_offset())
            for j, t in enumerate(user) if (i := owner(t)) is not None}
        """Output position -> (input read in place, size, stride, storage offset) of a result in its memory."""
        statics = {static_inputs[i].untyped_storage().data_ptr(): i for i in copied}
        self.input_views: dict[int, tuple[int, torch.Tensor]] = {
            j: (i, t) for j, t in enumerate(user)
            if j not in self.aliases and isinstance(t, torch.Tensor)
            and (i := statics.get(t.untyped_storage().data_ptr())) is not None}
        """Output position -> (copied input, the result: a view of its static buffer). Eager returns the
        caller's own tensor or a view of it (`return x, f(x)`); GraphRunner.input_views rebuilds it on
        the call's tensor, and these views never leave the runner (the next call's copy overwrites them)."""
        self.outputs: list[Any] = [None if j in self.aliases or j in self.input_views else t
                                   for j, t in enumerate(user)]
        self.keep_alive: list[Any] = [t for t in results[exe.graph.user_outputs:] if owner(t) is None]


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


def readable_in_place(t: Any, node: Any, device: torch.device) -> bool:
    """`t` can be the graph's own input for `node`: a contiguous tensor of its exact shape and dtype
    on the graph's device (the layout of the static buffer it replaces)."""
    return (isinstance(t, torch.Tensor) and t.device == device and t.dtype == node.dtype
            and tuple(t.shape) == tuple(node.shape) and t.is_contiguous())


class GraphRunner:
    def __init__(self, exe: Executable, batch_slices: Sequence[int | None], reuse_outputs: bool,
                 output_sets: int = 0, input_copy_node: bool = False, *, inputs: Sequence[Any],
                 read_in_place: bool = True):
        """`batch_slices[j]` is the number of rows per batch element of flat output j (its dim 0 is
        batch * that), or None for an output that does not depend on the batch. `output_sets`: how
        many instances may hand out their own output buffers (Config.output_sets).
        `input_copy_node`: copy the inputs inside the graph (Config.input_copy_node). `inputs`: the
        recording call's inputs, which the static buffers hold before the first recording (_fill).
        `read_in_place`: those the graph updates in place are read where they are (see the module's
        docstring); False copies every input."""
        self.exe = exe
        self.reuse_outputs = reuse_outputs
        self.batch_slices: list[int | None] = []
        self.slice_by(batch_slices)
        self.padded_batch = exe.graph.inputs[0].shape[0] if exe.graph.inputs and exe.graph.inputs[0].shape else 0
        self.in_place = [i for i in exe.graph.written_inputs
                         if read_in_place and readable_in_place(inputs[i], exe.graph.inputs[i], exe.device)]
        """Inputs the graph updates, read and written in the caller's tensors: the graph points at
        their memory, and replays only while the call's tensor is there (_check_in_place)."""
        self.static_inputs: list[torch.Tensor | None] = [
            None if i in self.in_place else torch.empty(n.shape, dtype=n.dtype, device=exe.device)
            for i, n in enumerate(exe.graph.inputs)]
        """The buffers copied inputs land in (filled from `inputs` below); None where the caller's tensor is read in place (no
        reference to it is kept: holding the caller's old cache would keep its memory from the
        caller's next cache, which then lands elsewhere and moves every time)."""
        self.copied = [i for i in range(len(self.static_inputs)) if i not in self.in_place]
        """Inputs copied into static buffers on each call."""
        self._copied_statics = [self._static(i) for i in self.copied]
        self._fill(inputs)
        self.written = [i for i in exe.graph.written_inputs if i not in self.in_place]
        """Inputs the graph updates in its static copy: each call copies that back into the caller's tensor."""
        self.copy_node_failure: str | None = None
        """Why the input copy is not inside the graph although Config.input_copy_node asked for it."""
        self.use_copy_nodes = input_copy_node and self._copy_nodes_possible()
        self._static_ptrs = [t.data_ptr() for t in self._copied_statics]  # where the copy nodes write
        self._in_place_ptrs = [inputs[i].data_ptr() for i in self.in_place]  # type: ignore[index]
        self._in_place_storages = {inputs[i].untyped_storage().data_ptr() for i in self.in_place}  # type: ignore[index]
        self.reserved_bytes = storage_bytes([self.static_inputs[i] for i in self.copied])
        """Device memory this runner keeps: its static inputs and every instance's pool (runtime/memory.py)."""
        first = self._record_instance(inputs or [])
        self.first = first
        """The first recorded instance: reuse_outputs replays it, profiling replays its graph."""
        self.output_sets = output_sets if not reuse_outputs and not self._aliases_fixed(first) else 0
        self.handout: list[_Instance] = [first] if self.output_sets else []
        """Instances whose output buffers calls hand out, in recording order."""
        self.copy_source: _Instance | None = None if self.output_sets else first
        """The instance whose outputs are copied (never handed out), recorded when first needed."""
        self.outputs_copied = 0
        """Calls that copied their outputs out (reuse_outputs off, and every handed-out set still held
        by the caller, or none to hand out): a copy launch and a new allocation per call."""

    def slice_by(self, batch_slices: Sequence[int | None]) -> None:
        """Which outputs a padded replay slices to the caller's batch (`batch_slices`, as in
        __init__): the compiled plan's become known at its first call of another batch (CompiledGraph
        `_check_function_of_batch`), after its graph may have been recorded at the compiled batch."""
        self.batch_slices = list(batch_slices)[: self.exe.graph.user_outputs]

    def _fill(self, inputs: Sequence[Any]) -> None:
        """The static buffers hold the call's inputs, the rows beyond its batch repeating its last row,
        as CompiledGraph._run_bucketed pads: the recording's warm-up runs the plan on them, and a padded
        replay on the rows beyond the batch, which later calls leave as earlier calls wrote them. Zeros
        there were values no call gave (an `emb(ids - 1)` gathered at index -1: out of bounds)."""
        with torch.no_grad():
            for i, s in zip(self.copied, self._copied_statics, strict=True):
                pad_rows(s, inputs[i])

    def _copy_nodes_possible(self) -> bool:
        if not self.copied:
            return False
        if any(self._static(i).numel() == 0 for i in self.copied):
            self.copy_node_failure = "an input has no elements"
            return False
        if not cudart.available():
            self.copy_node_failure = "the CUDA runtime library was not found through ctypes"
            return False
        return True

    def _static(self, i: int) -> torch.Tensor:
        t = self.static_inputs[i]
        assert t is not None
        return t

    def _record_instance(self, inputs: Sequence[Any]) -> _Instance:
        """A new instance (`inputs`: the call's, whose in-place ones it is recorded on); the first
        whose copy nodes cannot be made turns them off for the runner."""
        statics = [inputs[i] if t is None else t for i, t in enumerate(self.static_inputs)]
        if self.use_copy_nodes:
            # the sources the nodes are captured with: held by the instance until its first call
            # points the nodes at the caller's tensors, then freed
            sources = [torch.zeros_like(self._static(i)) for i in self.copied]
            try:
                return self._counted(_Instance(self.exe, statics, sources, self.copied))
            except Exception as exc:  # noqa: BLE001 - the nodes are an optimization: record without them
                self.copy_node_failure = f"{type(exc).__name__}: {exc}"
                self.use_copy_nodes = False
                torch.cuda.synchronize(self.exe.device)
        return self._counted(_Instance(self.exe, statics, copied=self.copied))

    def _counted(self, inst: _Instance) -> _Instance:
        self.reserved_bytes += inst.reserved_bytes
        return inst

    def _aliases_fixed(self, inst: _Instance) -> bool:
        """Some output shares memory with a static input or a constant: it must be copied."""
        fixed = {t.untyped_storage().data_ptr() for t in self.static_inputs if t is not None}
        fixed |= self._in_place_storages
        fixed |= {t.untyped_storage().data_ptr() for t in self.exe.graph.constants.values()
                  if isinstance(t, torch.Tensor) and t.device.type == "cuda"}
        return bool(inst.aliases) or any(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in fixed
                                         for o in inst.outputs)

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
        if self.exe.converted_weights:  # live weights changed in place: their channels_last copies too
            self.exe.refresh_weights()
        if self.in_place:  # before anything is recorded on the call's tensors
            self._check_in_place(inputs, exact)
        if self.reuse_outputs:
            self._replay(self.first, inputs, batch, exact)
            return self._outputs(self.first, inputs, batch, exact)
        inst = self._free_instance(inputs)
        if inst is not None:
            self._replay(inst, inputs, batch, exact)
            return self._outputs(inst, inputs, batch, exact)
        if self.copy_source is None:
            self.copy_source = self._record_instance(inputs)
        self.outputs_copied += 1
        self._replay(self.copy_source, inputs, batch, exact)
        return self._outputs(self.copy_source, inputs, batch, exact, copied=True)

    def _outputs(self, inst: _Instance, inputs: Sequence[Any], batch: int, exact: bool,
                 copied: bool = False) -> list[Any]:
        """What a replay of `inst` hands the caller: its outputs sliced to the batch (`copied`: fresh
        copies of them), those in an input's memory taken from the call's tensors."""
        outputs = self._views(inst.outputs if not inst.aliases else _rebuilt(inst, inputs), batch, exact)
        return self.input_views(inst, fresh_copies(outputs) if copied else outputs, inputs, batch, exact)

    def input_views(self, inst: _Instance, outputs: list[Any], inputs: Sequence[Any], batch: int,
                    exact: bool) -> list[Any]:
        """`outputs` with the results in a copied input's static buffer (_Instance.input_views) taken
        from the call's own tensor, as eager returns them: the tensor itself or the same view of it,
        where it has the buffer's layout (the compiled batch, contiguous); otherwise a copy of the
        buffer's view, sliced to the call's batch as the other outputs are."""
        for j, (i, view) in inst.input_views.items():
            x = inputs[i]
            static = self._static(i)
            if exact and x.is_contiguous() and x.shape == static.shape:
                size, stride = tuple(view.shape), tuple(view.stride())
                offset = view.storage_offset() - static.storage_offset()
                same = offset == 0 and size == tuple(x.shape) and stride == tuple(x.stride())
                outputs[j] = x if same else x.as_strided(size, stride, x.storage_offset() + offset)
            else:
                rows = self.batch_slices[j]
                outputs[j] = (view[: batch * rows] if not exact and rows is not None else view).clone()
        return outputs

    def _replay(self, inst: _Instance, inputs: Sequence[torch.Tensor], batch: int, exact: bool) -> None:
        copied = [inputs[i] for i in self.copied] if self.in_place else inputs
        if inst.copy_nodes:
            held = [x if x.is_contiguous() else x.contiguous() for x in copied]
            pointed = inst.pointed
            for k, (node, dst, x) in enumerate(zip(inst.copy_nodes, self._static_ptrs, held, strict=True)):
                source = (x.data_ptr(), x.nbytes)
                if pointed[k] != source:
                    cudart.set_memcpy_source(inst.exec, node, dst, *source)
                    pointed[k] = source
            inst.held = held  # its graph reads them: alive until a call points it elsewhere
        elif copied:
            statics = self._copied_statics
            if not exact:
                statics = [s[:batch] for s in statics]
            if len(statics) == 1:
                statics[0].copy_(copied[0])
            else:
                torch._foreach_copy_(statics, list(copied))
        inst.graph.replay()
        if self.written:  # the graph updated its copies of these inputs: the caller's tensors get the update
            if not exact:
                raise RuntimeError("a graph that updates its inputs in place ran padded to a batch bucket")
            torch._foreach_copy_([inputs[i] for i in self.written], [self._static(i) for i in self.written])

    def _check_in_place(self, inputs: Sequence[torch.Tensor], exact: bool) -> None:
        """The inputs read in place are where the graph was recorded (same memory, same layout)."""
        if not exact:
            raise RuntimeError("a graph that updates its inputs in place ran padded to a batch bucket")
        for i, ptr in zip(self.in_place, self._in_place_ptrs, strict=True):
            x = inputs[i]
            if x.data_ptr() != ptr or not x.is_contiguous():
                raise InputsMoved(f"input {i} (updated in place) moved since the graph was recorded")

    def _free_instance(self, inputs: Sequence[Any]) -> _Instance | None:
        for inst in self.handout:
            if not inst.guard.held():
                return inst
        if len(self.handout) < self.output_sets:
            inst = self._record_instance(inputs)
            self.handout.append(inst)
            return inst
        return None

    def _views(self, outputs: list[Any], batch: int, exact: bool) -> list[Any]:
        if exact:
            return list(outputs)
        return [o[: batch * rows] if rows is not None and isinstance(o, torch.Tensor) else o
                for o, rows in zip(outputs, self.batch_slices, strict=True)]


def _rebuilt(inst: _Instance, inputs: Sequence[torch.Tensor]) -> list[Any]:
    """The instance's outputs, those in the memory of an input read in place rebuilt on the call's tensor."""
    out = list(inst.outputs)
    for j, (i, size, stride, offset) in inst.aliases.items():
        out[j] = inputs[i].as_strided(size, stride, offset)
    return out


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
