"""GPU timelines: kernel intervals from torch.profiler (CUPTI), and the arithmetic on them.

gap ratio = (span - busy) / busy, where busy is the length of the union of all kernel intervals
(overlapping kernels on several streams count once) and span runs from the first kernel's start
to the last one's end: the GPU's idle time between kernels per unit of busy time. Over calls issued
back to back it includes the idle time between calls (graph launches, the host); `call_gap_ratio`
takes calls one at a time (synchronized between them) and reports the idle time inside a call.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


@dataclass(frozen=True)
class Interval:
    name: str
    stream: int
    start_us: float
    end_us: float

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


def union_length(intervals: Iterable[Interval]) -> float:
    """Total time covered by at least one interval."""
    total, cur_start, cur_end = 0.0, None, None
    for iv in sorted(intervals, key=lambda i: i.start_us):
        if cur_end is None or iv.start_us > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start  # type: ignore[operator]
            cur_start, cur_end = iv.start_us, iv.end_us
        else:
            cur_end = max(cur_end, iv.end_us)
    if cur_end is not None:
        total += cur_end - cur_start  # type: ignore[operator]
    return total


def span(intervals: list[Interval]) -> float:
    return max(i.end_us for i in intervals) - min(i.start_us for i in intervals) if intervals else 0.0


def gap_ratio(intervals: list[Interval]) -> float:
    busy = union_length(intervals)
    return (span(intervals) - busy) / busy if busy > 0 else 0.0


def call_gap_ratio(intervals: list[Interval], calls: int) -> float:
    """Median gap ratio within one call, for the intervals of `calls` calls recorded with a
    synchronization after each (record_timeline(sync_each=True)): calls do not overlap, so the
    intervals in start order are `calls` equal runs."""
    if not intervals or len(intervals) % calls:
        raise ValueError(f"{len(intervals)} GPU intervals do not split into {calls} calls of equal size")
    per = len(intervals) // calls
    ordered = sorted(intervals, key=lambda i: i.start_us)
    ratios = sorted(gap_ratio(ordered[c * per: (c + 1) * per]) for c in range(calls))
    return ratios[len(ratios) // 2]


def one_call(fn: Callable[[], Any], tries: int = 5) -> list[Interval]:
    """The GPU intervals of one synchronized call of fn (the call of median span among `tries`),
    shifted so that its first interval starts at 0: where a schedule's time goes."""
    calls = []
    for _ in range(tries):
        ivs = record_timeline(fn, calls=1, warmup=2)
        t0 = min(i.start_us for i in ivs)
        calls.append(sorted((Interval(i.name, i.stream, i.start_us - t0, i.end_us - t0) for i in ivs),
                            key=lambda i: i.start_us))
    calls.sort(key=span)
    return calls[len(calls) // 2]


def streams_used(intervals: list[Interval]) -> int:
    return len({i.stream for i in intervals})


def intervals_from_trace(trace: dict[str, Any]) -> list[Interval]:
    """Kernel, memcpy and memset intervals of a Chrome trace (torch.profiler's export)."""
    out = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") in _GPU_CATEGORIES:
            stream = ev.get("args", {}).get("stream", ev.get("tid", 0))
            start = float(ev["ts"])
            out.append(Interval(ev.get("name", "?"), int(stream) if str(stream).isdigit() else 0, start,
                                start + float(ev.get("dur", 0.0))))
    return out


def record_timeline(fn: Callable[[], Any], calls: int = 20, warmup: int = 5, sync_each: bool = False) -> list[Interval]:
    """GPU intervals of `calls` calls of fn (CUDA only): back to back, or with `sync_each` one at a
    time (for call_gap_ratio)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
            if sync_each:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return intervals_from_trace(trace)
