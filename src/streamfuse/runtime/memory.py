"""Device memory that recorded CUDA graphs keep, bounded, and what happens when the device runs out.

Every recorded inference graph (runtime/graphs.GraphRunner: its static inputs and each instance's
pool) keeps its memory between calls. A model called at many shapes (one specialization per new
sequence length, one graph per batch bucket) would keep all of them: run 69 filled the H200's 140 GB
with the graphs of a few shapes of a 0.85 B Llama, and then even eager calls of the same process ran
out of memory. So:

- `LEDGER` lists the recorded graphs of every compiled model on each device, least recently
  replayed first, with what each keeps. When a new recording brings the total over
  Config.graph_memory_fraction of the device's memory, the least recently replayed graphs of any
  model are dropped (their next call records them again).
- `on_out_of_memory` is what the entry points (CompiledGraph.__call__, the backend's compiled
  graphs) do when a call raises torch.OutOfMemoryError: drop every recorded graph on the device,
  collect garbage (a compiled model the caller dropped may sit in a reference cycle with its graphs),
  return cached blocks to the device, and run the call once more. A second failure is raised: the
  memory streamfuse could give back is given back, and eager would need about the same. A graph
  that updates its inputs in place is never run again (its first attempt may have applied part of
  its updates).
"""

from __future__ import annotations

import gc
import operator
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch

T = TypeVar("T")


_POINTERS_EQUAL: Callable[[list[Any], list[Any], list[int]], bool] | None = getattr(
    torch._C, "_tensors_data_ptrs_at_indices_equal", None)
"""torch's C++ loop `tensors[i].data_ptr() == ptrs[i] for i in indices` (CUDA builds only; Inductor's
CUDA graph trees check their static inputs with it on every call)."""
_DATA_PTR = torch.Tensor.data_ptr


def picker(indices: list[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """The items of a sequence at `indices`, as a tuple (one C call: operator.itemgetter)."""
    if not indices:
        return lambda seq: ()
    get = operator.itemgetter(*indices)
    return get if len(indices) > 1 else (lambda seq: (get(seq),))


class PointerCheck:
    """Where the tensors at positions `at` of a list kept their memory when built: `same(tensors)` on
    every call says whether they still do (a `.data` swap moves a parameter without bumping its version
    counter, and a recorded CUDA graph or a bound plan would read the old memory). One C++ loop where
    torch has it (CUDA builds), else one C-level map over `Tensor.data_ptr`."""

    def __init__(self, tensors: Sequence[Any], at: list[int]):
        self.at = list(at)
        self.expected: list[int | None] = [None] * len(tensors)
        """The pointers at their positions in `tensors` (the C++ loop's layout), None elsewhere."""
        for i in self.at:
            self.expected[i] = tensors[i].data_ptr()
        self._pick = picker(self.at)
        self._values = self._pick(self.expected)

    def same(self, tensors: Sequence[Any]) -> bool:
        if not self.at:
            return True
        if _POINTERS_EQUAL is not None and type(tensors) is list:
            return _POINTERS_EQUAL(tensors, self.expected, self.at)
        return tuple(map(_DATA_PTR, self._pick(tensors))) == self._values


class GraphOwner(Protocol):
    def graph_bytes(self, key: Any) -> int | None:
        """What the graph recorded under `key` keeps, or None once there is none."""

    def drop_graph(self, key: Any) -> None:
        """Forget the graph recorded under `key` (its memory returns once nothing replays it)."""


class GraphLedger:
    """Recorded graphs of all compiled models, least recently replayed first."""

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[int, Any], tuple[weakref.ref[Any], torch.device]] = OrderedDict()
        self.dropped = 0
        """Graphs dropped to stay within the limit or after running out of memory (for stats)."""

    def add(self, owner: GraphOwner, key: Any, device: torch.device, limit: float) -> None:
        """A graph was recorded: drop the least recently replayed others while the device's graphs
        keep more than `limit` bytes (graph_memory_limit)."""
        self._entries[(id(owner), key)] = (weakref.ref(owner), device)
        self._entries.move_to_end((id(owner), key))
        live = self._live(device)
        total = sum(bytes_ for _, _, _, bytes_ in live)
        for entry_key, other, other_key, bytes_ in live:  # least recently replayed first
            if total <= limit:
                break
            if other is owner and other_key == key:
                continue  # the new graph stays: its call replays it now
            self._drop(entry_key, other, other_key)
            total -= bytes_

    def touch(self, owner: GraphOwner, key: Any) -> None:
        """The graph under `key` replays: it becomes the most recently used."""
        entry_key = (id(owner), key)
        entry = self._entries.get(entry_key)
        if entry is not None and entry[0]() is owner:
            self._entries.move_to_end(entry_key)

    def release(self, device: torch.device) -> int:
        """Drop every recorded graph on `device`; how many were dropped."""
        live = self._live(device)
        for entry_key, owner, key, _ in live:
            self._drop(entry_key, owner, key)
        return len(live)

    def kept_bytes(self, device: torch.device) -> int:
        return sum(bytes_ for *_, bytes_ in self._live(device))

    def _live(self, device: torch.device) -> list[tuple[tuple[int, Any], Any, Any, int]]:
        """(entry key, owner, graph key, bytes) of the device's graphs that still exist, oldest first;
        forgets the others (their owner was collected, or dropped the graph itself)."""
        live = []
        for entry_key, (ref, dev) in list(self._entries.items()):
            owner = ref()
            bytes_ = owner.graph_bytes(entry_key[1]) if owner is not None else None
            if bytes_ is None:
                del self._entries[entry_key]
            elif dev == device:
                live.append((entry_key, owner, entry_key[1], bytes_))
        return live

    def _drop(self, entry_key: tuple[int, Any], owner: Any, key: Any) -> None:
        owner.drop_graph(key)
        self._entries.pop(entry_key, None)
        self.dropped += 1


LEDGER = GraphLedger()


def storage_bytes(tensors: list[Any]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if isinstance(t, torch.Tensor)}
    return sum(storages.values())


def graph_memory_limit(device: torch.device, fraction: float) -> float:
    """Bytes the recorded graphs on `device` may keep (Config.graph_memory_fraction of its memory)."""
    return fraction * torch.cuda.get_device_properties(device).total_memory


def reclaim(device: torch.device) -> None:
    """Collect garbage and give cached blocks back to the device (after graphs were dropped)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


_handling = 0
"""on_out_of_memory calls in progress: only the outermost one handles (a backend graph calls a
CompiledGraph, a model its specializations)."""


def on_out_of_memory(call: Callable[[], T], device: torch.device | None = None, retry: bool = True) -> T:
    """`call()`; if it runs out of device memory, drop every recorded graph on the device (None: the
    current CUDA device), reclaim, and call once more. `retry=False` for a graph that updates its
    inputs in place (an optimizer step, running statistics): a call that failed half-way may have
    applied some updates, and running it again would apply them twice, so its error is raised as
    eager's would be."""
    global _handling
    if _handling or not retry:
        return call()
    _handling += 1
    try:
        try:
            return call()
        except torch.OutOfMemoryError:
            pass
        # outside the except block: its traceback holds the failed call's frames and their tensors
        device = device or torch.device("cuda", torch.cuda.current_device())
        dropped = LEDGER.release(device)
        reclaim(device)
        warnings.warn(f"streamfuse: a call ran out of device memory; dropped {dropped} recorded CUDA graph(s), "
                      "collected garbage and ran it again (Config.graph_memory_fraction bounds what recorded "
                      "graphs keep)", UserWarning, stacklevel=3)
        return call()
    finally:
        _handling -= 1
