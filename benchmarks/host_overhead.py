"""Host time per call of a one-kernel CompiledGraph, and where it goes (cProfile). GPU only."""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import streamfuse  # noqa: E402


def per_call_us(fn, n: int = 2000) -> float:  # type: ignore[no-untyped-def]
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main() -> int:
    x = torch.randn(1024, device="cuda")
    fn = lambda t: torch.relu(t * 2 + 1)  # noqa: E731
    compiled = streamfuse.compile(fn, (x,))
    step = compiled.steps[0]
    env = [None] * len(compiled.graph.nodes)
    env[compiled._input_slots[0]] = x
    out = torch.empty_like(x)
    print(f"eager (3 ops)               {per_call_us(lambda: fn(x)):7.1f} us/call")
    print(f"compiled(x)                 {per_call_us(lambda: compiled(x)):7.1f} us/call")
    print(f"compiled.run_flat([x])      {per_call_us(lambda: compiled.run_flat([x])):7.1f} us/call")
    print(f"KernelStep.run              {per_call_us(lambda: step.run(env)):7.1f} us/call")
    src = step.source
    args = [x, 1, out]
    print(f"kernel[grid](...) via JIT   {per_call_us(lambda: step.kernel[src.grid](*args, **src.constexprs)):7.1f} us/call")
    print(f"torch.empty                 {per_call_us(lambda: torch.empty(1024, device='cuda')):7.1f} us/call")
    with torch.no_grad():
        print(f"compiled(x) under no_grad   {per_call_us(lambda: compiled(x)):7.1f} us/call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        compiled(x)
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
