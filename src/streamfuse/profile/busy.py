"""GPU busy share without tracing: NVML's GPU performance monitoring (GPM) counters.

CUPTI's per-kernel tracing can stretch a multi-stream CUDA graph (the first kernels of a graph with
several root nodes start one after another under it, PERF.md sessions 11-12). GPM (Hopper and
later) reads hardware counters over an interval instead, with nothing attached to the process:
GRAPHICS_UTIL is the share of the interval in which the GPU's compute engine was active.
`busy_fraction` runs a callable back to back between two GPM samples.

What the reading is worth (benchmarks/probe_idle.py, now in git history; docs/PERF.md session 12;
H200, runs 45 and 47, 0.5 s windows): on sleep kernels launched at a fixed host period it read 1-7
points above the true busy share (true 25 / 50 / 80 / 91% read 29-32 / 54-57 / 81-84 / 92-94%); on
the same kernels back to back, busy by wall time, it read 82-93%; and it counts the launch latency
between dependent kernels in a graph as active (100 one-microsecond kernels: 3-6% idle by GPM, 25%
by CUPTI). So it is a coarse engine-activity reading, not the idle time between kernels:
`gap_ratio` below is idle over busy in that engine sense, idle between calls included.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class GpmUnavailable(RuntimeError):
    """NVML or its GPM counters are not available on this device (the message says why)."""


@dataclass(frozen=True)
class BusyReading:
    """What GPM saw over `seconds` of `calls` back-to-back calls."""

    seconds: float
    calls: int
    graphics_util: float  # % of the window with compute work active on the GPU
    sm_util: float  # % of SMs busy, averaged over the window
    call_us: float  # wall time per call over the window

    @property
    def gap_ratio(self) -> float:
        """Idle over busy in the window (idle between calls included)."""
        busy = self.graphics_util / 100.0
        return (1.0 - busy) / busy if busy > 0 else float("inf")


def nvml_device(device_index: int) -> tuple[Any, Any]:
    """(pynvml, NVML handle) of CUDA device `device_index`, mapped through CUDA_VISIBLE_DEVICES.
    Raises ImportError without nvidia-ml-py, pynvml.NVMLError where NVML can't be read."""
    import pynvml
    import torch

    pynvml.nvmlInit()
    try:  # CUDA's device order can differ from NVML's (CUDA_VISIBLE_DEVICES)
        index = torch.cuda._get_nvml_device_index(device_index)
    except Exception:  # noqa: BLE001 - older torch: NVML order assumed
        index = device_index
    return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)


def _gpm_device(device_index: int) -> tuple[Any, Any]:
    try:
        pynvml, handle = nvml_device(device_index)
    except ImportError as e:
        raise GpmUnavailable("nvidia-ml-py (pynvml) is not installed") from e
    except Exception as e:
        raise GpmUnavailable(f"NVML could not be read: {e}") from e
    try:
        support = pynvml.nvmlGpmQueryDeviceSupport(handle)
    except pynvml.NVMLError as e:
        raise GpmUnavailable(f"NVML GPM query failed: {e}") from e
    if not support.isSupportedDevice:
        raise GpmUnavailable("this GPU has no GPM counters (Hopper or later needed)")
    return pynvml, handle


def _metrics(pynvml: Any, first: Any, second: Any) -> tuple[float, float]:
    get = pynvml.c_nvmlGpmMetricsGet_t()
    get.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    get.numMetrics = 2
    get.sample1, get.sample2 = first, second
    get.metrics[0].metricId = pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL
    get.metrics[1].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
    pynvml.nvmlGpmMetricsGet(get)
    for m in get.metrics[:2]:
        if m.nvmlReturn != pynvml.NVML_SUCCESS:
            raise GpmUnavailable(f"GPM metric {m.metricId} failed (NVML return {m.nvmlReturn})")
    return float(get.metrics[0].value), float(get.metrics[1].value)


def busy_fraction(fn: Callable[[], Any], seconds: float = 0.5, device_index: int = 0) -> BusyReading:
    """Call `fn` back to back for about `seconds` between two GPM samples (synchronized at both
    ends) and return what the counters saw. Raises GpmUnavailable where GPM can't be read."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    import torch

    pynvml, handle = _gpm_device(device_index)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    calls = max(20, int(seconds / max((time.perf_counter() - t0) / 10, 1e-7)))
    first, second = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
    try:
        pynvml.nvmlGpmSampleGet(handle, first)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        pynvml.nvmlGpmSampleGet(handle, second)
        graphics, sm = _metrics(pynvml, first, second)
    except pynvml.NVMLError as e:
        raise GpmUnavailable(f"NVML GPM sampling failed: {e}") from e
    finally:
        pynvml.nvmlGpmSampleFree(first)
        pynvml.nvmlGpmSampleFree(second)
    return BusyReading(seconds=wall, calls=calls, graphics_util=graphics, sm_util=sm, call_us=wall / calls * 1e6)
