"""CUDA graphs for the backend's training graphs: AOTAutograd's forward and backward.

An inference graph copies its inputs into static buffers (runtime/graphs.py). A training graph
cannot afford that: the backward's inputs are every activation the forward saved, and both take
every parameter. Here an input whose memory the caller passes at the same address on consecutive
calls (parameters, which optimizers update in place; the forward's saved activations, which live in
the forward graph's buffers; a batch the allocator keeps placing at the same address) is **read in
place**: the graph is recorded reading it where it is, and a call replays only if each such input
is at that address again (same strides), otherwise it runs step by step on streams. The other
inputs (the loss's incoming gradient, a label tensor that moves) are copied into static buffers.

Outputs:
- the forward's results that the caller sees (AOTAutograd's user outputs and input mutations:
  the loss, logits, new batch-norm statistics) are copied out on every replay (small);
- the rest (the activations saved for backward; the backward's gradients) are the graph's own
  buffers, handed out on each replay. A replay happens only while no one references the previous
  replay's outputs (Python reference counts, tensor and storage use counts against their values
  right after capture): a forward called twice before its backward (two micro-batches, a module
  called twice in one step), a caller that keeps a gradient tensor, or `retain_graph` make the call
  run step by step instead, so saved activations or gradients are never overwritten while visible.
  The backward's buffers go out as new tensors on their storage: autograd's accumulation adopts a
  gradient tensor no one else references as `p.grad` (the graph's own tensor would be cloned: one
  more copy of the parameters per step); `p.grad` then holds the storage, so the next backward
  replays once `zero_grad()` has freed it (set_to_none, the default). Where `p.grad` is kept
  (gradient accumulation over micro-batches), a second instance of the backward's graph is
  recorded and replays while the first is held: autograd adds its gradients into `p.grad`, so its
  own buffers are free again at the next call.
- an output that aliases an input read in place is rebuilt from the caller's tensor (no reference
  to it is kept: the forward's guard must see its saved activations freed after the backward);
  one that aliases a copied input's buffer (the batch, saved for the backward) is handed out like
  the graph's other buffers: the next copy into it happens only at a replay, which the guard allows
  only once no one references it.

Buffers are released during capture as in a step-by-step run (a buffer read on another stream is
held until the capture ends), so a graph needs about the memory a step-by-step call needs.

Memory shared by forward and backward (Config.training_shared_pool), so that the saved activations
and the gradients do not each hold memory of their own for good (run 130: 318-388 MiB less than
separate pools for GPT-2 and BERT-base; still above eager's, docs/PERF.md session 33):
- the forward hands out its saved activations as tensors that own no memory, keeping the owning
  ones aside (PinnedGraph.owners);
- the backward is recorded into the forward's pool, takes those owning tensors over for the inputs
  it reads in place from them, and releases each after its last reader, so its temporaries and
  gradients reuse that memory (and the forward's freed temporaries), as eager's backward does;
- a replay of the backward therefore overwrites the saved activations, and a replay of the forward
  may overwrite the backward's gradients. So the forward replays only while none of that backward's
  gradients is referenced (PinnedGraph.busy; the usual loop frees them in zero_grad before the next
  forward), and the backward runs step by step under retain_graph;
- where the gradients stay referenced into the next forward (gradient accumulation keeps p.grad),
  the forward records again with a pool of its own and the backward follows at its next call: from
  then on the two pools are separate, as they are with the setting off.

The graph is recorded once the set of inputs read in place stopped changing between two calls
(the forward at its third call, the backward at its fifth: its saved activations move into the
forward graph's buffers when that graph starts replaying), or at the sixth call regardless.
Dropout's generated kernels read their counter offset from device memory, which every call (a
replay too) advances on the device, so each replay draws a fresh mask (ir/rng.py); a graph whose
random numbers come from ATen never records (explain says so).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from streamfuse.profile.timing import blas_workspaces_in_pool
from streamfuse.runtime.compiled import CompiledGraph, _capturing, _settle_generators
from streamfuse.runtime.fallback import failure_text
from streamfuse.runtime.graphs import OutputGuard
from streamfuse.runtime.memory import storage_bytes

SMALL_INPUT_BYTES = 1 << 16
"""Inputs up to this size are always copied, even when they stayed put: a loss's incoming gradient
or a label tensor lands at the same address two calls in a row by chance and moves the next (run
61), and copying them costs little. Inputs the graph writes back into, and parameters and buffers
(AOTAutograd's static inputs), are read in place whatever their size."""
FRESH_INPUT_PREFIX = "tangents_"
"""AOTAutograd's name for the backward's incoming gradients (the loss's gradient of the logits):
autograd allocates them anew on every call, so an address that repeated is chance, and they are
always copied (run 66: resnet50's 128 KB logits gradient sat at one address for two calls, was
read in place, then moved: the backward recorded again and ran 10 of 12 calls step by step)."""
RECORD_BY_CALL = 6
"""Record at this call even if the inputs read in place still changed at the previous one."""
MISSES_BEFORE_RERECORD = 3
"""Consecutive calls whose in-place inputs moved before the graph is dropped and observed again."""
MAX_RECORDINGS = 3
"""Recordings per training graph (the first and two after inputs moved for good)."""


def keeps_graph() -> bool:
    """The running backward was called with retain_graph (its saved tensors are read again later)."""
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())  # type: ignore[attr-defined]


def is_dense(t: torch.Tensor) -> bool:
    """Every element at its own address, no gaps (a copy into empty_strided of its strides works)."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1),
                               key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _same_layout(t: torch.Tensor, shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """`t` has the plan's shape and strides (dims of size 1 aside, whose stride nothing reads)."""
    return tuple(t.shape) == tuple(shape) and all(
        size == 1 or a == b for size, a, b in zip(shape, t.stride(), strides, strict=True))


@dataclass
class _Output:
    kind: str
    """"pool" (a graph buffer handed out), "copy" (copied out on every replay), "alias" (rebuilt
    from input `index`), "fixed" (a constant or non-tensor value returned as is)."""
    index: int = -1
    value: Any = None
    geometry: tuple[tuple[int, ...], tuple[int, ...], int] | None = None


_OFFERS: weakref.WeakSet[PinnedGraph] = weakref.WeakSet()
"""Forward graphs whose saved activations' memory a backward may take over (PinnedGraph.owners)."""


def on_storage(storage: Any, like: torch.Tensor, offset: int | None = None) -> torch.Tensor:
    """A tensor on `storage` with the dtype, device, shape and strides of `like` (and its storage
    offset unless `offset` is given)."""
    return torch.empty(0, dtype=like.dtype, device=like.device).set_(
        storage, like.storage_offset() if offset is None else offset, like.shape, like.stride())


def unowned(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors over the same memory as `tensors` that own none of it (one storage per distinct
    storage, so views of one buffer stay views of one storage)."""
    storages: dict[int, Any] = {}
    result = []
    for t in tensors:
        base = t.untyped_storage()
        ptr = base.data_ptr()
        if ptr not in storages:
            storages[ptr] = torch._C._construct_storage_from_data_pointer(  # type: ignore[attr-defined]
                ptr, t.device, base.nbytes())
        result.append(on_storage(storages[ptr], t))
    return result


class PinnedGraph:
    """One recorded CUDA graph of a plan whose `pinned` inputs are read in place."""

    def __init__(self, compiled: CompiledGraph, args: list[Any], pinned: list[bool], copy_outputs: set[int],
                 fresh_aliases: bool = False, offer: bool = False, source: PinnedGraph | None = None):
        """`fresh_aliases`: hand out each buffer as a new tensor on its storage (the backward's
        gradients: autograd's accumulation adopts a gradient no one else references, and clones one
        that is referenced, as the graph's own tensor is). `offer` (a forward): hand out the buffers
        as tensors that own no memory and keep the owning ones in `owners`, for the backward to take
        over. `source` (a backward): the forward whose `owners` this graph takes over for the inputs
        it reads in place from them: it is recorded into that forward's pool and releases each after
        its last reader (the module's docstring)."""
        exe = compiled.base
        self.fresh_aliases = fresh_aliases
        self.exe = exe
        self.pinned_at = [i for i, p in enumerate(pinned) if p]
        self.copied_at = [i for i, p in enumerate(pinned) if not p]
        self.owners: dict[int, torch.Tensor] = {}
        """The owning tensors of the buffers handed out (by storage address), while no backward took them."""
        self.sharers: list[PinnedGraph] = []
        """Backwards recorded into this graph's pool: their gradients may lie in memory this graph
        writes, so it replays only while none of theirs is referenced (busy)."""
        self.retired = False
        """Replaced by a recording with a pool of its own: a backward that took its memory records again."""
        self.taken: list[int] = []
        if source is not None and source.owners:
            self.taken = [i for i in self.pinned_at if args[i].untyped_storage().data_ptr() in source.owners]
        self.source = source if self.taken else None
        """The forward whose saved activations' memory this graph took over (inputs at `taken`)."""
        self.where = [(args[i].data_ptr(), args[i].stride()) for i in self.pinned_at]
        self.shapes = [args[i].shape for i in self.copied_at]
        self.buffers: list[torch.Tensor] = []
        """Where each copied input lands before a replay: memory of the graph's pool, not owned here
        (_landing_buffers)."""
        with exe.writebacks_undone(args):  # recording runs the plan: no update may be applied twice
            outputs = self._record(list(args))
        # the outputs written back into inputs (Graph.writebacks) were copied inside the graph (into
        # inputs read in place: ReplayGraph checks), and the caller does not see them
        outputs = outputs[: exe.graph.user_outputs]
        self.outputs = self._classify(outputs, args, copy_outputs)
        del outputs
        if offer:
            self._offer()
        # no local may reference an output or a buffer now (not even a loop variable): the guard's
        # baseline is the idle state
        self.handed = [o.value for o in self.outputs if o.kind == "pool"]
        self.guard = OutputGuard(self.handed)
        if self.source is not None:
            self.source.sharers.append(self)

    def _offer(self) -> None:
        """Keep the owning tensors of the handed-out buffers aside and hand out ones that own nothing."""
        pool = [o for o in self.outputs if o.kind == "pool"]
        for o, view in zip(pool, self._unowned([o.value for o in pool]), strict=True):
            self.owners.setdefault(o.value.untyped_storage().data_ptr(), o.value)
            o.value = view
        if self.owners:
            _OFFERS.add(self)

    def _unowned(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return unowned(tensors)

    def busy(self) -> str | None:
        """Why this graph may not replay now: "held" (its previous outputs are referenced), "sharer"
        (a backward recorded into its pool has gradients referenced), or None."""
        if self.guard.held():
            return "held"
        if any(s.guard.held() for s in self.sharers):
            return "sharer"
        return None

    def _take(self, staged: list[Any], args: list[Any]) -> None:
        """Put the source forward's owning tensors at the `taken` inputs of the capture's `staged`
        inputs (donated: released after their last reader) and leave the forward none."""
        assert self.source is not None
        owners = self.source.owners
        for i in self.taken:
            staged[i] = on_storage(owners[args[i].untyped_storage().data_ptr()].untyped_storage(), args[i])
        owners.clear()  # what the forward kept but this graph does not read stays unreferenced in its pool
        _OFFERS.discard(self.source)

    def memory(self) -> dict[str, int]:
        """Bytes this graph keeps between calls, outside its pool's free blocks: the buffers it hands
        out (saved activations or gradients; distinct storages) and those it copies out of on every
        replay; and the bytes its copied inputs land in, inside the pool (free between replays).
        `shares_pool`: forward and backward share one pool (Config.training_shared_pool), so the
        forward's handed-out bytes lie in blocks the backward's buffers reuse once it has read them."""
        return {"handed_out": storage_bytes([o.value for o in self.outputs if o.kind == "pool"]),
                "copied_out": storage_bytes([o.value for o in self.outputs if o.kind == "copy"]),
                "input_buffers": storage_bytes(self.buffers),
                "inputs_read_in_place": len(self.pinned_at), "inputs_copied": len(self.copied_at),
                "shares_pool": int(bool(self.sharers or self.source))}

    def _record(self, args: list[Any]) -> list[Any]:
        """Capture the plan into self.graph (its own pool); the captured outputs. The warm-up reads
        the caller's tensors; the capture reads the copied inputs from _landing_buffers."""
        exe = self.exe
        caller = torch.cuda.current_stream(exe.device)
        warm = torch.cuda.Stream(device=exe.device)
        warm.wait_stream(caller)
        with torch.cuda.stream(warm):  # loads every kernel outside capture
            exe.run(args)
        caller.wait_stream(warm)
        self.graph = torch.cuda.CUDAGraph()
        self.pool = self.source.pool if self.source is not None else torch.cuda.graph_pool_handle()
        # the capture's cuBLAS workspaces in its own pool (not the warm-up's, from the default pool)
        with blas_workspaces_in_pool(), torch.cuda.graph(self.graph, pool=self.pool):
            staged, landing = self._landing_buffers(args)
            if self.source is not None:
                self._take(staged, args)
            outputs = exe.run(staged, donate=frozenset(self.copied_at + self.taken))
        for t, (ptr, nbytes, offset) in landing:
            storage = torch._C._construct_storage_from_data_pointer(ptr, t.device, nbytes)  # type: ignore[attr-defined]
            self.buffers.append(on_storage(storage, t, offset))
        return outputs

    def _landing_buffers(self, args: list[Any]) -> tuple[list[Any], list[tuple[torch.Tensor, tuple[int, int, int]]]]:
        """The capture's inputs: the caller's tensors read in place, and for each copied input a buffer
        allocated in the graph's pool and handed to the run (Executable.run's `donate`), which
        releases it after its last reader, so that the capture's later buffers (a backward's
        gradients) reuse its memory. self.buffers keeps views of that memory that own nothing: each
        replay copies the inputs in before the graph runs, when no buffer of the previous replay is
        referenced any more (the guard), and the graph's own order puts every reuse after the last
        read. Before this, a static buffer per copied input lived outside the pool for good: GPT-2's
        incoming logits gradient, 197 MiB, beside the one autograd hands in (PERF.md, session 30)."""
        staged = list(args)
        landing = []
        for i in self.copied_at:
            t = args[i]
            staged[i] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=self.exe.device)
            landing.append((t, (staged[i].untyped_storage().data_ptr(), staged[i].untyped_storage().nbytes(),
                                staged[i].storage_offset())))
        return staged, landing

    def _launch(self, args: list[Any]) -> None:
        """Run the recorded graph (inputs read in place are where `args` has them: matches() said so)."""
        self.graph.replay()

    def _classify(self, outputs: list[Any], args: list[Any], copy_outputs: set[int]) -> list[_Output]:
        # not the inputs taken over from the forward: their memory was released during the capture,
        # and an output (a gradient) that starts where one of them did is this graph's own buffer
        pinned_storage = {args[i].untyped_storage().data_ptr(): i for i in self.pinned_at if i not in self.taken}
        constants = {id(t) for t in self.exe.graph.constants.values()}
        result = []
        for j, o in enumerate(outputs):
            if not isinstance(o, torch.Tensor) or id(o) in constants:
                result.append(_Output("fixed", value=o))
                continue
            if o.device.type != self.exe.device.type:
                raise RuntimeError(f"output {j} is a {o.device} tensor: a CUDA graph cannot produce it")
            base = o.untyped_storage().data_ptr()
            if base in pinned_storage:
                i = pinned_storage[base]
                same = o is args[i]
                result.append(_Output("alias", index=i, geometry=None if same else
                                      (tuple(o.shape), tuple(o.stride()), o.storage_offset())))
            elif j in copy_outputs:
                result.append(_Output("copy", value=o))
            else:
                result.append(_Output("pool", value=o))
        return result

    def moved(self, args: list[Any]) -> list[int]:
        """The inputs read in place that are not where the graph reads them (for explain)."""
        return [i for i, (ptr, stride) in zip(self.pinned_at, self.where, strict=True)
                if args[i].data_ptr() != ptr or args[i].stride() != stride]

    def matches(self, args: list[Any]) -> bool:
        for i, (ptr, stride) in zip(self.pinned_at, self.where, strict=True):
            t = args[i]
            if t.data_ptr() != ptr or t.stride() != stride:
                return False
        return all(args[i].shape == shape for i, shape in zip(self.copied_at, self.shapes, strict=True))

    def replay(self, args: list[Any]) -> list[Any]:
        if self.buffers:
            torch._foreach_copy_(self.buffers, [args[i] for i in self.copied_at])
        self._launch(args)
        # one clone each, not views of one buffer (graphs.fresh_copies): these are the outputs of an
        # autograd function, which a caller may modify in place, as it may eager's
        copies = iter([o.value.clone() for o in self.outputs if o.kind == "copy"])
        result = []
        fresh = self.fresh_aliases
        for o in self.outputs:
            if o.kind == "pool":
                # the alias holds the storage: the guard (storage use counts) keeps the next replay
                # from writing while the caller (p.grad) holds it
                result.append(o.value.detach() if fresh else o.value)
            elif o.kind == "fixed":
                result.append(o.value)
            elif o.kind == "copy":
                result.append(next(copies))
            elif o.geometry is None:
                result.append(args[o.index])
            else:
                size, stride, offset = o.geometry
                result.append(torch.as_strided(args[o.index], size, stride, offset))
        return result


@dataclass
class ReplayStats:
    replays: int = 0
    recordings: int = 0
    step_by_step: int = 0
    held: int = 0
    """Calls that ran step by step because the previous replay's outputs were still referenced."""
    moved: int = 0
    """Calls that ran step by step because an input read in place was elsewhere."""
    retained: int = 0
    """Backward calls that ran step by step under retain_graph: a replay into the forward's memory
    would overwrite the saved activations a later backward reads again."""
    history: list[str] = field(default_factory=list)


class ReplayGraph:
    """A backend training graph (forward or backward) that records and replays a PinnedGraph."""

    def __init__(self, compiled: CompiledGraph, role: str, copy_outputs: set[int],
                 static: frozenset[str] = frozenset()):
        self.compiled = compiled
        self.role = role
        self.copy_outputs = copy_outputs
        self.static = {i for i, n in enumerate(compiled.base.graph.inputs) if n.name in static}
        """Positions of the parameters and buffers among the inputs: read in place once they stayed
        put, whatever their size (the small ones, layer-norm weights and biases, were copied on
        every replay: 192 copies of a few KB per GPT-2 training step, 539 µs in run 106)."""
        self.graph: PinnedGraph | None = None
        self.spare: PinnedGraph | None = None
        """A backward's second instance, replayed while the first one's gradients are held (_record_spare)."""
        self.reason: str | None = self._unusable(compiled)
        """Why this graph never records a CUDA graph, or None."""
        self.share = role == "forward" and compiled.config.training_shared_pool
        """Record the forward offering its saved activations' memory to the backward (PinnedGraph)."""
        self.calls = 0
        self._ptrs: list[int] | None = None
        self._pinned: list[bool] | None = None
        self._misses = 0
        self.replay_stats = ReplayStats()

    @classmethod
    def _unusable(cls, compiled: CompiledGraph) -> str | None:
        return cls._device_reason(compiled) or cls._plan_reason(compiled)

    @staticmethod
    def _device_reason(compiled: CompiledGraph) -> str | None:
        exe = compiled.base
        if exe.device.type != "cuda":
            return f"the graph runs on {exe.device}"
        if exe.executor != "triton":
            return f"the {exe.executor} executor runs it"
        return None

    @staticmethod
    def _plan_reason(compiled: CompiledGraph) -> str | None:
        exe = compiled.base
        if exe.rng is not None and exe.draws_on_host():
            return "it draws random numbers (dropout) through ATen, from offsets that advance on the host"
        launches = exe.launches + (exe.rng is not None) + bool(exe.graph.writebacks)  # the offset advance, the copy
        if launches < 2:
            return f"{launches} launch: nothing for a graph to save"
        return None

    def run_flat(self, args: list[Any]) -> list[Any]:
        self.calls += 1
        self.compiled._follow_torch_seed()  # once per call, whichever path below runs it
        args = self.compiled.base.device_scalars(args)  # SDPA's host Philox seed and offset
        stats = self.replay_stats
        graph = self.graph
        if graph is not None and not _capturing():
            if graph.source is not None and graph.source.retired and not graph.matches(args):
                fresh = self._follow(args)
                if fresh is not None:
                    return fresh
            if not graph.matches(args):
                stats.moved += 1
                self._misses += 1
                if self._misses >= MISSES_BEFORE_RERECORD and stats.recordings < MAX_RECORDINGS:
                    names = [n.name for n in self.compiled.base.graph.inputs]
                    moved = [f"%{names[i]} {tuple(args[i].shape)}" for i in graph.moved(args)]
                    stats.history.append(f"call {self.calls}: inputs read in place moved on {self._misses} calls "
                                         f"in a row ({len(moved)}: {', '.join(moved[:4])}); observed again")
                    self.graph, self.spare, self._ptrs, self._pinned, self._misses = None, None, None, None, 0
            else:
                self._misses = 0
                retained = self.role == "backward" and keeps_graph()
                free = next((g for g in (graph, self.spare) if g is not None and g.busy() is None
                             and not (retained and g.source is not None)), None)
                if free is None and self.spare is None and self.role == "backward" and graph.busy():
                    spare = self._record_spare(args)
                    if spare is not None:
                        return spare
                if free is None and self.role == "forward" and graph.busy() == "sharer":
                    fresh = self._unshare(args, graph)
                    if fresh is not None:
                        return fresh
                if free is not None:
                    stats.replays += 1
                    return free.replay(args)
                if retained and graph.busy() is None:
                    stats.retained += 1
                else:
                    stats.held += 1
        elif graph is None and self.reason is None and self.compiled.eager_reason is None \
                and self.compiled._proven and not _capturing():
            recorded = self._observe(args)
            if recorded is not None:
                return recorded
        stats.step_by_step += 1
        return self.compiled.run_flat(args, follow_seed=False)  # drawn above: one draw per call

    def _unshare(self, args: list[Any], graph: PinnedGraph) -> list[Any] | None:
        """The forward's replay is blocked by gradients of the backward recorded into its pool, still
        referenced into this forward (gradient accumulation keeps `p.grad`): record the forward again
        with a pool of its own, from now on (the backward follows at its next call: _follow).
        Returns the new graph's first replay's outputs, or None (step by step)."""
        self.share = False
        if self._pinned is None:
            return None
        fresh = self._record(args, self._pinned, "the backward's gradients, recorded into this graph's pool, "
                                                 "were still held (accumulation): recorded again with a pool "
                                                 "of its own")
        if isinstance(fresh, str):
            self.replay_stats.history.append(f"call {self.calls}: not recorded again: {fresh}")
            return None
        graph.retired = True
        self.graph = fresh
        return fresh.replay(args)

    def _follow(self, args: list[Any]) -> list[Any] | None:
        """The forward whose memory this backward's graph took was recorded again with its own pool
        (_unshare): record this graph again, reading the new forward's buffers, in a pool of its own.
        Returns its first replay's outputs, or None (the usual path for moved inputs)."""
        if self._pinned is None:
            return None
        fresh = self._record(args, self._pinned, "the forward was recorded again with a pool of its own: "
                                                 "recorded again reading its buffers")
        if isinstance(fresh, str):
            self.replay_stats.history.append(f"call {self.calls}: not recorded again: {fresh}")
            return None
        self.graph, self.spare = fresh, None
        return fresh.replay(args)

    def _record_spare(self, args: list[Any]) -> list[Any] | None:
        """A second instance of the backward's graph, recorded when the first one's gradients are
        still held: gradient accumulation keeps `p.grad` (the first instance's buffers, adopted)
        across micro-batches, and autograd adds each later gradient into it, so the second instance's
        buffers are free again at every call. Without it every accumulating backward would run step
        by step. Returns its first replay's outputs, or None (capture failed: step by step)."""
        assert self._pinned is not None
        spare = self._record(args, self._pinned, "the gradients of the last replay were still held (accumulation): "
                                                 "recorded a second instance, replayed while the first is held")
        if isinstance(spare, str):  # the first instance stays in use
            self.replay_stats.history.append(f"call {self.calls}: second instance not recorded: {spare}")
            return None
        self.spare = spare
        return spare.replay(args)

    def _record(self, args: list[Any], pinned: list[bool], note: str,
                source: PinnedGraph | None = None) -> PinnedGraph | str:
        """A recorded PinnedGraph counted in the stats with `note`, or why capture failed. `source`:
        the forward whose memory a backward takes over (PinnedGraph)."""
        try:
            graph = PinnedGraph(self.compiled, args, pinned, self.copy_outputs, fresh_aliases=self.role == "backward",
                                offer=self.share, source=source)
        except Exception as exc:  # noqa: BLE001 - a capture failure leaves the step-by-step path
            if self.compiled.device.type == "cuda":
                torch.cuda.synchronize(self.compiled.device)
                _settle_generators(self.compiled.device)
            return failure_text(exc)
        stats = self.replay_stats
        stats.recordings += 1
        stats.replays += 1  # the caller replays it once now
        stats.history.append(f"call {self.calls}: {note}")
        return graph

    def _observe(self, args: list[Any]) -> list[Any] | None:
        """Track which inputs stay put; record once that set is stable. Returns the first replay's outputs."""
        device = self.compiled.device
        if not all(isinstance(a, torch.Tensor) and a.device.type == device.type for a in args):
            self.reason = f"an input is not a tensor on {device}"
            return None
        nodes = self.compiled.base.graph.inputs
        if len(nodes) != len(args) or not all(_same_layout(a, n.shape, n.strides) for a, n in zip(args, nodes)):
            return None  # this call's layouts differ from the plan's: it runs step by step (checked, copied)
        ptrs = [a.data_ptr() for a in args]
        previous, self._ptrs = self._ptrs, ptrs
        if previous is None:
            return None
        graph = self.compiled.base.graph
        written = set(graph.written_inputs)
        offered = self._offered()
        pinned = [not is_dense(a) or a.untyped_storage().data_ptr() in offered or (
                      p == q and not nodes[i].name.startswith(FRESH_INPUT_PREFIX) and (
                          i in written or i in self.static or a.numel() * a.element_size() > SMALL_INPUT_BYTES))
                  for i, (a, p, q) in enumerate(zip(args, ptrs, previous, strict=True))]
        stable, self._pinned = pinned == self._pinned, pinned
        if not stable and self.calls < RECORD_BY_CALL:
            return None
        self.reason = self._unusable(self.compiled)  # again: a kernel may have failed to compile since
        if self.reason is not None:
            return None
        if any(not pinned[i] for i in written):
            # the graph's copy of such an input would take the update, not the caller's tensor
            if self.calls >= RECORD_BY_CALL:
                self.reason = "an input written in place (a running statistic) moves between calls"
            return None
        source = self._source(args, pinned)
        note = f"recorded, {sum(pinned)} of {len(args)} inputs read in place"
        if source is not None:
            note += "; into the forward's pool, taking over its saved activations' memory"
        graph = self._record(args, pinned, note, source)
        if isinstance(graph, str):
            self.reason = f"capture failed: {graph}"
            return None
        self.graph = graph
        return graph.replay(args)

    def _offered(self) -> set[int]:
        """For a backward (with Config.training_shared_pool): the storages recorded forwards offer
        (their saved activations): read in place whatever their size and from the first call that
        sees them, since they are where the forward's graph writes them on every replay, and their
        memory is taken over (a small one was copied, and the backward recorded a call early)."""
        if self.role != "backward" or not self.compiled.config.training_shared_pool:
            return set()
        return {ptr for g in list(_OFFERS) if not g.retired for ptr in g.owners}

    def _source(self, args: list[Any], pinned: list[bool]) -> PinnedGraph | None:
        """For a backward (with Config.training_shared_pool): the recorded forward that offers the
        memory of inputs this graph reads in place (its saved activations), or None."""
        if self.role != "backward" or not self.compiled.config.training_shared_pool:
            return None
        ptrs = {args[i].untyped_storage().data_ptr() for i, p in enumerate(pinned) if p}
        return next((g for g in list(_OFFERS) if not g.retired and not ptrs.isdisjoint(g.owners)), None)

    @property
    def stats(self) -> dict[str, Any]:
        s = self.replay_stats
        return {**self.compiled.stats, "graphs": int(self.graph is not None) + int(self.spare is not None),
                "replays": s.replays,
                "graph_recordings": s.recordings, "step_by_step_calls": s.step_by_step}

    def explain(self, source: bool = True) -> str:
        s = self.replay_stats
        if self.reason is not None:
            head = f"{self.role} graph: no CUDA graph ({self.reason})"
        else:
            head = (f"{self.role} graph: CUDA graph with inputs read in place; {s.replays} replays, "
                    f"{s.step_by_step} calls step by step ({s.held} because the previous outputs were "
                    f"still referenced, {s.moved} because an input read in place had moved"
                    + (f", {s.retained} under retain_graph" if s.retained else "") + ")")
        lines = [head] + [f"  {h}" for h in s.history]
        lines.append(f"  planned for at most {self.compiled.config.max_streams} stream(s) (Config.training_max_streams: "
                     "each stream keeps its own free blocks in the graph's memory pool)")
        return "\n".join(lines) + "\n" + self.compiled.explain(source)
