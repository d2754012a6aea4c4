"""Padding a call's batch up to its bucket: tensors made with the batch's size, what the padding
rows hold, and a bucket's plan that fails where the compiled one ran (session 41's sweeps). The
batch-independence analysis and the other bucket rules: test_runtime.py."""

from __future__ import annotations

import pytest
import torch
from helpers import randn

import streamfuse


def test_tensors_made_with_the_batch_size_are_sliced_and_never_summed_over_padding(config) -> None:  # type: ignore[no-untyped-def]
    """A tensor made from the batch's size alone (zeros_like(x), ones(x.shape[0], n)) holds rows of
    the batch: a padded call returns it at the caller's batch, and a sum over its batch dimension
    (which would count the padding rows) keeps the batch from being padded (helper sweep, session 41:
    (4, 16) returned for (3, 16), and `ones_like(x).sum()` 64 instead of 48)."""
    def made(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.zeros_like(x), torch.ones(x.shape[0], 3) * 2, x + 1

    def summed(x: torch.Tensor) -> torch.Tensor:
        return x.sum(-1) / torch.ones_like(x).sum()

    for compiled_batch in (2, 1, 4):  # at 4, batch 3 runs the compiled plan padded
        with torch.no_grad():
            compiled = streamfuse.compile(made, (randn(compiled_batch, 16),), config)
            for batch in (3, 5, 2):
                x = randn(batch, 16, seed=batch)
                got, want = compiled(x), made(x)
                assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in want]
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert compiled.batch_reason is None and compiled.stats["specializations"] == 0
            compiled = streamfuse.compile(summed, (randn(compiled_batch, 16),), config)
            for batch in (3, 5):
                x = randn(batch, 16, seed=batch)
                torch.testing.assert_close(compiled(x), summed(x), rtol=1e-5, atol=1e-6)
            assert compiled.batch_reason is not None and "reduces over the batch" in compiled.batch_reason


def test_padding_rows_repeat_a_real_row(config) -> None:  # type: ignore[no-untyped-def]
    """Padded rows copy the last real row, so an integer divisor input is never zero there (ATen's
    CPU integer division raised on zero-padded rows: helper sweep, session 41)."""
    def fn(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.floor_divide(a, b), a % b

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randint(-20, 20, (2, 16), generator=gen), torch.randint(1, 4, (2, 16), generator=gen)
    compiled = streamfuse.compile(fn, (a, b), config)
    compiled(a, b)
    for batch in (3, 5):
        a, b = torch.randint(-20, 20, (batch, 16), generator=gen), torch.randint(1, 4, (batch, 16), generator=gen)
        assert all(torch.equal(g, w) for g, w in zip(compiled(a, b), fn(a, b), strict=True))
    assert compiled.batch_reason is None and compiled.eager_reason is None and 4 in compiled._variants


class GroupNormOfReshape(torch.nn.Module):
    """At batch 1 the reshape of the transposed product stays a view, which ATen's group norm rejects."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.gn = torch.nn.Linear(2, 4), torch.nn.GroupNorm(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gn(self.fc(x).transpose(1, 2).reshape(x.shape[0], 4, 3, 1))


def test_a_bucket_plan_that_fails_on_its_first_run_falls_back_for_that_batch(config) -> None:  # type: ignore[no-untyped-def]
    """At batch 1 a reshape of a transposed tensor stays a view, and ATen's group norm rejects it
    (the traced graph has no contiguous copy there; aot_eager fails alike). The bucket's plan failed
    on its first run and the error reached the caller, though the compiled plan had run and eager
    runs this input (a helper's random networks, session 41). Now the batch is fixed, the call gets
    a plan of its own, which falls back to eager with a warning, and the compiled batch keeps its plan."""
    torch.manual_seed(0)
    model = GroupNormOfReshape().eval()
    with torch.no_grad():
        compiled = streamfuse.compile(model, (randn(2, 3, 2),), config)
        x = randn(2, 3, 2, seed=1)
        torch.testing.assert_close(compiled(x), model(x))
        x1 = randn(1, 3, 2, seed=2)
        with pytest.warns(streamfuse.StreamfuseFallbackWarning, match="failed on its first call"):
            torch.testing.assert_close(compiled(x1), model(x1))
        torch.testing.assert_close(compiled(x), model(x))
    assert compiled.batch_reason is not None and "batch bucket 1 failed" in compiled.batch_reason
    assert compiled.eager_reason is None


def test_a_graph_recorded_at_the_compiled_batch_slices_batch_sized_outputs(config) -> None:  # type: ignore[no-untyped-def]
    """The compiled plan's CUDA graph, recorded by a call at the compiled batch, slices a padded
    replay's outputs by the padding its first call at another batch finds: zeros_like(x) came back
    at the compiled batch, (4, 16) for (3, 16) (H200, test_gpu.py). CPU: a runner stands in for it."""
    from streamfuse.runtime.graphs import GraphRunner

    def made(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.zeros_like(x), torch.ones(x.shape[0], 3) * 2, x + 1

    with torch.no_grad():
        compiled = streamfuse.compile(made, (randn(4, 16),), config)
        compiled(randn(4, 16))
        runner = object.__new__(GraphRunner)  # as _record makes it, before any other batch was seen
        runner.exe, runner.batch_slices = compiled.base, list(compiled._slices[4])
        assert runner.batch_slices == [None, None, 1]  # the device's graph: the sizes were folded
        compiled._runners[4] = runner
        x = randn(3, 16, seed=3)
        compiled(x)  # no graphs on the CPU: the padded plan runs, and the first other batch is checked
        outputs = [t for t in made(randn(4, 16))]
        got = runner._views(outputs, 3, exact=False)
        assert [tuple(t.shape) for t in got] == [(3, 16), (3, 3), (3, 16)]


# -- the CUDA-graph path, emulated on the CPU (tests/graph_emulation.py) ---------------------------


def test_emulated_graphs_pad_and_slice_as_the_plan_does(config, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """CompiledGraph's graph path (_replay, _record, GraphRunner) on emulated graphs: calls at the
    compiled batch, padded to it and to other buckets return eager's shapes and values (the H200's
    (4, 16) for (3, 16) shows here too without GraphRunner.slice_by)."""
    from graph_emulation import emulate_graphs

    def made(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.zeros_like(x), torch.ones(x.shape[0], 3) * 2, x + 1

    with torch.no_grad():
        compiled = streamfuse.compile(made, (randn(4, 16),), config.replace(input_copy_node=False))
        emulate_graphs(monkeypatch, compiled)
        for batch in (4, 3, 4, 3, 2, 5, 3):
            x = randn(batch, 16, seed=batch)
            got, want = compiled(x), made(x)
            assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in want]
            torch.testing.assert_close(list(got), list(want))
        assert compiled.stats["graphs"] == 3 and compiled.graph_failure is None


@pytest.mark.parametrize("options", [{}, {"max_specializations": 0}, {"check_inputs": False}])
def test_a_capture_that_fails_at_another_batch_runs_the_call_padded(config, monkeypatch, options) -> None:  # type: ignore[no-untyped-def]
    """A capture that fails at a batch bucket other than the compiled one: the call runs without
    graphs as on the CPU, padded to its bucket. It ran the compiled plan on the call's batch: (4, 16)
    for (3, 16) with Config.check_inputs off, InputMismatch raised with max_specializations=0, and
    a needless specialization compiled otherwise."""
    from graph_emulation import emulate_graphs

    from streamfuse.runtime import compiled as compiled_module

    def model(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).relu() + 1

    def capture_fails(*args: object, **kwargs: object) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    with torch.no_grad():
        compiled = streamfuse.compile(model, (randn(4, 16),), config.replace(input_copy_node=False, **options))
        emulate_graphs(monkeypatch, compiled)
        monkeypatch.setattr(compiled_module, "GraphRunner", capture_fails)
        for batch in (3, 3, 4, 8):
            x = randn(batch, 16, seed=batch)
            torch.testing.assert_close(compiled(x), model(x))
        assert compiled.graph_failure is not None and compiled.stats["specializations"] == 0


class _OneBased(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids - 1) * 2


def test_a_recorded_graph_runs_on_rows_the_calls_gave(config, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The static inputs a recording's warm-up reads, and the padding rows of a padded replay, hold
    rows calls gave (the last row repeated, as the plan without graphs pads), not zeros, which
    `emb(ids - 1)` gathered at index -1, out of bounds."""
    from graph_emulation import EmulatedInstance, emulate_graphs

    model = _OneBased().eval()
    ids = torch.randint(1, 11, (4, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        compiled = streamfuse.compile(model, (ids,), config.replace(input_copy_node=False))
        emulate_graphs(monkeypatch, compiled)
        for batch in (4, 3, 2):
            x = ids[:batch].clone()
            torch.testing.assert_close(compiled(x), model(x))
        assert EmulatedInstance.warmups and all(w[0].min() >= 1 for w in EmulatedInstance.warmups)
        assert all(r.static_inputs[0].min() >= 1 for r in compiled._runners.values())  # type: ignore[union-attr]


def test_a_random_kernel_that_falls_back_while_recording_keeps_graphs_off(config, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """graph_skip_reason decides before any kernel ran; a dropout kernel that fails to compile in
    the recording's warm-up runs through ATen, from host offsets a replay repeats: no graph is kept
    (ReplayGraph asks again before recording too)."""
    from graph_emulation import emulate_graphs

    from streamfuse.ir.rng import is_rand
    from streamfuse.runtime.fallback import StreamfuseFallbackWarning
    from streamfuse.runtime.steps import KernelStep

    class Drop(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.dropout(x * 2, 0.5, training=True) + 1

    def out_of_resources(args: object) -> None:
        raise RuntimeError("out of resource: shared memory")

    with torch.no_grad():
        compiled = streamfuse.compile(Drop(), (randn(4, 64),), config.replace(input_copy_node=False))
        if compiled.executor != "triton":
            pytest.skip("needs generated kernels on the CPU (Triton's interpreter): the GPU's CPU runs reference ops")
        emulate_graphs(monkeypatch, compiled)
        exe = compiled.base
        step = next(s for s in exe.steps if isinstance(s, KernelStep) and any(is_rand(n) for n in s.group.nodes))
        monkeypatch.setattr(step, "_launch", out_of_resources)  # as a launch on the GPU fails
        step.direct, step.fallback_slot = True, exe.slot
        x = randn(4, 64)
        with pytest.warns(StreamfuseFallbackWarning):
            first = compiled(x)
        assert not torch.equal(first, compiled(x))
        assert compiled.stats["graphs"] == 0 and "through ATen" in (compiled.graph_skip or "")
