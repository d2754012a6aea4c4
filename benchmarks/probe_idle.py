"""How idle is an untraced multi-stream CUDA graph? GPM counters checked against known idle.

    python benchmarks/probe_idle.py [--out DIR]

1. Calibration: `torch.cuda._sleep` kernels of known length launched at a fixed host period, so
   the true busy share is calls x length / wall. GPM's GRAPHICS_UTIL (profile/busy.py) should match.
2. Fine-grained idle inside a graph: 100 short kernels on one stream, GPM against CUPTI's timeline.
3. Four sleep chains on four streams in one graph: does CUPTI start the streams one after another
   with kernels that don't compete for SMs?
4. The issue-4 workloads (4 MLPs, conv block c64), each as its compiled graph replayed back to back
   and as 20 calls captured into one graph: GPM's untraced gap ratio, then CUPTI's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import streamfuse
from streamfuse import Config
from streamfuse.demo_models import MultiBranchConv
from streamfuse.profile.busy import busy_fraction
from streamfuse.profile.timeline import call_gap_ratio, one_call, record_timeline, union_length
from streamfuse.profile.timing import capture_graph, fork_join, time_cuda_us


def paced(cycles: int, period_us: float) -> Callable[[], None]:
    state = {"next": 0.0}
    period = period_us * 1e-6

    def fn() -> None:
        now = time.perf_counter()
        if state["next"] < now - period:
            state["next"] = now
        torch.cuda._sleep(cycles)
        state["next"] += period
        while time.perf_counter() < state["next"]:
            pass

    return fn


def kernel_us(cycles: int, reps: int = 200) -> float:
    """One sleep kernel's GPU time: `reps` back to back, timed with events."""
    torch.cuda._sleep(cycles)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / reps


def gpm_row(label: str, fn: Callable[[], Any], rows: list[dict[str, Any]], truth: float | None = None,
            per_call: int = 1) -> dict[str, Any]:
    r = busy_fraction(fn, seconds=0.5)
    row = {"label": label, "graphics_util": r.graphics_util, "sm_util": r.sm_util, "gpm_gap": r.gap_ratio,
           "call_us": r.call_us / per_call, "truth_busy": truth}
    rows.append(row)
    t = f"  true busy {truth:.1f}%" if truth is not None else ""
    print(f"{label:60} GPM busy {r.graphics_util:6.2f}%  gap {100 * r.gap_ratio:6.2f}%  "
          f"SM {r.sm_util:5.1f}%  {r.call_us / per_call:8.2f} µs/call{t}", flush=True)
    return row


def replay_of(compiled: Any) -> Callable[[], Any]:
    (graph,) = compiled.recorded_graphs().values()
    return graph.replay


def calls_graph(compiled: Any, x: list[torch.Tensor], calls: int, one_stream: bool = False) -> Callable[[], Any]:
    """`calls` calls of the compiled plan (its streams, events, PDL) captured into one graph."""
    exe, keep = compiled.base, []
    statics = [t.clone() for t in x]
    graph, _ = capture_graph(lambda: exe.run(statics, keep_alive=keep, one_stream=one_stream), calls=calls)
    return lambda g=graph, _b=(statics, keep): g.replay()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    print(f"card: {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    rows: list[dict[str, Any]] = []
    cupti: dict[str, Any] = {}

    # 1. calibration with host-paced sleep kernels
    cpu = 200_000 / kernel_us(200_000, reps=20)  # sleep cycles per µs
    print(f"sleep kernel: {cpu:.0f} cycles/µs")
    for target_us in (100.0, 20.0):
        cycles = int(target_us * cpu)
        d = kernel_us(cycles)
        gpm_row(f"sleep {d:.1f} µs back to back (host-launched)", lambda c=cycles: torch.cuda._sleep(c), rows,
                truth=None)
        for factor in (1.1, 1.25, 2.0, 4.0):
            period = d * factor
            fn = paced(cycles, period)
            r = busy_fraction(fn, seconds=0.5)
            truth = 100.0 * d / r.call_us
            row = {"label": f"sleep {d:.1f} µs every {period:.1f} µs", "graphics_util": r.graphics_util,
                   "sm_util": r.sm_util, "gpm_gap": r.gap_ratio, "call_us": r.call_us, "truth_busy": truth}
            rows.append(row)
            print(f"{row['label']:60} GPM busy {r.graphics_util:6.2f}%  true busy {truth:6.2f}% "
                  f"(period seen {r.call_us:.1f} µs)", flush=True)

    # 2. fine-grained idle inside one graph: 100 short kernels on one stream
    tiny = torch.randn(1024, device="cuda")
    short = int(2.0 * cpu)
    for label, body in (("100 sleep kernels of 2 µs, 1 stream graph", lambda: [torch.cuda._sleep(short) for _ in range(100)]),
                        ("100 tiny adds, 1 stream graph", lambda: [tiny.add_(1.0) for _ in range(100)])):
        graph, _ = capture_graph(body)
        gpm_row(label, graph.replay, rows)
        cupti[label] = graph.replay

    # 3. four sleep chains on four streams in one graph
    chain = int(4.0 * cpu)
    four = capture_graph(fork_join([lambda: [torch.cuda._sleep(chain) for _ in range(5)] for _ in range(4)]))[0]
    one = capture_graph(lambda: [torch.cuda._sleep(chain) for _ in range(20)])[0]
    print(f"4 sleep chains (5 x 4 µs each): 4 streams {time_cuda_us(four.replay, reps=100):.1f} µs, "
          f"1 stream {time_cuda_us(one.replay, reps=100):.1f} µs (events)")
    gpm_row("4 sleep chains on 4 streams, graph", four.replay, rows)
    cupti["4 sleep chains on 4 streams, graph"] = four.replay

    # 4. the issue-4 workloads
    config = Config(cache_dir=out / "cache")
    keep: list[Any] = []
    with torch.no_grad():
        d = 1024
        models = [torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.ReLU(), torch.nn.Linear(d, d), torch.nn.ReLU(),
                                      torch.nn.Linear(d, d)).eval().cuda() for _ in range(4)]
        xs = [torch.randn(1, d, device="cuda") for _ in range(4)]
        pairs = [(m, (x,)) for m, x in zip(models, xs, strict=True)]
        work: list[tuple[str, Any, list[torch.Tensor]]] = []
        for streams in (4, 1):
            p = streamfuse.parallel(pairs, config.replace(max_streams=streams))
            for o, (m, (x,)) in zip(p(*xs), pairs, strict=True):
                torch.testing.assert_close(o, m(x), rtol=1e-3, atol=1e-3)
            work.append((f"4 MLPs d=1024, {streams} stream(s)", p.compiled, xs))
        for channels, size in ((64, 56), (32, 16)):
            block = MultiBranchConv(channels).eval().cuda()
            x = torch.randn(1, channels, size, size, device="cuda")
            for streams in (4, 1):
                c = streamfuse.compile(block, (x,), config.replace(max_streams=streams))
                torch.testing.assert_close(c(x), block(x), rtol=1e-2, atol=1e-2)
                work.append((f"conv c{channels} {size}x{size}, {streams} stream(s)", c, [x]))
                keep.append(block)
        for label, compiled, inputs in work:
            single = replay_of(compiled)
            many = calls_graph(compiled, inputs, 20)
            ev1, ev20 = time_cuda_us(single, reps=200), time_cuda_us(many, reps=50) / 20
            print(f"{label}: events {ev1:.1f} µs/call (one graph per call), {ev20:.1f} µs/call (20 per graph)")
            gpm_row(f"{label}: replays back to back", single, rows)
            gpm_row(f"{label}: 20 calls per graph", many, rows, per_call=20)
            cupti[f"{label}: replays back to back"] = single
            cupti[f"{label}: 20 calls per graph"] = many
            keep.append((single, many))

    # CUPTI after every GPM reading (it slows graphs for the rest of the process, PERF.md session 10)
    print("\nCUPTI (torch.profiler), after all GPM readings:")
    for label, fn in cupti.items():
        per = 20 if "20 calls" in label else 1
        tl = record_timeline(fn, calls=10, sync_each=True)
        try:
            gap = call_gap_ratio(tl, 10)
        except ValueError:
            gap = float("nan")
        first = one_call(fn)
        span = max(i.start_us + i.duration_us for i in first) - min(i.start_us for i in first)
        busy = union_length(first)
        starts = sorted({i.stream: i.start_us for i in reversed(first)}.values())
        cupti[label] = {"in_call_gap": gap, "span_us": span / per, "busy_us": busy / per}
        print(f"{label:60} CUPTI in-call gap {100 * gap:6.2f}%  span {span / per:7.2f} µs/call "
              f"busy {busy / per:7.2f}  stream starts {[round(s, 1) for s in starts][:5]}", flush=True)
    (out / "probe_idle.json").write_text(json.dumps({"gpm": rows, "cupti": cupti,
                                                     "median_sm": statistics.median(r["sm_util"] for r in rows)},
                                                    indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
