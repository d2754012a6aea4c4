"""The CUDA-graph path of CompiledGraph on emulated graphs (tests/graph_emulation.py), beyond padding
(tests/test_padding.py): failures while recording."""

from __future__ import annotations

import pytest
import torch
from helpers import randn
from test_padding import GroupNormOfReshape

import streamfuse


def test_a_bucket_plan_that_fails_while_recording_keeps_graphs_for_the_others(config, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A batch bucket's plan that fails in its recording's warm-up failed itself, not the capture: the
    batch is fixed as without graphs (test_padding.py), and the compiled batch keeps replaying its
    graph. It was taken for a capture failure (graph_failure), which turned graphs off for every batch."""
    from graph_emulation import emulate_graphs

    torch.manual_seed(0)
    model = GroupNormOfReshape().eval()
    with torch.no_grad():
        compiled = streamfuse.compile(model, (randn(2, 3, 2),), config.replace(input_copy_node=False))
        emulate_graphs(monkeypatch, compiled)
        x = randn(2, 3, 2, seed=1)
        torch.testing.assert_close(compiled(x), model(x))
        x1 = randn(1, 3, 2, seed=2)
        with pytest.warns(streamfuse.StreamfuseFallbackWarning, match="failed on its first call"):
            torch.testing.assert_close(compiled(x1), model(x1))
        runner = compiled._runners[2]
        replays = []
        monkeypatch.setattr(runner, "_replay", lambda *args: (replays.append(1), type(runner)._replay(runner, *args))[1])
        torch.testing.assert_close(compiled(x), model(x))
    assert compiled.batch_reason is not None and "batch bucket 1 failed" in compiled.batch_reason
    assert compiled.graph_failure is None and replays == [1]


def test_an_expanded_output_replays(config, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An output that is a broadcast view of a buffer (stride 0): the emulated replay wrote it with
    copy_, which raises on a tensor whose elements share memory (a real replay writes the buffer)."""
    from graph_emulation import emulate_graphs

    def model(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = (x * 2).relu()
        return y.unsqueeze(1).expand(-1, 2, -1), y + 1

    with torch.no_grad():
        compiled = streamfuse.compile(model, (randn(4, 6),), config.replace(input_copy_node=False, output_sets=0))
        emulate_graphs(monkeypatch, compiled)
        for batch in (4, 4, 3, 3):
            x = randn(batch, 6, seed=batch)
            got, want = compiled(x), model(x)
            assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in want]
            torch.testing.assert_close(list(got), list(want))


def _returns_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x, x.relu()


def _returns_views_of_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return x.relu(), x.view(-1), x[1:3]


@pytest.mark.parametrize("model", [_returns_input, _returns_views_of_input])
@pytest.mark.parametrize("reuse_outputs", [False, True])
def test_outputs_in_an_input_are_the_callers_tensor_as_in_eager(model, reuse_outputs, config, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An output that is the input or a view of it (`return x, f(x)`): eager returns the caller's own
    tensor, or a view of it. The graph copies inputs into static buffers, and returned that buffer's
    view copied out; every other output was copied too, on every call (the buffer cannot be handed
    out). At the compiled batch it is now the caller's tensor; at a padded batch, a copy of its rows."""
    from graph_emulation import emulate_graphs

    with torch.no_grad():
        compiled = streamfuse.compile(model, (randn(4, 6),), config.replace(reuse_outputs=reuse_outputs))
        emulate_graphs(monkeypatch, compiled)
        for call, batch in enumerate((4, 4, 4, 3, 4)):
            x = randn(batch, 6, seed=call)
            got, want = compiled(x), model(x)
            assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in want]
            torch.testing.assert_close(list(got), list(want))
            if batch != 4:  # padded to the bucket (or a plan of its own where the batch is fixed): values only
                continue
            for g, w in zip(got, want, strict=True):
                in_x = g.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
                assert in_x == (w.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()), call
                assert (g is x) == (w is x), call
        runner = compiled._runners[4]
        if not reuse_outputs:  # the other outputs are handed out (Config.output_sets), not copied on every call
            assert runner.output_sets > 0
