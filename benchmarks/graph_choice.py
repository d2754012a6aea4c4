"""Does the graph cost model (runtime/graph_cost.py) pick the faster path? Each workload is compiled
twice with streamfuse.compile, once forced onto CUDA-graph replay and once launched directly
(Config(cuda_graphs=False)), and timed in turns (CUDA events, calls back to back) beside what the
model decided, from one small kernel up to plans whose input copies cost tens of µs.

    python benchmarks/graph_choice.py [--reps 3]

Prints µs per call of both paths, the model's estimate (µs saved, µs added), its decision and
whether that was the faster path (within 3%); the outputs of both paths are checked against eager.
GPU only."""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import streamfuse
from streamfuse import Config
from streamfuse.bench.runner import rel_error
from streamfuse.profile.timing import time_cuda_us
from streamfuse.runtime.graph_cost import graph_estimate


def _randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=dtype)


def _workloads() -> list[tuple[str, Callable[..., Any], tuple[torch.Tensor, ...]]]:
    d = 4096
    linear = nn.Linear(d, d).cuda().to(torch.bfloat16).eval()
    mlp = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024)).cuda().eval()
    norm = nn.LayerNorm(1024).cuda().eval()
    return [
        ("pointwise 1K", lambda x: (x.relu() * 2 + 1).sigmoid(), (_randn(1024),)),
        ("softmax 8x4096", lambda x: torch.softmax(x, -1), (_randn(8, 4096),)),
        ("layer_norm 64x1024", norm, (_randn(64, 1024),)),
        ("linear 4096 + gelu bf16, batch 8", lambda x: F.gelu(linear(x)), (_randn(8, d, dtype=torch.bfloat16),)),
        ("MLP 1024 batch 1", mlp, (_randn(1, 1024),)),
        ("pointwise 1M (4 MiB)", lambda x: (x.relu() * 2 + 1).sigmoid(), (_randn(1024, 1024),)),
        ("softmax 2048x2048 (16 MiB)", lambda x: torch.softmax(x, -1).sum(0) + 1, (_randn(2048, 2048),)),
        ("pointwise 8M (32 MiB)", lambda x: (x.relu() * 2 + 1).sigmoid(), (_randn(8192, 1024),)),
        ("softmax 4096x4096 (64 MiB)", lambda x: torch.softmax(x, -1).sum(0) + 1, (_randn(4096, 4096),)),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="rounds of the two paths timed in turns")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("graph_choice.py needs a CUDA GPU")
        return 1
    torch.set_grad_enabled(False)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    header = (f"{'workload':34} {'launch':>6} {'direct us':>10} {'graph us':>9} {'saved':>6} {'added':>6}"
              "  decided  right  err")
    print(header)
    wrong = 0
    for name, fn, inputs in _workloads():
        decided = streamfuse.compile(fn, inputs)
        graphed = streamfuse.compile(fn, inputs)
        graphed.graph_skip, graphed.use_graphs = None, True
        direct = streamfuse.compile(fn, inputs, Config(cuda_graphs=False))
        expected = fn(*inputs)
        err = max(rel_error(graphed(*inputs), expected), rel_error(direct(*inputs), expected))
        times: dict[str, list[float]] = {"direct": [], "graph": []}
        for _ in range(args.reps):
            times["direct"].append(time_cuda_us(functools.partial(direct, *inputs), warmup=20, reps=200))
            times["graph"].append(time_cuda_us(functools.partial(graphed, *inputs), warmup=20, reps=200))
        us = {k: statistics.median(v) for k, v in times.items()}
        assert graphed.stats["graphs"] >= 1, f"{name}: the forced graph did not record ({graphed.graph_failure})"
        saved, added, _ = graph_estimate(decided.base)
        chose = "graph" if decided.graph_skip is None else "direct"
        faster = min(us, key=us.__getitem__)
        right = chose == faster or abs(us["graph"] - us["direct"]) <= 0.03 * min(us.values())
        wrong += not right
        print(f"{name:34} {decided.base.launches:>6} {us['direct']:>10.1f} {us['graph']:>9.1f} {saved:>6.1f} "
              f"{added:>6.1f}  {chose:7}  {'yes' if right else 'NO':5}  {err:.1e}")
    print(f"the model chose the slower path (by more than 3%) on {wrong} workload(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
