"""Does a process's history slow streamfuse's call path? The micro suite (run 1 of session 48, H200)
timed one-kernel streamfuse.compile calls 15-35 µs slower than benchmarks/graph_choice.py did alone
(run 173, H100). This times three of the suite's workloads, replayed and launched directly, in a
fresh process, again after torch.compile(mode="reduce-overhead") and an eager CUDA-graph capture
ran in the process (as the suite runs them before streamfuse), and again after torch.profiler ran;
then cProfile over the replayed call. CUDA only.

    python benchmarks/host_in_process.py
"""

from __future__ import annotations

import cProfile
import functools
import io
import pstats
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import streamfuse
from streamfuse import Config
from streamfuse.bench.workloads import WORKLOADS, chain8
from streamfuse.profile.timing import capture_graph, host_us_per_call, time_cuda_us

NAMES = ("pointwise chain 1K", "softmax 4096x4096", "32 small pointwise ops")


def main() -> int:
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    device = torch.device("cuda")
    fns: dict[str, Callable[[], Any]] = {}
    with torch.no_grad():
        for w in WORKLOADS:
            if w.name not in NAMES:
                continue
            fn, inputs = w.make(device)
            graphed = streamfuse.compile(fn, inputs)
            direct = streamfuse.compile(fn, inputs, Config(cuda_graphs=False))
            fns[f"{w.name} [default: {'graph' if graphed.graph_skip is None else 'direct'}]"] = \
                functools.partial(graphed, *inputs)
            fns[f"{w.name} [direct]"] = functools.partial(direct, *inputs)

        def phase(label: str) -> None:
            print(f"== {label}")
            for name, f in fns.items():
                print(f"  {name:50} events {time_cuda_us(f, warmup=20, reps=200):7.1f} µs   host {host_us_per_call(f):7.1f} µs")

        phase("fresh process")
        x = torch.randn(1024, device=device)
        ro = torch.compile(chain8, mode="reduce-overhead")
        for _ in range(5):
            torch.compiler.cudagraph_mark_step_begin()
            ro(x)
        graph, _ = capture_graph(lambda: chain8(x))
        graph.replay()
        phase("after torch.compile(mode='reduce-overhead') and an eager graph capture")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
            for f in fns.values():
                f()
            torch.cuda.synchronize()
        phase("after torch.profiler")
        first = next(iter(fns.values()))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(1000):
            first()
        prof.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
        print(f"== cProfile, 1000 calls of {next(iter(fns))}")
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
