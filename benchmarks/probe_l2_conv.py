"""Two diagnostics behind issue 4's unmet targets, measured side by side in one run. GPU only.

    python benchmarks/probe_l2_conv.py [--part l2 conv] [--out DIR]

l2: is the four-MLP graph's bimodal time (PERF.md session 9: ~23 vs 32-41 µs on 4 streams) the
    weights falling in or out of L2? d=1024 fp32 weights are 4 x 3 x 4 MiB = 48 MiB, about the
    H200's L2. Fresh model sets (new allocations) at d = 768 (27 MiB), 1024 (48) and 1448 (96),
    each timed warm (back-to-back replays) and cold (L2 overwritten before every replay, events
    around the replay alone), 4 streams and the same kernels on one stream.
conv: the c64 56x56 multi-branch block as the streamfuse graph on 1 and 4 streams, with cuDNN's
    heuristic algorithms and with its benchmarked ones (torch.backends.cudnn.benchmark).
layout: each of its convolutions alone in a CUDA graph, NCHW vs channels_last (GPU time; run 30's
    eager per-convolution rows were host-bound and are no longer printed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from streams_graphs import four_and_one, mlp, paired_ratio, replay_of, same_kernels_one_stream

import streamfuse
from streamfuse import Config
from streamfuse.demo_models import MultiBranchConv
from streamfuse.profile.timing import time_cuda_us


def cold_us(fn: Callable[[], Any], reps: int = 40) -> float:
    """Median time of fn with L2 overwritten (a 256 MiB write) before each call; events around fn only."""
    scrub = torch.empty(64 * 1024 * 1024, device="cuda")
    times = []
    for _ in range(reps + 3):
        scrub.fill_(1.0)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times[3:])


def l2(out: Path) -> None:
    print(f"{'d':>5} {'MiB':>4} {'set':>3} {'4 str warm':>10} {'1 str warm':>10} {'paired':>7} "
          f"{'4 str cold':>10} {'1 str cold':>10}")
    for d in (768, 1024, 1448):
        for k in range(3):
            torch.manual_seed(k)
            models = [mlp(d) for _ in range(4)]
            xs = [torch.randn(1, d, device="cuda") for _ in range(4)]
            four, _ = four_and_one([(m, (x,)) for m, x in zip(models, xs, strict=True)],
                                   Config(cache_dir=out / "cache"))
            g4, s1 = replay_of(four.compiled), same_kernels_one_stream(four.compiled, xs)
            w4, w1 = time_cuda_us(g4, warmup=20, reps=200), time_cuda_us(s1, warmup=20, reps=200)
            pr = paired_ratio(s1, g4)
            print(f"{d:5d} {4 * 3 * d * d * 4 / 2**20:4.0f} {k:3d} {w4:10.1f} {w1:10.1f} {pr['median']:6.2f}x "
                  f"{cold_us(g4):10.1f} {cold_us(s1):10.1f}")


def conv(out: Path) -> None:
    torch.manual_seed(0)
    block = MultiBranchConv(64).eval().cuda()
    x = torch.randn(1, 64, 56, 56, device="cuda")
    for bench in (False, True):
        torch.backends.cudnn.benchmark = bench
        native = Config(cache_dir=out / "cache", conv_layout="native")  # cuDNN's own choice, as in run 30
        c4 = streamfuse.compile(block, (x,), native)
        c1 = streamfuse.compile(block, (x,), native.replace(max_streams=1))
        for c in (c4, c1):
            torch.testing.assert_close(c(x), block(x), rtol=2e-3, atol=2e-3)
        g4, g1 = replay_of(c4), replay_of(c1)
        pr = paired_ratio(g1, g4)
        print(f"streamfuse c64 56x56, cudnn.benchmark={bench!s:5}: 1 stream {time_cuda_us(g1, reps=200):.1f} µs, "
              f"4 streams {time_cuda_us(g4, reps=200):.1f} µs, paired {pr['median']:.2f}x "
              f"({pr['min']:.2f}-{pr['max']:.2f})")
    torch.backends.cudnn.benchmark = False


def conv_layout(out: Path) -> None:
    """Each c64 56x56 convolution alone, in a CUDA graph (so GPU time, not eager host time):
    NCHW, channels_last with the layout changes inside the graph, channels_last throughout; TF32 on
    (cuDNN's default) and off. Then the kernels cuDNN runs for the 5x5 in each layout."""
    from streamfuse.profile.timeline import one_call
    from streamfuse.profile.timing import capture_graph

    torch.manual_seed(0)
    x = torch.randn(1, 64, 56, 56, device="cuda")
    xcl = x.contiguous(memory_format=torch.channels_last)
    for k in (1, 3, 5):
        conv = torch.nn.Conv2d(64, 16, k, padding=k // 2).cuda()
        wcl = conv.weight.contiguous(memory_format=torch.channels_last)
        ref = conv(x)
        variants = {
            "NCHW": lambda conv=conv: conv(x),
            "CL+convert": lambda conv=conv, wcl=wcl, p=k // 2: torch.nn.functional.conv2d(
                x.contiguous(memory_format=torch.channels_last), wcl, conv.bias, padding=p).contiguous(),
            "CL only": lambda conv=conv, wcl=wcl, p=k // 2: torch.nn.functional.conv2d(xcl, wcl, conv.bias, padding=p),
        }
        cells = []
        for tf32 in (True, False):
            torch.backends.cudnn.allow_tf32 = tf32
            for name, fn in variants.items():
                torch.testing.assert_close(fn(), ref, rtol=3e-3, atol=3e-3)
                graph, _ = capture_graph(fn)
                cells.append(f"{name}{'' if tf32 else ' fp32'} {time_cuda_us(graph.replay, warmup=20, reps=300):5.1f}")
                if k == 5 and tf32:
                    print(f"  5x5 {name} kernels: " + "; ".join(f"{i.name[:60]} {i.duration_us:.1f}"
                                                              for i in one_call(graph.replay)))
        torch.backends.cudnn.allow_tf32 = True
        print(f"conv {k}x{k} 64->16 56x56 in a graph (µs): " + ", ".join(cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--part", nargs="+", default=["l2", "conv"], choices=["l2", "conv", "layout"])
    parser.add_argument("--out", default="out")
    args = parser.parse_args()
    with torch.no_grad():
        for part in args.part:
            {"l2": l2, "conv": conv, "layout": conv_layout}[part](Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
