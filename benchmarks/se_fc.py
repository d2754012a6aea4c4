"""Squeeze-and-excitation FCs as cuDNN convolutions or products (Config.pointwise_conv_mm, ir/conv_mm.py).

    python benchmarks/se_fc.py [--models efficientnet,mobilenet_v3] [--peer]

1. Each FC chain of EfficientNet-B0's and MobileNet-v3's SE shapes at batch 1 and 32, in a CUDA graph:
   conv2d on [N, C, 1, 1] (+ bias + SiLU, conv2d + bias + sigmoid) against addmm on [N, C] (+ SiLU,
   addmm + sigmoid), and each product alone.
2. The suite's models at batch 1 through streamfuse.compile with the setting off and on (and
   reduce-overhead with --peer), in one process, timing rounds interleaved: median µs per call.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

SHAPES = [(32, 8), (96, 4), (144, 6), (240, 10), (480, 20), (672, 28), (1152, 48), (72, 24), (120, 32), (960, 240)]
"""(channels, squeezed): EfficientNet-B0's blocks, then MobileNet-v3's."""


def chains() -> None:
    from streamfuse.profile.timing import time_graph_us

    for n in (1, 32):
        print(f"batch {n}: C S | conv chain | mm chain | conv alone | mm alone (µs per call, replayed in a graph)")
        for c, s in SHAPES:
            x = torch.randn(n, c, 1, 1, device="cuda")
            w1, b1 = torch.randn(s, c, 1, 1, device="cuda") * 0.1, torch.randn(s, device="cuda")
            w2, b2 = torch.randn(c, s, 1, 1, device="cuda") * 0.1, torch.randn(c, device="cuda")
            w1m, w2m = w1.view(s, c).t(), w2.view(c, s).t()

            def conv_chain() -> torch.Tensor:
                h = F.silu(F.conv2d(x, w1) + b1.view(1, s, 1, 1))  # noqa: B023 - timed at once
                return torch.sigmoid(F.conv2d(h, w2) + b2.view(1, c, 1, 1))  # noqa: B023

            def mm_chain() -> torch.Tensor:
                h = F.silu(torch.addmm(b1, x.view(n, c), w1m))  # noqa: B023
                return torch.sigmoid(torch.addmm(b2, h, w2m)).view(n, c, 1, 1)  # noqa: B023

            torch.testing.assert_close(conv_chain(), mm_chain(), rtol=1e-2, atol=1e-2)
            t = [time_graph_us(f, calls=20, reps=20)
                 for f in (conv_chain, mm_chain, lambda: F.conv2d(x, w1), lambda: x.view(n, c) @ w1m)]  # noqa: B023
            print(f"  {c:5d} {s:4d} | {t[0]:7.2f} | {t[1]:7.2f} | {t[2]:6.2f} | {t[3]:6.2f}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="efficientnet,mobilenet_v3")
    ap.add_argument("--peer", action="store_true", help="also torch.compile(mode='reduce-overhead')")
    ap.add_argument("--no-chains", action="store_true")
    args = ap.parse_args()
    if not args.no_chains:
        chains()
    from setting_ab import compare  # benchmarks/setting_ab.py: off and on, interleaved

    compare(args.models, "1", "float32", "pointwise_conv_mm=true", args.peer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
