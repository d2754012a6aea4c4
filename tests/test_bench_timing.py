"""The bench's interleaved timing (bench/timing.py, run_suite's rounds) on CPU: the modes of a workload
built first, then timed side by side in rounds with the order rotated, nothing recompiled while timed,
failures kept per mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from streamfuse.bench import runner
from streamfuse.bench.runner import ModeResult, run_suite
from streamfuse.bench.timing import time_interleaved
from streamfuse.bench.workloads import Workload
from streamfuse.runtime.fallback import StreamfuseFallbackWarning

CPU = torch.device("cpu")


def test_rounds_rotate_the_order_and_report_the_spread() -> None:
    calls: list[str] = []

    def mode(name: str) -> tuple[ModeResult, object]:
        return ModeResult(name), lambda: calls.append(name)

    pending = [mode("a"), mode("b"), mode("c")]
    time_interleaved(pending, CPU, reps=6, rounds=3)  # type: ignore[arg-type]
    # 3 warm-up calls each first, then per round each mode its 2 warm-up and 2 timed calls, the first
    # mode of each round one further along
    assert calls[:9] == ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    blocks = [calls[i] for i in range(9, len(calls), 4)]
    assert blocks == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert len(calls) == 9 + 3 * 3 * 4
    for r, _ in pending:
        assert r.error is None and r.us is not None and r.us > 0
        assert r.us_spread is not None and r.us_spread >= 0


def test_a_mode_failing_while_timed_keeps_its_error_and_the_others_their_times() -> None:
    count = [0]

    def flaky() -> None:
        count[0] += 1
        if count[0] > 5:  # past the warm-up and the first round
            raise RuntimeError("device lost")

    def falls_back() -> None:
        import warnings

        warnings.warn("ran eagerly", StreamfuseFallbackWarning, stacklevel=1)

    good, bad, fell = ModeResult("good"), ModeResult("bad"), ModeResult("fell")
    time_interleaved([(good, lambda: None), (bad, flaky), (fell, falls_back)], CPU, reps=4, rounds=2)
    assert good.error is None and good.us is not None
    assert bad.us is None and bad.error == "RuntimeError: device lost"
    assert fell.us is not None and fell.fallback == "ran eagerly"


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * 0.5 + x


def test_interleaved_suite_times_every_mode_without_recompiling(  # type: ignore[no-untyped-def]
        config, monkeypatch: pytest.MonkeyPatch) -> None:
    """All modes are built, then timed side by side: torch.compile's state is reset only as the
    workload starts (a reset between modes would make the backend's build compile again while timed),
    the warm compile runs after the timing, and the timing runs without autograd."""
    from torch._dynamo.utils import counters

    def make(device: torch.device) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        return _Block().eval(), (torch.randn(2, 8),)

    frames: list[int] = []
    events: list[str] = []
    real, real_reset = runner.time_interleaved, torch._dynamo.reset

    def reset() -> None:
        events.append("reset")
        real_reset()

    def watched(*args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        events.append("time")
        frames.append(counters["frames"]["ok"])
        assert not torch.is_grad_enabled()  # timed as inference, as a user runs it
        real(*args, **kwargs)
        frames.append(counters["frames"]["ok"])

    monkeypatch.setattr(runner, "time_interleaved", watched)
    monkeypatch.setattr(torch._dynamo, "reset", reset)
    monkeypatch.setattr(runner, "retime_with_defaults", lambda workload, device: True)  # as on CUDA in fp32
    (row,) = run_suite([Workload("block", make, tolerance=1e-4)], ["eager", "sf-backend", "streamfuse"], CPU,
                       config, reps=4, rounds=2, cold_cache=True)
    assert len(frames) == 2 and frames[0] == frames[1], "a mode compiled again while it was timed"
    assert events[:events.index("time")] == ["reset"], events  # as the workload starts, never between its modes
    assert "reset" in events[events.index("time"):]  # the warm compile's, after the timing
    for mode in ("eager", "sf-backend", "streamfuse"):
        res = row.modes[mode]
        assert res.error is None and res.fallback is None, (mode, res.error, res.fallback)
        assert res.us is not None and res.us > 0 and res.us_spread is not None, mode
    for mode in ("sf-backend", "streamfuse"):
        assert row.modes[mode].compile_warm_s is not None and row.modes[mode].second_error is None
    torch._dynamo.reset()


def test_rounds_must_be_positive(config) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="rounds: expected a positive number"):
        run_suite([], ["eager"], CPU, config, rounds=0)
