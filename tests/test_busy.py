"""profile/busy.py: the GPM reading's arithmetic and its refusals, against a stand-in NVML (the
real counters were read on the device machine by benchmarks/probe_idle.py, now in git history:
docs/PERF.md session 12)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from streamfuse.profile.busy import BusyReading, GpmUnavailable, busy_fraction


class _Metric:
    def __init__(self) -> None:
        self.metricId, self.nvmlReturn, self.value = 0, 0, 0.0


class _Get:
    def __init__(self) -> None:
        self.metrics = [_Metric() for _ in range(4)]


def _fake_nvml(supported: bool, values: dict[int, float], fail_metric: int | None = None) -> types.ModuleType:
    nv = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    nv.NVMLError = NVMLError
    nv.NVML_SUCCESS, nv.NVML_GPM_METRICS_GET_VERSION = 0, 1
    nv.NVML_GPM_METRIC_GRAPHICS_UTIL, nv.NVML_GPM_METRIC_SM_UTIL = 1, 2
    nv.samples: list[str] = []
    nv.nvmlInit = lambda: None
    nv.nvmlDeviceGetHandleByIndex = lambda i: f"gpu{i}"
    nv.nvmlGpmQueryDeviceSupport = lambda h: types.SimpleNamespace(isSupportedDevice=int(supported))
    nv.nvmlGpmSampleAlloc = lambda: object()
    nv.nvmlGpmSampleGet = lambda h, s: nv.samples.append(h)
    nv.nvmlGpmSampleFree = lambda s: None
    nv.c_nvmlGpmMetricsGet_t = _Get

    def metrics_get(get: _Get) -> _Get:
        assert get.numMetrics == 2 and get.sample1 is not get.sample2
        for m in get.metrics[: get.numMetrics]:
            m.value = values[m.metricId]
            m.nvmlReturn = 3 if m.metricId == fail_metric else 0
        return get

    nv.nvmlGpmMetricsGet = metrics_get
    return nv


@pytest.fixture
def no_cuda_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)


def test_busy_fraction_reads_two_samples_around_the_calls(monkeypatch: pytest.MonkeyPatch, no_cuda_sync) -> None:  # type: ignore[no-untyped-def]
    nv = _fake_nvml(True, {1: 96.0, 2: 40.0})
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    calls = []
    reading = busy_fraction(lambda: calls.append(1), seconds=0.01)
    assert reading.graphics_util == 96.0 and reading.sm_util == 40.0
    assert reading.gap_ratio == pytest.approx(4.0 / 96.0)
    assert reading.calls >= 20 and len(calls) == reading.calls + 13  # 3 warm-up, 10 to size the window
    assert len(nv.samples) == 2
    assert reading.call_us == pytest.approx(reading.seconds / reading.calls * 1e6)


def test_busy_fraction_refuses_what_it_cannot_read(monkeypatch: pytest.MonkeyPatch, no_cuda_sync) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(False, {}))
    with pytest.raises(GpmUnavailable, match="no GPM counters"):
        busy_fraction(lambda: None, seconds=0.01)
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(True, {1: 50.0, 2: 10.0}, fail_metric=2))
    with pytest.raises(GpmUnavailable, match="metric 2 failed"):
        busy_fraction(lambda: None, seconds=0.01)
    with pytest.raises(ValueError, match="seconds must be > 0"):
        busy_fraction(lambda: None, seconds=0)


def test_gap_ratio_of_a_reading() -> None:
    assert BusyReading(1.0, 10, 100.0, 50.0, 1.0).gap_ratio == 0.0
    assert BusyReading(1.0, 10, 80.0, 50.0, 1.0).gap_ratio == pytest.approx(0.25)
    assert BusyReading(1.0, 10, 0.0, 0.0, 1.0).gap_ratio == float("inf")
