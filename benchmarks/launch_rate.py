"""How fast does a CUDA graph start kernels on several streams? GPU only.

    python benchmarks/launch_rate.py

Graphs of N kernels (N = 12: the four 3-layer MLPs' launches; and 48), split over 1 or 4 streams
inside the graph (fork/join), each kernel a spin of a fixed duration (torch.cuda._sleep) or a
one-element add. If the four-stream time of N spins stays above N x (a few µs) even when the
spins alone would overlap to N/4 x duration, the graph's kernel launch rate, not the kernels,
bounds the four-stream schedule (the lead behind issue 4's MLP ratio, PERF.md session 10). The
last column replays one graph per stream instead (host-launched, so it is a GPU time only where
the kernels outlast the four launches).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from streamfuse.profile.timing import capture_graph, fork_join, time_cuda_us


def cycles_per_us() -> float:
    """The spin kernel's clock rate, measured: a long spin timed with events."""
    spin = 2_000_000
    torch.cuda._sleep(spin)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(spin)
    b.record()
    b.synchronize()
    return spin / (a.elapsed_time(b) * 1e3)


def chain(n: int, kernel: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        for _ in range(n):
            kernel()
    return run


def main() -> int:
    rate = cycles_per_us()
    print(f"spin clock: {rate:.0f} cycles/µs")
    cells = torch.zeros(8, device="cuda")
    print(f"{'kernels':>7} {'kernel':>12} {'1 stream µs':>11} {'4 streams µs':>12} {'ideal 4':>8} "
          f"{'µs per kernel, 4 streams':>24} {'4 graphs on 4 streams µs':>24}")
    for n in (12, 48):
        for label, us in (("add", 0.0), ("spin 2 µs", 2.0), ("spin 5 µs", 5.0)):
            def kernel(i: int = 0, us: float = us) -> None:
                if us:
                    torch.cuda._sleep(int(us * rate))
                else:
                    cells[i : i + 1].add_(1.0)
            one, _ = capture_graph(chain(n, kernel))
            four, _ = capture_graph(fork_join([chain(n // 4, lambda i=i: kernel(i)) for i in range(4)]))
            t1, t4 = time_cuda_us(one.replay, warmup=20, reps=200), time_cuda_us(four.replay, warmup=20, reps=200)
            # the control: one chain per graph, each graph replayed on its own stream (fork/join by
            # events outside the graphs): no branch of one graph waits behind another's launches
            parts = [capture_graph(chain(n // 4, lambda i=i: kernel(i)))[0] for i in range(4)]
            apart = fork_join([g.replay for g in parts])
            t4g = time_cuda_us(apart, warmup=20, reps=200)
            print(f"{n:7d} {label:>12} {t1:11.1f} {t4:12.1f} {n / 4 * us:8.1f} {t4 / n:24.2f} {t4g:24.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
