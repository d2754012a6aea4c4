"""One recorded CUDA graph of a training graph whose pinned inputs are read in place.

runtime/replay.py decides when a backend training graph records, replays or runs step by step;
a PinnedGraph is one recording: its capture (the copied inputs' landing buffers in its pool, the
inputs a backward takes over from the forward it shares a pool with), how its outputs go out
(handed out, copied out, rebuilt from an input, fixed), the guard that keeps a replay from
overwriting what a caller still references, and what it keeps in memory. The memory sharing
between a forward and its backward (Config.training_shared_pool) is described in replay.py.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from streamfuse.profile.timing import recording
from streamfuse.runtime.compiled import CompiledGraph
from streamfuse.runtime.graphs import OutputGuard
from streamfuse.runtime.memory import storage_bytes


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
        self.reserved = 0
        """Bytes of the block the capture took first in its pool (Config.training_pool_reserve), or 0."""
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
        """Keep the owning tensors of the handed-out buffers aside and hand out ones that own nothing.
        The buffers copied out on every replay go back to the pool: this graph keeps views that own
        nothing and copies out of them right after each replay, so a backward recorded into the pool
        may put its buffers there (GPT-2's logits, 196 MiB, held twice before: copied out, and
        reserved in the pool beside the backward's landing buffer for the logits' gradient). A
        forward replays only while no buffer of such a backward is referenced (busy), as for the
        saved activations' memory."""
        kept = [o for o in self.outputs if o.kind in ("pool", "copy")]
        released = []
        for o, view in zip(kept, unowned([o.value for o in kept]), strict=True):
            if o.kind == "pool":
                self.owners.setdefault(o.value.untyped_storage().data_ptr(), o.value)
            else:
                released.append(o.value)
            o.value = view
        self._release(released)
        if self.owners:
            _OFFERS.add(self)

    def _release(self, owners: list[torch.Tensor]) -> None:
        """Let go of the owning tensors of buffers this graph keeps views of (their memory goes back
        to the graph's pool, which keeps it reserved while the graph lives)."""
        owners.clear()

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
        forward's handed-out bytes lie in blocks the backward's buffers reuse once it has read them.
        `reserved_block`: the block the capture took first in the pool (Config.training_pool_reserve;
        0 or less: none, the source forward's block was large enough)."""
        return {"handed_out": storage_bytes([o.value for o in self.outputs if o.kind == "pool"]),
                "copied_out": storage_bytes([o.value for o in self.outputs if o.kind == "copy"]),
                "input_buffers": storage_bytes(self.buffers),
                "inputs_read_in_place": len(self.pinned_at), "inputs_copied": len(self.copied_at),
                "shares_pool": int(bool(self.sharers or self.source)),
                "reserved_block": self.first_block()}

    def first_block(self) -> int:
        """Bytes of the block the capture takes first in its pool: its probed peak (`reserved`) less
        the block its source forward took, which the pool already holds; 0 or less: none."""
        return self.reserved - (self.source.reserved if self.source is not None else 0)

    def _record(self, args: list[Any]) -> list[Any]:
        """Capture the plan into self.graph (its own pool); the captured outputs. The warm-up reads
        the caller's tensors; the capture reads the copied inputs from _landing_buffers."""
        exe = self.exe
        caller = torch.cuda.current_stream(exe.device)
        warm = torch.cuda.Stream(device=exe.device)
        warm.wait_stream(caller)
        probe = [] if exe.config.training_pool_reserve and exe.stream_runner is None else None
        donate = frozenset(self.copied_at + self.taken)  # what the capture releases after its last reader
        with torch.cuda.stream(warm):  # loads every kernel outside capture
            before = torch.cuda.memory_allocated(exe.device) if probe is not None else 0
            exe.run(list(args), donate=donate if probe is not None else frozenset(), probe=probe)
        caller.wait_stream(warm)
        if probe:
            self.reserved = self._reserve_size(max(probe) - before)
        self.graph = torch.cuda.CUDAGraph()
        self.pool = self.source.pool if self.source is not None else torch.cuda.graph_pool_handle()
        # the capture's cuBLAS workspaces in its own pool (not the warm-up's, from the default pool)
        # thread_local, as Inductor's CUDA graph trees: other threads (a DataLoader's pin-memory thread)
        # may call CUDA while this thread records; the default global mode forbids their unsafe calls
        # (cudaMalloc, cudaHostAlloc) for the capture's duration
        with recording(self.graph, self.pool):
            extra = self.first_block()
            if extra > 0:  # one block, freed at once: the capture's buffers are cut from it
                block = torch.empty(extra, dtype=torch.uint8, device=exe.device)
                del block
            staged, landing = self._landing_buffers(args)
            if self.source is not None:
                self._take(staged, args)
            outputs = exe.run(staged, donate=donate)
        for t, (ptr, nbytes, offset) in landing:
            storage = torch._C._construct_storage_from_data_pointer(ptr, t.device, nbytes)  # type: ignore[attr-defined]
            self.buffers.append(on_storage(storage, t, offset))
        return outputs

    @staticmethod
    def _reserve_size(peak: int) -> int:
        """The block to take for a capture holding `peak` bytes at most (Config.training_pool_reserve):
        whole 2 MiB pages, as the allocator rounds large segments; none under 16 MiB."""
        page = 2 << 20
        return 0 if peak < 8 * page else -(-peak // page) * page

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


def offered_storages() -> set[int]:
    """The storages (data pointers) whose memory recorded forwards offer to a backward."""
    return {ptr for g in list(_OFFERS) if not g.retired for ptr in g.owners}


def offering_forward(ptrs: set[int]) -> PinnedGraph | None:
    """The recorded forward that offers the memory of any of the storages `ptrs`, or None."""
    return next((g for g in list(_OFFERS) if not g.retired and not ptrs.isdisjoint(g.owners)), None)
