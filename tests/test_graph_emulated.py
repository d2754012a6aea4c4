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
