"""The backend's training CUDA graphs (runtime/replay.py, runtime/pinned.py) emulated on the CPU at
the level of torch's capture/replay primitives, so that the real ReplayGraph *and* the real
PinnedGraph (its _record: warm-up, landing buffers, `donate`, the probe, the pool reserve, taking
over the forward's saved activations; its _launch, replay, guards) run on CPU tensors with Triton's
interpreter (TRITON_INTERPRET=1, executor "triton": the generated kernels, dropout's device-side
counter included).

tests/replay_emulation.py replaces PinnedGraph._record/_launch instead (reference executor); this
one replaces only what torch.cuda provides:

- torch.cuda.graph(g, pool=...) -> a context that marks a capture as running. Every tensor storage
  newly allocated inside it (a TorchDispatchMode watching every op's outputs) is kept by the pool
  object, as a private CUDA pool keeps its segments while its graphs live (no use-after-free of
  the unowned views PinnedGraph hands out). The one Executable.run issued inside the capture is
  recorded as (executable, its inputs as views *by address*, its outputs as views by address).
- CUDAGraph.replay() -> Executable.run again on tensors at the recorded input addresses (a
  graph reads addresses, not tensors: an input read in place is whatever lies there now), the
  results copied into the recorded output addresses. Writebacks (running statistics) and the
  dropout counter's device-side advance are part of that run, so they happen at every replay.
- Pool reuse, adversarially: a real capture reuses memory freed within it and any free block of
  its pool, and later captures into the same pool (a backward into its forward's) may reuse the
  earlier one's scratch. After each replay the emulation fills with 0xFF bytes (NaN for floats)
  (a) the storages its capture allocated and freed, (b) the pool's storages that were free when
  its capture began, (c) the storages later captures into the same pool allocated. A replay the
  guards should have refused then shows up as NaN (or -1 indices) against eager.
- streams, cuBLAS workspaces, memory_allocated, synchronize, stream-capture queries: no-ops;
  the device gates (backend.training_graph, ReplayGraph._device_reason) accept the CPU.

Not modelled: host work of Executable.run is re-executed on every replay (a value a real capture
bakes in, e.g. a host scalar kernel argument or Executable.refresh_weights, is fresh here); the
real pool's exact address reuse (only the adversarial NaN fill above); multi-stream ordering;
capture-time errors (an op illegal during capture, a sync, a CPU->GPU copy) never happen here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import streamfuse.capture.backend as backend_module
from streamfuse.runtime import compiled as compiled_module
from streamfuse.runtime import pinned as pinned_module
from streamfuse.runtime import replay as replay_module
from streamfuse.runtime.compiled import CompiledGraph
from streamfuse.runtime.executable import Executable
from streamfuse.runtime.replay import ReplayGraph

_REAL_RUN = Executable.run


def _use_count(storage: Any) -> int:
    return torch._C._storage_Use_Count(storage._cdata)  # type: ignore[attr-defined]


def at_address(t: torch.Tensor) -> torch.Tensor:
    """A tensor over `t`'s memory that owns none of it (what a recorded graph holds: an address)."""
    base = t.untyped_storage()
    storage = torch._C._construct_storage_from_data_pointer(  # type: ignore[attr-defined]
        base.data_ptr(), t.device, base.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.shape, t.stride())


class EmulatedPool:
    """A private pool: every storage its captures allocated, with the capture that did (index)."""

    def __init__(self) -> None:
        self.storages: list[tuple[Any, int]] = []
        self.seen: set[int] = set()
        self.captures = 0

    def keep(self, storage: Any, capture: int) -> None:
        ptr = storage.data_ptr()
        if storage.nbytes() and ptr not in self.seen:
            self.seen.add(ptr)
            self.storages.append((storage, capture))

    def free(self) -> list[Any]:
        """Storages no one but the pool holds (their memory is free blocks of the pool)."""
        return [s for s, _ in self.storages if _use_count(s) == 1]


class _KeepAllocations(TorchDispatchMode):
    """Keeps (in the pool) the storage of every op's output that is not an input's storage."""

    def __init__(self, pool: EmulatedPool, capture: int):
        super().__init__()
        self.pool, self.capture = pool, capture

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.set_:  # a view over given memory (an address), no allocation
            return out
        ins = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in ins:
                self.pool.keep(o.untyped_storage(), self.capture)
        return out


class _State:
    capturing: EmulatedCUDAGraph | None = None
    recordings = 0
    replays = 0
    poison = True


class EmulatedCUDAGraph:
    def __init__(self, keep_graph: bool = False):
        self.calls: list[tuple[Executable, list[Any], list[Any]]] = []
        self.pool: EmulatedPool | None = None
        self.capture = -1
        self.free_at_start: list[Any] = []
        self.freed: list[Any] = []
        self.replays = 0

    def replay(self) -> None:
        assert self.pool is not None
        _State.replays += 1
        self.replays += 1
        for exe, inputs, outputs in self.calls:
            fresh = _REAL_RUN(exe, list(inputs))
            for out, value in zip(outputs, fresh, strict=True):
                if isinstance(out, torch.Tensor) and isinstance(value, torch.Tensor) \
                        and (out.data_ptr(), out.stride()) != (value.data_ptr(), value.stride()):
                    out.copy_(value)
            del fresh
        if _State.poison:
            later = [s for s, c in self.pool.storages if c > self.capture]
            for s in (*self.freed, *self.free_at_start, *later):
                s.fill_(255)

    def raw_cuda_graph(self) -> Any:
        raise RuntimeError("no raw graph in the emulation")


@contextlib.contextmanager
def _graph(graph: EmulatedCUDAGraph, pool: EmulatedPool | None = None, stream: Any = None,
           capture_error_mode: str = "global") -> Iterator[None]:
    assert _State.capturing is None, "nested capture"
    pool = pool if pool is not None else EmulatedPool()
    graph.pool, graph.capture = pool, pool.captures
    pool.captures += 1
    graph.free_at_start = pool.free()
    _State.capturing = graph
    try:
        with _KeepAllocations(pool, graph.capture):
            yield
    finally:
        _State.capturing = None
    # what this capture allocated and no one holds once it ends (taken-over inputs were allocated
    # by the forward's capture: free now, and this graph's kernels may have reused them)
    start_free = {s.data_ptr() for s in graph.free_at_start}
    graph.freed = [s for s in pool.free() if s.data_ptr() not in start_free]
    _State.recordings += 1


def _run(self: Executable, inputs: Any, keep_alive: Any = None, one_stream: bool = False,
         donate: frozenset[int] = frozenset(), probe: Any = None) -> list[Any]:
    graph = _State.capturing
    if graph is None:
        return _REAL_RUN(self, inputs, keep_alive, one_stream, donate, probe)
    views = [at_address(t) if isinstance(t, torch.Tensor) else t for t in inputs]
    out = _REAL_RUN(self, inputs, keep_alive, one_stream, donate, probe)
    graph.calls.append((self, views, [at_address(o) if isinstance(o, torch.Tensor) else o for o in out]))
    return out


class _Stream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


def emulate_training_graphs(monkeypatch: pytest.MonkeyPatch, poison: bool = True) -> type[_State]:
    """Backend training graphs on the CPU record and replay emulated CUDA graphs (undone by
    monkeypatch). Returns the emulation's counters (recordings, replays)."""

    def training_graph(compiled: Any, training: Any) -> Any:  # backend.py: minus the device check
        if training is None or not isinstance(compiled, CompiledGraph):
            return compiled
        return ReplayGraph(compiled, training.role, set(range(training.visible)), training.static)

    def device_reason(compiled: CompiledGraph) -> str | None:
        exe = compiled.base
        return None if exe.executor == "triton" else f"the {exe.executor} executor runs it"

    _State.capturing, _State.recordings, _State.replays, _State.poison = None, 0, 0, poison
    monkeypatch.setattr(backend_module, "training_graph", training_graph)
    monkeypatch.setattr(ReplayGraph, "_device_reason", staticmethod(device_reason))
    capturing = lambda: _State.capturing is not None
    monkeypatch.setattr(replay_module, "_capturing", capturing)
    monkeypatch.setattr(compiled_module, "_capturing", capturing)
    monkeypatch.setattr(Executable, "run", _run)
    # profile/timing.recording without the cuBLAS workspace drop and the allocator's routing (no CUDA here)
    monkeypatch.setattr(pinned_module, "recording", lambda graph, pool=None, thread_local=True: _graph(graph, pool))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", EmulatedCUDAGraph)
    monkeypatch.setattr(torch.cuda, "graph", _graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", EmulatedPool)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    real_landing = pinned_module.PinnedGraph._landing_buffers

    def landing_buffers(self: Any, args: list[Any]) -> Any:
        # a real capture runs nothing, so what its copied inputs' buffers hold does not matter there;
        # this one runs the kernels: give the buffers the call's values, or a gather from token ids
        # read uninitialised memory and the capture failed (a helper's GPT-2 run), quietly testing
        # the step-by-step path instead (the copy is not part of the recording)
        staged, landing = real_landing(self, args)
        for i in self.copied_at:
            staged[i].copy_(args[i])
        return staged, landing

    monkeypatch.setattr(pinned_module.PinnedGraph, "_landing_buffers", landing_buffers)
    return _State
