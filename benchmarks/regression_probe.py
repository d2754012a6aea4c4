"""Probe: does streamfuse's per-call host time change after torch.profiler / torch.compile run in
the same process? (The bench suite runs them before the streamfuse mode.) GPU only."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import streamfuse
from streamfuse.profile.timeline import record_timeline
from streamfuse.profile.timing import time_cuda_us


def main() -> int:
    torch.set_grad_enabled(False)
    x = torch.randn(4096, 4096, device="cuda")
    small = torch.randn(1024, device="cuda")
    sm = streamfuse.compile(lambda t: torch.softmax(t, -1), (x,))
    ch = streamfuse.compile(lambda t: torch.exp(torch.relu(t * 2 + 1)), (small,))

    def report(stage: str) -> None:
        from triton import knobs

        hooks = [len(getattr(h, "calls", [])) for h in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)]
        print(f"{stage:34} softmax {time_cuda_us(lambda: sm(x)):7.1f} us   chain 1K {time_cuda_us(lambda: ch(small)):6.1f} us"
              f"   eager softmax {time_cuda_us(lambda: torch.softmax(x, -1)):6.1f} us   triton hooks {hooks}")

    report("fresh process")
    record_timeline(lambda: sm(x), calls=5)
    report("after torch.profiler")
    f = torch.compile(lambda t: torch.softmax(t, -1))
    f(x)
    report("after torch.compile")
    g = torch.compile(lambda t: torch.softmax(t, -1) * 2, mode="reduce-overhead")
    for _ in range(3):
        g(x)
    report("after torch.compile reduce-overhead")
    return 0


if __name__ == "__main__":
    sys.exit(main())
