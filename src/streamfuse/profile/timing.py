"""Timing the way METHOD.md asks: warm up, CUDA events around each call, median of many."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch


def time_cuda_us(fn: Callable[[], Any], warmup: int = 10, reps: int = 50, min_ms: float = 0.0) -> float:
    """Median microseconds per call of `fn` (back to back on the current stream).

    Each sample times a batch of calls between two events, so per-call host overhead
    counts as it does for a user calling in a loop."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    # how many calls per sample so that one sample lasts at least ~min_ms
    inner = 1
    if min_ms > 0:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        inner = max(1, int(min_ms / max(start.elapsed_time(end), 1e-3)))
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / inner)
    return statistics.median(samples)
