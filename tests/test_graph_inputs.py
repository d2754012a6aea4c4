"""Inference CUDA graphs that update an input in place (a KV cache handed to the forward) read and
write the caller's tensor itself (runtime/graphs.py), emulated on any device.

The emulation replaces what needs a GPU and nothing else: "recording" runs the plan once on the
static inputs with the in-place updates undone (as a capture leaves no update behind), and a
"replay" runs the plan on the static buffers for copied inputs and on the call's own tensors for
inputs read in place, writing the results into the recorded output buffers. What is read in place,
copied, rebuilt, kept, checked for moves and recorded again is the real code.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

import streamfuse
import streamfuse.capture.backend as backend_module
from streamfuse.runtime import compiled as compiled_module
from streamfuse.runtime import graphs
from streamfuse.runtime.graphs import MAX_MOVES, GraphRunner, OutputGuard, _Instance


class _Replay:
    """The emulated graph of one instance: replay() runs the plan where the recorded graph reads."""

    def __init__(self, inst: _EmulatedInstance):
        self.inst = inst
        self.runner: GraphRunner | None = None
        self.inputs: Any = None

    def replay(self) -> None:
        assert self.runner is not None and self.inputs is not None
        statics = [self.inputs[i] if t is None else t for i, t in enumerate(self.runner.static_inputs)]
        fresh = self.inst.exe.run(statics)[: self.inst.exe.graph.user_outputs]
        for out, value in zip(self.inst.outputs, fresh, strict=True):
            if isinstance(out, torch.Tensor):
                out.copy_(value)


class _EmulatedInstance(_Instance):
    def __init__(self, exe: Any, static_inputs: list[torch.Tensor], sources: Any = None, copied: Any = None):
        copied = list(range(len(static_inputs))) if copied is None else copied
        self.exe = exe
        with exe.writebacks_undone(static_inputs):  # a capture applies no update
            results = exe.run(static_inputs)
        self.reserved_bytes = 0
        self._adopt(exe, results, static_inputs, copied)
        del results
        self.copy_nodes, self.exec, self.held = [], 0, []
        self.graph = _Replay(self)  # type: ignore[assignment]
        self.guard = OutputGuard(self.outputs)


class _EmulatedRunner(GraphRunner):
    def _replay(self, inst: _Instance, inputs: Any, batch: int, exact: bool) -> None:
        inst.graph.runner, inst.graph.inputs = self, inputs  # type: ignore[attr-defined]
        try:
            super()._replay(inst, inputs, batch, exact)
        finally:
            inst.graph.inputs = None  # type: ignore[attr-defined]


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    original = compiled_module.CompiledGraph.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.use_graphs = self.graph_skip is None

    monkeypatch.setattr(compiled_module.CompiledGraph, "__init__", init)
    monkeypatch.setattr(compiled_module, "GraphRunner", _EmulatedRunner)
    monkeypatch.setattr(graphs, "_Instance", _EmulatedInstance)
    monkeypatch.setattr(compiled_module, "_capturing", lambda: False)
    monkeypatch.setattr(compiled_module, "graph_memory_limit", lambda device, fraction: float("inf"))


def _update_and_compare(compiled: Any, step: Any, cache: torch.Tensor, want: torch.Tensor, calls: int,
                        seed: int) -> None:
    """`calls` updates of `cache` at positions 0, 1, ... through `compiled`, and of its copy `want`
    through `step` eagerly: every result and the caches themselves equal."""
    with torch.no_grad():
        for k in range(calls):
            pos = torch.tensor([k])
            new = torch.randn(1, cache.shape[1], generator=torch.Generator().manual_seed(seed + k))
            torch.testing.assert_close(compiled(cache, pos, new), step(want, pos, new), rtol=1e-6, atol=1e-6,
                                       msg=lambda m, k=k: f"call {k}: {m}")
            torch.testing.assert_close(cache, want, rtol=0, atol=0, msg=lambda m, k=k: f"call {k}, cache: {m}")


def _plan() -> Any:
    return backend_module.compiled_graphs[-1].compiled


def _runner(plan: Any) -> Any:
    return next(iter(plan._runners.values()))


def test_a_cache_is_updated_where_it_is_and_not_kept_alive(emulated: None, config: streamfuse.Config) -> None:
    """One cache over several calls: read and written in place (no static copy, no copy back), the
    call's results equal eager's, and the graph keeps no reference to the cache (transformers makes
    a new one per generate() call: holding the old one moved every new one, run 74)."""
    def step(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, pos, new)
        return cache.sum(0) * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=streamfuse.make_backend(config))
    cache = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    _update_and_compare(compiled, step, cache, cache.clone(), calls=4, seed=1)
    plan = _plan()
    runner = _runner(plan)
    assert plan.stats["graphs"] == 1 and plan.inputs_moved == 0
    assert runner.in_place == [0] and runner.written == [] and runner.static_inputs[0] is None
    assert "the recorded graphs read and write them where they are" in plan.explain(source=False)
    gone = weakref.ref(cache)
    del cache
    gc.collect()
    assert gone() is None  # fails when a recorded result (the in-place update returns the cache) is kept


def test_a_result_in_the_cache_is_rebuilt_on_the_call_s_tensor(emulated: None, config: streamfuse.Config) -> None:
    """A result that is a view of the updated cache comes back as a view of the caller's cache at
    this call (its values equal eager's), not as a tensor the graph held on to."""
    def step(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache.index_copy_(0, pos, new)
        return cache[:4], cache.mean(1)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=streamfuse.make_backend(config))
    cache = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    _update_and_compare(compiled, step, cache, cache.clone(), calls=3, seed=10)
    runner = _runner(_plan())
    assert runner.in_place == [0]
    gone = weakref.ref(cache)
    del cache
    gc.collect()
    assert gone() is None


def test_a_moved_cache_records_again_then_is_copied(emulated: None, config: streamfuse.Config) -> None:
    """A call with another cache tensor records the graph again; after MAX_MOVES moves the graph
    copies the cache in and back. Every call, and every cache, equals eager's."""
    def step(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, pos, new)
        return torch.tanh(cache).amax(1)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=streamfuse.make_backend(config))
    caches = [torch.randn(8, 4, generator=torch.Generator().manual_seed(20 + i)) for i in range(MAX_MOVES + 2)]
    wants = [c.clone() for c in caches]
    order = [0, 0] + [i for i in range(1, MAX_MOVES + 2) for _ in range(2)] + [0]
    with torch.no_grad():
        for k, which in enumerate(order):
            pos = torch.tensor([k % 8])
            new = torch.randn(1, 4, generator=torch.Generator().manual_seed(k))
            torch.testing.assert_close(compiled(caches[which], pos, new), step(wants[which], pos, new),
                                       rtol=1e-6, atol=1e-6, msg=lambda m, k=k: f"call {k}: {m}")
            for c, w in zip(caches, wants, strict=True):
                torch.testing.assert_close(c, w, rtol=0, atol=0, msg=lambda m, k=k: f"call {k}, caches: {m}")
    plan = _plan()
    assert plan.inputs_moved == MAX_MOVES
    runner = _runner(plan)
    assert runner.in_place == [] and runner.written == [0]
    assert "copies the others in and back" in plan.explain(source=False)


def test_a_static_marked_cache_renewed_by_the_caller_is_bound_again_once(emulated: None,
                                                                         config: streamfuse.Config) -> None:
    """transformers' own compile (CompileConfig) marks its static cache static: AOTAutograd lists it
    among the static inputs, which the backend binds by identity; generate() makes a new cache every
    call. The first call with a new cache binds the graph again with the cache as an argument (read
    in place), once; before, every later call ran the plan taking every argument, without graphs."""
    def step(cache: torch.Tensor, pos: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, pos, new)
        return cache.sum(0) * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=streamfuse.make_backend(config))
    first = len(backend_module.compiled_graphs)
    for renewal in range(3):
        cache = torch.randn(16, 32, generator=torch.Generator().manual_seed(renewal))
        torch._dynamo.mark_static_address(cache)
        _update_and_compare(compiled, step, cache, cache.clone(), calls=3, seed=10 * renewal)
    graphs = [g for g in backend_module.compiled_graphs[first:] if g is not None]
    assert len(graphs) == 1, graphs  # Dynamo did not compile again
    (graph,) = graphs
    assert graph.unbound_updates and graph._fallback is None and graph.static == []
    runner = _runner(graph.compiled)  # replays: the cache read in place, or copied once it moved (here each
    assert 0 in runner.in_place + runner.written  # new cache is made while the old one lives, so it moves)
    assert graph.compiled.inputs_moved <= MAX_MOVES
    assert "passed as arguments" in graph.explain(source=False)
