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

Buffers are released during capture as in a step-by-step run (a buffer read on another stream where
schedule/release.py places its release; one it cannot place is held until the capture ends), so a
graph needs about the memory a step-by-step call needs. One recorded graph (its capture, outputs,
guard and the memory it shares) is a PinnedGraph (runtime/pinned.py); this module decides when
to record, replay or run step by step.

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

from streamfuse.runtime.compiled import CompiledGraph, _capturing, _settle_generators
from streamfuse.runtime.fallback import failure_text
from streamfuse.runtime.pinned import PinnedGraph, offered_storages, offering_forward

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


class _WarmupPool:
    """One memory pool that every training graph of a device allocates in before it records
    (Config.training_warmup_pool): shared, so that a backward reuses its forward's freed activations
    as in the default pool, and gone once no graph holds it any more."""

    def __init__(self) -> None:
        self.pool = torch.cuda.MemPool()

    def __del__(self) -> None:
        # torch's MemPool destructor empties the pool's cache, which aborts the process while any
        # allocation routing is registered (a capture, or a use_mem_pool): a garbage-collected graph
        # can drop the last holder inside one of ours. Such a pool waits for _release_deferred.
        try:
            unsafe = _in_warmup_pool > 0 or _capturing()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing runs any more
            return
        if unsafe:
            _DEFERRED.append(self.pool)


_DEFERRED: list[torch.cuda.MemPool] = []
"""Warm-up pools whose last holder went while dropping them was unsafe (_WarmupPool.__del__)."""
_in_warmup_pool = 0
"""Calls running inside a warm-up pool now (use_mem_pool registers its routing for that long)."""


def _release_deferred() -> None:
    """Drop the pools _WarmupPool.__del__ kept, at a point where no routing of ours is registered."""
    if _DEFERRED and _in_warmup_pool == 0 and not _capturing():
        _DEFERRED.clear()


_WARMUP_POOLS: weakref.WeakValueDictionary[int, _WarmupPool] = weakref.WeakValueDictionary()
"""The warm-up pool of each device (by index), while a training graph that has not recorded holds it."""


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
        self._warm: _WarmupPool | None = None
        """The memory pool of the calls before this graph records (Config.training_warmup_pool)."""

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
        # one launch pays too: a replay costs ~4 µs against the direct path's launch and per-call work
        # (run 173, H100: one-kernel plans of streamfuse.compile 37-45 µs direct, 22-27 replayed, and
        # those copied their inputs in; this graph reads them where they are)
        if not launches:
            return "the graph launches no kernel: nothing to replay"
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
        pool = self._warmup_pool()
        if pool is not None:
            global _in_warmup_pool
            _in_warmup_pool += 1
            try:
                with torch.cuda.use_mem_pool(pool, self.compiled.device):
                    return self.compiled.run_flat(args, follow_seed=False)
            finally:
                _in_warmup_pool -= 1
        return self.compiled.run_flat(args, follow_seed=False)  # drawn above: one draw per call

    def _warmup_pool(self) -> torch.cuda.MemPool | None:
        """The pool this call allocates in while the graph has not recorded yet and may
        (Config.training_warmup_pool: _WarmupPool), or None (the default pool). Dropped here once the
        graph records or never will; once no graph holds it, its memory goes back to the device with
        the next emptying of the allocator's cache (every capture's start) after the last of its
        tensors is freed."""
        _release_deferred()
        if self.graph is not None or self.reason is not None or self.compiled.eager_reason is not None \
                or _capturing():
            self._warm = None
            return None
        device = self.compiled.device
        if self._warm is None and self.compiled.config.training_warmup_pool and device.type == "cuda":
            self._warm = _WARMUP_POOLS.get(device.index or 0) or _WarmupPool()
            _WARMUP_POOLS[device.index or 0] = self._warm
        return self._warm.pool if self._warm is not None else None

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
        self._warm = None  # free before the capture empties the cache: this call's own buffers are the graph's
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
        return offered_storages()

    def _source(self, args: list[Any], pinned: list[bool]) -> PinnedGraph | None:
        """For a backward (with Config.training_shared_pool): the recorded forward that offers the
        memory of inputs this graph reads in place (its saved activations), or None."""
        if self.role != "backward" or not self.compiled.config.training_shared_pool:
            return None
        return offering_forward({args[i].untyped_storage().data_ptr() for i, p in enumerate(pinned) if p})

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
