"""Where a suite model's call is idle: one call's GPU timeline under torch.profiler, for streamfuse
with each of several Config variants and, with --peer, torch.compile(mode="reduce-overhead").

    python benchmarks/timeline_gaps.py --models prefill --batch throughput [--tf32] [--peer]
                                      [--variant "max_streams=1" --variant "pdl=false" ...] [--top 12]
                                      [--json FILE]

For each variant (the defaults first): µs per call (CUDA events, 50 calls, median), then one
synchronized call's timeline: its span, the time some kernel runs (union of intervals), the idle
time inside the span, the summed kernel time (above the union where streams overlap), streams, and
the longest idle stretches with the kernel that ended before (and its stream) and the one that
started after. Idle after a kernel on one stream followed by a kernel on another is a cross-stream
wait's cost; idle between kernels of one stream is launch latency (or a dependency's). --json keeps
every interval for a closer look. Profile in a process of its own (a profiler session slows later
multi-stream graphs in the process).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import Any


def idle_stretches(intervals: list[Any]) -> list[tuple[float, Any, Any]]:
    """(idle µs, interval that ended last before it, interval that starts after it) for each moment
    no kernel runs, in start order of the intervals."""
    ordered = sorted(intervals, key=lambda i: i.start_us)
    out = []
    last = None
    for iv in ordered:
        if last is not None and iv.start_us > last.end_us:
            out.append((iv.start_us - last.end_us, last, iv))
        if last is None or iv.end_us > last.end_us:
            last = iv
    return out


def summarize(label: str, us: float, intervals: list[Any], top: int) -> dict[str, Any]:
    from streamfuse.profile.timeline import span, streams_used, union_length

    busy = union_length(intervals)
    whole = span(intervals)
    summed = sum(i.duration_us for i in intervals)
    gaps = idle_stretches(intervals)
    cross = sum(g for g, a, b in gaps if a.stream != b.stream)
    print(f"{label}: {us:.1f} µs per call; one call: {len(intervals)} kernels on {streams_used(intervals)} "
          f"stream(s), span {whole:.1f} µs, busy {busy:.1f}, idle {whole - busy:.1f} "
          f"({len(gaps)} stretches, {cross:.1f} µs of them between kernels of different streams), "
          f"kernel time summed {summed:.1f}")
    for g, a, b in sorted(gaps, key=lambda x: -x[0])[:top]:
        print(f"    idle {g:6.1f} µs at {a.end_us:8.1f}: after [{a.stream}] {a.name[:60]} -> [{b.stream}] {b.name[:60]}")
    return {"label": label, "us": us, "span_us": whole, "busy_us": busy, "idle_us": whole - busy,
            "cross_stream_idle_us": cross, "kernel_sum_us": summed,
            "intervals": [[i.name, i.stream, i.start_us, i.end_us] for i in intervals]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="prefill")
    ap.add_argument("--batch", default="throughput")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--variant", action="append", default=[],
                    help="Config settings, comma-separated NAME=VALUE (each variant is timed beside the defaults)")
    ap.add_argument("--peer", action="store_true", help="also torch.compile(mode='reduce-overhead')")
    ap.add_argument("--tf32", action="store_true", help="allow TF32 as `streamfuse bench` times float32")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    import streamfuse
    from streamfuse.bench.models import model_workloads
    from streamfuse.bench.runner import time_us
    from streamfuse.profile.timeline import one_call

    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
    rows = []
    for w in model_workloads(args.models, args.batch, args.dtype):
        model, inputs = w.make(device)
        with torch.no_grad():
            for variant in ["", *args.variant]:
                settings = [s for s in variant.split(",") if s]
                compiled = streamfuse.compile(model, inputs, streamfuse.Config().with_settings(settings))
                label = f"{w.name} streamfuse" + (f" [{variant}]" if variant else "")
                call = functools.partial(compiled, *inputs)
                rows.append(summarize(label, time_us(call, device), one_call(call), args.top))
                del compiled, call
                torch.cuda.empty_cache()
            if args.peer:
                peer = torch.compile(model, mode="reduce-overhead")
                for _ in range(5):
                    peer(*inputs)
                call = functools.partial(peer, *inputs)
                rows.append(summarize(f"{w.name} reduce-overhead", time_us(call, device), one_call(call), args.top))
                del peer, call
                torch._dynamo.reset()
        del model
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
