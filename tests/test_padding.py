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


def test_a_bucket_plan_that_fails_on_its_first_run_falls_back_for_that_batch(config) -> None:  # type: ignore[no-untyped-def]
    """At batch 1 a reshape of a transposed tensor stays a view, and ATen's group norm rejects it
    (the traced graph has no contiguous copy there; aot_eager fails alike). The bucket's plan failed
    on its first run and the error reached the caller, though the compiled plan had run and eager
    runs this input (a helper's random networks, session 41). Now the batch is fixed, the call gets
    a plan of its own, which falls back to eager with a warning, and the compiled batch keeps its plan."""
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.gn = torch.nn.Linear(2, 4), torch.nn.GroupNorm(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.gn(self.fc(x).transpose(1, 2).reshape(x.shape[0], 4, 3, 1))

    torch.manual_seed(0)
    model = Net().eval()
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
