"""The suite's backend rows, reproduced inside the suite's own code path and taken apart.

Session 49 measured torch.compile(backend="streamfuse") at 0.99-1.05x of streamfuse.compile at bf16
batch 1 (benchmarks/backend_gap.py, with and without the suite's TF32-off and batch-3 calls first),
while `streamfuse bench --suite models` timed googlenet at 2.23x and mobilenet_v3_small at 2.42x in the
same session (run 180). This runs the suite's `run_mode` for streamfuse and sf-backend (cold cache and
a warm compile after the checks, as the suite does; then once more without the warm compile), keeps
the callable the suite timed, and prints:
  - the suite's µs per call next to the same callable timed again here, its host µs per call in
    bursts, and over a back-to-back loop;
  - which bound plans (StaticParamsGraph) that callable ran, and whether each replays a CUDA graph;
  - layer probes of the process's host speed before and after (a Python loop, one ATen launch on the
    GPU, one replay of a one-kernel CUDA graph): a process that has become slower shows in all three.
CUDA only.

    python benchmarks/suite_backend.py --models googlenet,mobilenet_v3_small --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from backend_gap import graph_state, row  # the sibling script (this file's folder is on sys.path)

import streamfuse
from streamfuse.bench import runner
from streamfuse.bench.models import model_workloads
from streamfuse.capture.backend import StaticParamsGraph
from streamfuse.profile.timing import capture_graph, host_us_per_call


def python_us(n: int = 2000) -> float:
    """µs for `n` small Python function calls (a frame hook or tracer left installed shows here)."""
    def f(a: int) -> int:
        return a + 1

    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for i in range(n):
            f(i)
        best = min(best, (time.perf_counter() - t) * 1e6)
    return best


def probes(label: str) -> None:
    x = torch.randn(1024, device="cuda")
    graph, _ = capture_graph(lambda: x.add_(1))
    print(f"  [{label}] python 2000 calls {python_us():7.1f} µs | ATen add_ host {host_us_per_call(lambda: x.add_(1)):6.1f} µs"
          f" | one-kernel graph replay host {host_us_per_call(graph.replay):6.1f} µs", flush=True)


def plans_run(fn: Callable[[], Any]) -> list[StaticParamsGraph]:
    """The bound plans that one call of `fn` runs."""
    seen: list[StaticParamsGraph] = []
    original = StaticParamsGraph.run_flat

    def spy(self: StaticParamsGraph, args: list[Any]) -> list[Any]:
        if self not in seen:
            seen.append(self)
        return original(self, args)

    StaticParamsGraph.run_flat = spy  # type: ignore[method-assign]
    try:
        fn()
    finally:
        StaticParamsGraph.run_flat = original  # type: ignore[method-assign]
    return seen


def describe(fn: Callable[[], Any]) -> None:
    with torch.no_grad():
        row("again here", fn)
        for i, g in enumerate(plans_run(fn)):
            if g.compiled is None:
                print(f"    plan {i}: unbound ({g.reason})")
                continue
            print(f"    plan {i}: {len(g.static)} bound, kernels {g.compiled.stats.get('kernels')}; "
                  f"{graph_state(g.compiled)}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="googlenet,mobilenet_v3_small")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    device = torch.device("cuda")
    root = Path(tempfile.mkdtemp(prefix="suite-backend-"))
    config = streamfuse.Config(cache_dir=root / "cache")
    timed: dict[str, Callable[[], Any]] = {}
    original = runner.time_us

    def keep(fn: Callable[[], Any], dev: torch.device, reps: int | None = None) -> float:
        timed["fn"] = fn
        return original(fn, dev, reps)

    runner.time_us = keep  # type: ignore[assignment]
    probes("fresh process")
    for model in args.models.split(","):
        workload = model_workloads(model, batch="1", dtype=args.dtype)[0]
        ref = runner.reference(workload, device)
        for index, (mode, warm) in enumerate([("streamfuse", True), ("sf-backend", True), ("sf-backend", False)]):
            torch._dynamo.reset()
            cold = config.replace(cache_dir=root / f"{model}-{index}")
            runner.seed_calibration(config.cache_dir, cold.cache_dir, device)
            result = runner.run_mode(mode, workload, device, cold, ref, [], gaps=False, reps=args.reps,
                                     warm_compile=warm)
            print(f"{workload.name} {mode} (warm compile before timing: {warm}): suite {result.us} µs, "
                  f"error {result.error}, second {result.second_error}", flush=True)
            describe(timed.pop("fn"))
        probes(f"after {model}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
