"""The profile report: what a timeline (measured or predicted) says about a run.

`build_report` turns GPU intervals into per-stream and per-kernel statistics, achieved bandwidth
and FLOP/s against the device ceilings where bytes/flops are known, occupancy where the resource
model knows the kernel, NVML samples, and plain-language recommendations.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from streamfuse.profile.timeline import Interval, gap_ratio, span, union_length
from streamfuse.tune.ceilings import BUILTIN, DeviceCeilings

LAUNCH_BOUND_US = 5.0
"""Kernels shorter than this spend a comparable time being launched: fusion candidates."""


@dataclass(frozen=True)
class Ceilings:
    """Device limits the achieved figures are compared with: the report's view of a
    tune.ceilings.DeviceCeilings (the one source of these numbers)."""

    name: str
    bandwidth_gbps: float
    """Device-to-device copy, bytes read + written per second / 1e9."""
    tflops: float
    """Dense matrix rate (bf16) in TFLOP/s."""

    @classmethod
    def of(cls, device: DeviceCeilings | Ceilings) -> Ceilings:
        if isinstance(device, Ceilings):
            return device
        return cls(device.name, device.copy_gbps, device.matmul_tflops["bfloat16"])


CEILINGS = {key: Ceilings.of(device) for key, device in BUILTIN.items()}
"""The built-in table (tune.ceilings.BUILTIN) by short name: "H200", "H100", "A100"."""


@dataclass(frozen=True)
class KernelInfo:
    """What streamfuse knows about a kernel it generated or scheduled (per launch)."""

    bytes: float | None = None
    flops: float | None = None
    occupancy: float | None = None
    limiter: str | None = None


@dataclass
class KernelStat:
    """One kernel name on one stream. `total_us` and `mean_us` are the kernel's own time
    (`own_durations`): a kernel launched early (programmatic dependent launch) and waiting for the one
    before it on its stream is not charged for the wait."""

    name: str
    stream: int
    calls: int
    total_us: float
    mean_us: float
    bytes: float | None = None
    flops: float | None = None
    achieved_gbps: float | None = None
    bandwidth_fraction: float | None = None
    achieved_tflops: float | None = None
    occupancy: float | None = None
    limiter: str | None = None
    launch_bound: bool = False


@dataclass
class StreamStat:
    """One stream id of the trace. A side stream of a multi-stream plan waits for the others by
    design, so its own idle time says nothing a user can act on; what it contributes is its busy
    time and how much of the run it is busy (`busy_share`). The run's gap ratio is in the totals."""

    stream: int
    kernels: int
    busy_us: float
    busy_share: float
    """busy_us / the span of the whole run (all streams)."""


@dataclass
class DeviceSample:
    """One NVML reading during the run."""

    t_s: float
    gpu_util_percent: float
    sm_clock_mhz: float
    memory_used_mb: float


@dataclass
class ProfileReport:
    label: str
    device: str
    predicted: bool
    """True when the timeline comes from the cost model (no GPU), not from a measurement."""
    intervals: list[Interval]
    streams: list[StreamStat]
    kernels: list[KernelStat]
    totals: dict[str, float]
    """calls, kernel_count (runs), kernels_per_call, busy_us, span_us, gap_ratio, launch_bound_kernels
    (runs shorter than LAUNCH_BOUND_US), streams, waiting_us (time kernels spent started but waiting
    for the kernel before them on their stream: `own_durations`)."""
    samples: list[DeviceSample] = field(default_factory=list)
    recommendations: list[str] = field(default_factory=list)
    ceilings: Ceilings | None = None

    @property
    def tag(self) -> str:
        return "predicted" if self.predicted else "measured"


def own_durations(intervals: list[Interval]) -> list[float]:
    """Each interval's own time, aligned with `intervals`: from its start, or from the end of the
    interval before it on its stream where it started earlier, to its end. One stream runs its kernels
    in order, so an overlap there is a kernel launched early that waits for its predecessor:
    programmatic dependent launch, where streamfuse's kernels let the next one start at once and it
    waits in `gdc_wait` (its traced duration then includes most of the one before: BERT-base's
    layer-norm column sums traced at 11.3 µs behind their row kernel, run 228)."""
    own = [iv.duration_us for iv in intervals]
    by_stream: dict[int, list[int]] = defaultdict(list)
    for i, iv in enumerate(intervals):
        by_stream[iv.stream].append(i)
    for idx in by_stream.values():
        idx.sort(key=lambda i: (intervals[i].start_us, intervals[i].end_us))
        ready = None  # the latest end so far on this stream
        for i in idx:
            iv = intervals[i]
            if ready is not None and iv.start_us < ready:
                own[i] = max(0.0, iv.end_us - ready)
            ready = iv.end_us if ready is None else max(ready, iv.end_us)
    return own


def build_report(label: str, device: str, intervals: list[Interval], *, predicted: bool, calls: int = 1,
                 ceilings: Ceilings | DeviceCeilings | None = None, info: Mapping[str, KernelInfo] | None = None,
                 samples: list[DeviceSample] | None = None) -> ProfileReport:
    info = info or {}
    ceilings = Ceilings.of(ceilings) if ceilings is not None else None
    by_stream: dict[int, list[Interval]] = defaultdict(list)
    by_name: dict[tuple[str, int], list[float]] = defaultdict(list)
    own = own_durations(intervals)
    for iv, mine in zip(intervals, own, strict=True):
        by_stream[iv.stream].append(iv)
        by_name[(iv.name, iv.stream)].append(mine)
    whole = span(intervals)
    streams = [StreamStat(s, len(ivs), union_length(ivs), union_length(ivs) / whole if whole > 0 else 0.0)
               for s, ivs in sorted(by_stream.items())]
    kernels = [_kernel_stat(name, stream, durations, info.get(name), ceilings)
               for (name, stream), durations in by_name.items()]
    kernels.sort(key=lambda k: -k.total_us)
    totals = {
        "calls": float(calls),
        "kernel_count": float(len(intervals)),
        "kernels_per_call": len(intervals) / max(calls, 1),
        "busy_us": union_length(intervals),
        "span_us": span(intervals),
        "gap_ratio": gap_ratio(intervals),
        "launch_bound_kernels": float(sum(1 for d in own if d < LAUNCH_BOUND_US)),
        "streams": float(len(by_stream)),
        "waiting_us": sum(iv.duration_us for iv in intervals) - sum(own),
    }
    report = ProfileReport(label, device, predicted, intervals, streams, kernels, totals, samples or [],
                           [], ceilings)
    report.recommendations = recommend(report)
    return report


def _kernel_stat(name: str, stream: int, durations: list[float], known: KernelInfo | None,
                 ceilings: Ceilings | None) -> KernelStat:
    mean = statistics.fmean(durations)
    stat = KernelStat(name, stream, len(durations), sum(durations), mean, launch_bound=mean < LAUNCH_BOUND_US)
    if known is not None:
        stat.bytes, stat.flops = known.bytes, known.flops
        stat.occupancy, stat.limiter = known.occupancy, known.limiter
        if known.bytes and mean > 0:
            stat.achieved_gbps = known.bytes / (mean * 1e3)
            if ceilings:
                stat.bandwidth_fraction = stat.achieved_gbps / ceilings.bandwidth_gbps
        if known.flops and mean > 0:
            stat.achieved_tflops = known.flops / (mean * 1e6)
    return stat


def recommend(report: ProfileReport) -> list[str]:
    """Plain-language advice that follows from the numbers."""
    out: list[str] = []
    t = report.totals
    if t["kernel_count"] and t["gap_ratio"] > 0.05:
        out.append(f"The GPU sits idle {100 * t['gap_ratio']:.0f}% of its busy time between kernels (target: "
                   "under 5%): capture the calls in CUDA graphs (streamfuse does this on CUDA by default) and "
                   "fuse small kernels so fewer launches remain.")
    launch_bound = int(t["launch_bound_kernels"])
    if launch_bound and launch_bound >= 0.5 * t["kernel_count"]:
        out.append(f"{launch_bound} of {int(t['kernel_count'])} kernel runs last under {LAUNCH_BOUND_US:.0f} µs, about "
                   "what launching them costs: fuse them (streamfuse.compile) or pack independent ones together.")
    for k in report.kernels:
        if k.occupancy is not None and k.occupancy < 0.25 and k.total_us > 0.05 * max(t["busy_us"], 1e-9):
            out.append(f"Kernel {k.name} runs at {100 * k.occupancy:.0f}% occupancy, limited by "
                       f"{k.limiter or 'an unknown resource'}: "
                       "fewer registers or less shared memory per block would let more warps hide latency.")
        if (k.bandwidth_fraction is not None and k.bandwidth_fraction < 0.5 and not k.launch_bound
                and k.total_us > 0.1 * max(t["busy_us"], 1e-9)):
            out.append(f"Kernel {k.name} reaches {100 * k.bandwidth_fraction:.0f}% of the copy bandwidth while taking "
                       f"{100 * k.total_us / max(t['busy_us'], 1e-9):.0f}% of the busy time: check its access pattern.")
    if t["streams"] > 1 and t["gap_ratio"] > 0.05 and not report.predicted:
        out.append("Part of this idle time may be the profiler's: CUPTI's per-kernel tracing starts the first "
                   "kernels of a CUDA graph's streams one after another when the graph has several root nodes (on "
                   "the H200 four streams started 7-12 µs apart; with one root node, such as the input copy that "
                   "streamfuse puts in its graphs, they started within 1 µs). Time calls without the profiler for "
                   "their real duration, and before profiling: multi-stream graphs stay slower in a process after "
                   "a profiler session.")
    if t["streams"] <= 1 and t["kernel_count"] > 1 and t["gap_ratio"] > 0.05 and not report.predicted:
        out.append("Everything ran on one stream; independent branches could overlap on several "
                   "(streamfuse schedules them on up to Config.max_streams).")
    if not t["kernel_count"]:
        out.append("No GPU kernels were recorded: did the block run any GPU work?")
    elif not out:
        out.append("No obvious waste: kernels are back to back and none is flagged.")
    return out


def summary_dict(report: ProfileReport) -> dict[str, Any]:
    """A JSON-friendly digest (no intervals)."""
    return {
        "label": report.label, "device": report.device, "predicted": report.predicted,
        "totals": report.totals,
        "streams": [vars(s) for s in report.streams],
        "kernels": [vars(k) for k in report.kernels],
        "samples": [vars(s) for s in report.samples],
        "recommendations": report.recommendations,
    }
