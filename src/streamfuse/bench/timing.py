"""Timing the bench's modes: one after another, or side by side in rounds (time_interleaved)."""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from streamfuse.runtime.fallback import StreamfuseFallbackWarning

if TYPE_CHECKING:
    from streamfuse.bench.runner import ModeResult

T = TypeVar("T")


def default_reps(device: torch.device) -> int:
    return 50 if device.type == "cuda" else 10


def time_us(fn: Callable[[], Any], device: torch.device, reps: int | None = None) -> float:
    """Median µs per call: CUDA events over `reps` (50) calls on CUDA, the host clock (10) elsewhere."""
    return statistics.median(time_samples(fn, device, reps or default_reps(device), warmup=10))


def time_samples(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int) -> list[float]:
    """µs of each of `reps` calls after `warmup` calls: CUDA events on CUDA (calls back to back), the
    host clock elsewhere (at most 3 warm-up calls: the CPU runs kernels in Triton's interpreter)."""
    if device.type == "cuda":
        from streamfuse.profile.timing import time_cuda_samples

        return time_cuda_samples(fn, warmup=warmup, reps=reps)
    for _ in range(min(3, warmup)):
        fn()
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e6)
    return samples


def time_interleaved(pending: list[tuple[ModeResult, Callable[[], Any]]], device: torch.device,
                     reps: int | None, rounds: int) -> None:
    """Time one workload's modes side by side: `rounds` rounds, each mode timed for its share of `reps`
    calls per round (after 2 warm-up calls that bring its weights back into the caches), the order
    rotated each round. A drift in the GPU's clocks or the host's load then lands on every mode alike,
    where timing the modes one after another charged it to whichever ran then. us: the median over all
    calls; us_spread: how far the rounds' medians lie apart. A mode that raises keeps the error."""
    live = [(r, fn) for r, fn in pending if r.error is None]
    per_round = max(1, math.ceil((reps or default_reps(device)) / rounds))
    samples: dict[int, list[float]] = {id(r): [] for r, _ in live}
    medians: dict[int, list[float]] = {id(r): [] for r, _ in live}
    for r, fn in live:
        guarded(r, lambda fn=fn: time_samples(fn, device, 0, warmup=10))  # warm-up only
    for index in range(rounds):
        live = [(r, fn) for r, fn in live if r.error is None]
        if not live:
            break
        shift = index % len(live)
        for r, fn in live[shift:] + live[:shift]:
            got = guarded(r, lambda fn=fn: time_samples(fn, device, per_round, warmup=2))
            if got:
                samples[id(r)] += got
                medians[id(r)].append(statistics.median(got))
    for r, _ in pending:
        if r.error is None and samples.get(id(r)):
            r.us = statistics.median(samples[id(r)])
            r.us_spread = (max(medians[id(r)]) - min(medians[id(r)])) / r.us if len(medians[id(r)]) > 1 else None
        else:
            r.us = None


def guarded(result: ModeResult, fn: Callable[[], T]) -> T | None:
    """fn's value; a failure becomes the mode's error (reported, not fatal: None), a fallback warning
    its `fallback`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            got: T | None = fn()
        except Exception as exc:  # noqa: BLE001 - a failing mode is reported, not fatal
            result.error, got = describe(exc), None
    note_warnings(result, caught)
    return got


def describe(exc: BaseException) -> str:
    """One line for the table and JSON: the exception's type and the first line of its message."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def note_warnings(result: ModeResult, caught: list[warnings.WarningMessage]) -> None:
    for w in caught:
        if issubclass(w.category, StreamfuseFallbackWarning):
            result.fallback = result.fallback or str(w.message)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
