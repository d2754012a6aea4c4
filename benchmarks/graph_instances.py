"""Is a four-stream graph's speed drawn per captured instance? GPU only.

    python benchmarks/graph_instances.py [--instances 8] [--rounds 5] [--profiler]

The same compiled plan (four batch-1 MLPs through streamfuse.parallel; the c64 56x56 multi-branch
conv block) captured into several CUDA graphs, each replayed in several rounds, interleaved. If
an instance's time is stable across rounds but instances differ (PERF.md session 10: identical
launches gave paired ratios of 1.19x and 1.43x in two compiles), the slow mode is drawn at capture
and a capture can be measured and redone. --profiler measures everything again after one
torch.profiler session (CUPTI stays attached to the process afterwards).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from streams_graphs import mlp

import streamfuse
from streamfuse import Config
from streamfuse.demo_models import MultiBranchConv
from streamfuse.profile.timing import capture_graph, time_cuda_us

Captured = tuple[str, list[torch.cuda.CUDAGraph]]
alive: list[object] = []


def capture(label: str, compiled: streamfuse.CompiledGraph, inputs: list[torch.Tensor], n: int) -> Captured:
    exe, keep = compiled.base, []
    statics = [x.clone() for x in inputs]
    graphs = [capture_graph(lambda: exe.run(statics, keep_alive=keep))[0] for _ in range(n)]
    alive.append((statics, keep))  # what the graphs read and write
    return f"{label} ({compiled.stats['streams']} streams)", graphs


def report(captured: list[Captured], rounds: int) -> None:
    for label, graphs in captured:
        times = [[0.0] * rounds for _ in graphs]
        for r in range(rounds):
            for i, g in enumerate(graphs):
                times[i][r] = time_cuda_us(g.replay, warmup=5, reps=60)
        print(f"{label}, µs per replay, one row per captured instance:")
        for i, row in enumerate(times):
            print(f"  instance {i}: median {statistics.median(row):6.1f}   rounds " + " ".join(f"{t:5.1f}" for t in row))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profiler", action="store_true")
    parser.add_argument("--out", default="out")
    args = parser.parse_args()
    config = Config(cache_dir=Path(args.out) / "cache")
    torch.manual_seed(0)
    captured: list[Captured] = []
    with torch.no_grad():
        models = [mlp(1024) for _ in range(4)]
        xs = [torch.randn(1, 1024, device="cuda") for _ in range(4)]
        block = MultiBranchConv(64).eval().cuda()
        x = torch.randn(1, 64, 56, 56, device="cuda")
        for streams in (4, 1):
            n = args.instances if streams > 1 else 2
            par = streamfuse.parallel([(m, (x,)) for m, x in zip(models, xs, strict=True)],
                                      config.replace(max_streams=streams))
            par(*xs)
            captured.append(capture("4 MLPs d=1024", par.compiled, xs, n))
            c = streamfuse.compile(block, (x,), config.replace(max_streams=streams))
            c(x)
            captured.append(capture("conv block c64 56x56", c, [x], n))
        report(captured, args.rounds)
        if args.profiler:
            from streamfuse.profile.timeline import record_timeline

            a = torch.randn(256, 256, device="cuda")
            record_timeline(lambda: a @ a, calls=5)
            print("\n--- the same graphs after one torch.profiler session in this process")
            report(captured, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
