"""Probe: is a one-kernel streamfuse call (softmax 4096^2, no CUDA graph) host-bound, and does a
torch.compile run in the same process change its launch path (Triton launch hooks)?

    python benchmarks/probe_host_path.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import streamfuse
from streamfuse.profile.timing import host_us_per_call, time_cuda_us
from streamfuse.runtime.steps import KernelStep, triton_hooks_unset


def report(label: str, compiled: streamfuse.CompiledGraph, x: torch.Tensor) -> None:
    steps = [s for s in compiled.base.steps if isinstance(s, KernelStep)]
    print(f"{label}: call {time_cuda_us(lambda: compiled(x)):.1f} µs, host {host_us_per_call(lambda: compiled(x)):.1f} µs, "
          f"direct launch {all(s.direct for s in steps)}, hooks unset {triton_hooks_unset()}, "
          f"graphs {compiled.use_graphs} ({compiled.graph_skip})")


def main() -> int:
    torch.set_grad_enabled(False)
    x = torch.randn(4096, 4096, device="cuda")
    fn = lambda t: torch.softmax(t, -1)
    compiled = streamfuse.compile(fn, (x,))
    print(f"eager: call {time_cuda_us(lambda: fn(x)):.1f} µs, host {host_us_per_call(lambda: fn(x)):.1f} µs")
    report("streamfuse", compiled, x)
    other = torch.compile(fn)
    other(x)
    print(f"torch.compile: call {time_cuda_us(lambda: other(x)):.1f} µs")
    report("streamfuse after torch.compile ran", compiled, x)
    ro = torch.compile(fn, mode="reduce-overhead")
    for _ in range(3):
        ro(x)
    report("streamfuse after reduce-overhead ran", compiled, x)
    return 0


if __name__ == "__main__":
    sys.exit(main())
