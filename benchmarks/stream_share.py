"""How wide should a kernel be when it shares the GPU with kernels on other streams?

Four independent 3-layer MLPs (d=1024, fp32, batch 1) through streamfuse.parallel, on 1 and on 4
streams, with the split-K cap (Config.matmul_max_split_k, which bounds the programs per matrix-vector
product) swept: a full-GPU kernel leaves nothing for the other streams, a narrow one is slower alone.
Graph replay times side by side in one run, each ratio over 7 alternating rounds.

    python benchmarks/stream_share.py [--splits 1 2 4 8 32] [--pdl on off alone] [--priorities on off]
        [--tune-concurrency on off] [--timeline]

--timeline prints one four-stream call's kernels per stream (first start, last end, in µs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from streams_graphs import four_and_one, same_kernels_one_stream

import streamfuse
from streamfuse import Config
from streamfuse.profile.timeline import one_call
from streamfuse.profile.timing import time_cuda_us


def per_stream(intervals: list) -> str:
    spans: dict[int, tuple[float, float]] = {}
    for i in intervals:
        first, last = spans.get(i.stream, (i.start_us, i.end_us))
        spans[i.stream] = (min(first, i.start_us), max(last, i.end_us))
    return "; ".join(f"s{s} {a:.1f}-{b:.1f}" for s, (a, b) in spans.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 32])
    parser.add_argument("--pdl", nargs="+", default=["on", "off"], choices=["on", "off", "alone"],
                        help="alone: PDL only for kernels that run beside no other stream's (Config.pdl_beside_others)")
    parser.add_argument("--priorities", nargs="+", default=["on"], choices=["on", "off"])
    parser.add_argument("--tune-concurrency", nargs="+", default=["on"], choices=["on", "off"])
    parser.add_argument("--timeline", action="store_true")
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--out", default="out")
    args = parser.parse_args()
    torch.manual_seed(0)
    d = args.d
    models = [torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.ReLU(), torch.nn.Linear(d, d), torch.nn.ReLU(),
                                  torch.nn.Linear(d, d)).eval().cuda() for _ in range(4)]
    xs = [torch.randn(1, d, device="cuda") for _ in range(4)]
    pairs = [(m, (x,)) for m, x in zip(models, xs, strict=True)]
    print(f"{'tune x':>6} {'prio':>4} {'pdl':>4} {'max split':>9} {'1-stream plan':>13} {'4 streams µs':>13} {'ratio median':>13} "
          f"{'range':>12} {'splits chosen':>16}   same kernels on 1 stream: µs, ratio median (range)")
    timelines: list[tuple[str, torch.cuda.CUDAGraph, streamfuse.ParallelModels]] = []
    with torch.no_grad():
        for tc, prio, pdl, split in [(t, r, p, s) for t in args.tune_concurrency for r in args.priorities
                                     for p in args.pdl for s in args.splits]:
            config = Config(cache_dir=Path(args.out) / "cache", matmul_max_split_k=split, pdl=pdl != "off",
                            pdl_beside_others=pdl == "on",
                            stream_priorities=prio == "on", autotune_concurrency=tc == "on")
            four, one = four_and_one(pairs, config)
            (g1,) = one.compiled.recorded_graphs().values()
            (g4,) = four.compiled.recorded_graphs().values()
            same = same_kernels_one_stream(four.compiled, xs)
            t1, t4, ts, ratios, same_ratios = [], [], [], [], []
            for _ in range(7):
                a, b = time_cuda_us(g1.replay, warmup=5, reps=60), time_cuda_us(g4.replay, warmup=5, reps=60)
                c = time_cuda_us(same, warmup=5, reps=60)
                t1.append(a), t4.append(b), ts.append(c), ratios.append(a / b), same_ratios.append(c / b)
            chosen = sorted({s.constexprs.get("SPLIT_K", 1) for s in four.compiled.base.sources.values()})
            print(f"{tc:>6} {prio:>4} {pdl:>4} {split:9d} {statistics.median(t1):12.1f} {statistics.median(t4):13.1f} "
                  f"{statistics.median(ratios):12.2f}x {min(ratios):5.2f}-{max(ratios):.2f}x {chosen!s:>16}   "
                  f"{statistics.median(ts):.1f}, {statistics.median(same_ratios):.2f}x "
                  f"({min(same_ratios):.2f}-{max(same_ratios):.2f})")
            timelines.append((f"{tc} {prio} {pdl} {split}", g4, four))
        conv: dict[int, tuple[streamfuse.CompiledGraph, torch.cuda.CUDAGraph, float]] = {}
        if args.timeline:  # the multi-branch conv block of streams_graphs.py, c64 at 56x56
            from streamfuse.demo_models import MultiBranchConv

            block = MultiBranchConv(64).eval().cuda()
            x = torch.randn(1, 64, 56, 56, device="cuda")
            for streams in (1, 4):
                c = streamfuse.compile(block, (x,), Config(cache_dir=Path(args.out) / "cache", max_streams=streams))
                c(x)
                (g,) = c.recorded_graphs().values()
                conv[streams] = (c, g, time_cuda_us(g.replay))
        # the timelines after every timing: once torch.profiler has run, four-stream graphs run
        # slower in this process (PERF.md session 10)
        for label, g4, _ in timelines if args.timeline else []:
            print(f"      one 4-stream call ({label}): " + per_stream(one_call(g4.replay)))
        for streams, (_, g, us) in conv.items():
            print(f"conv c64, {streams} stream(s), {us:.1f} µs: " + "; ".join(
                f"s{i.stream} {i.name[:14]} {i.start_us:.1f}+{i.duration_us:.1f}" for i in one_call(g.replay)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
