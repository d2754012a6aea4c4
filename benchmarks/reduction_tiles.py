"""Row reductions of real models (softmax, layer norm) at several `Config.reduction_elems_per_thread`,
side by side in one run: GPU time per call and achieved bandwidth of the generated kernel.

    python benchmarks/reduction_tiles.py [--elems 2,4,8,16,32] [--reps 20]

Why: issue 15's slowest generated kernel on a throughput row is swin_t's window softmax (rows of 49,
bias and shifted-window mask added): 113-123 µs at a quarter of copy bandwidth, register-limited
(runs 118-119), against Inductor's 77. The persistent reduction sizes its tile from one budget of
elements per thread for every row length. This prints what each budget gives on each shape, so a
rule by row length can be read off measurements instead of one model's profile.

`--grid 16:16:1024,8:16:2048,...` sweeps (reduction_elems_per_thread, reduction_max_warps[,
reduction_tile_elems]) instead, which reach tiles of other rows-per-program and warps (8:16:2048 is
the rule before run 162); `--only swin,vit` keeps the workloads whose names
hold one of the words; `--inductor` adds torch.compile's (default mode) kernels, timed the same way.

Each workload is compiled by streamfuse.compile (cuda_graphs off; the whole call is then captured
and replayed here, so the time is the kernels' alone) and checked against eager before timing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _window_softmax(windows: int, heads: int, batch: int) -> tuple[Callable[..., torch.Tensor], tuple]:
    def fn(attn: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        attn = attn + bias.unsqueeze(0)
        attn = attn.view(batch, windows, heads, 49, 49) + mask.unsqueeze(1).unsqueeze(0)
        return F.softmax(attn.view(-1, heads, 49, 49), dim=-1)

    return fn, ((batch * windows, heads, 49, 49), (heads, 49, 49), (windows, 49, 49))


def _masked_softmax(batch: int, heads: int, seq: int) -> tuple[Callable[..., torch.Tensor], tuple]:
    def fn(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return F.softmax(scores * 0.125 + mask, dim=-1)

    return fn, ((batch, heads, seq, seq), (batch, 1, 1, seq))


def _layer_norm(rows: int, width: int) -> tuple[Callable[..., torch.Tensor], tuple]:
    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (width,), w, b)

    return fn, ((rows, width), (width,), (width,))


WORKLOADS: dict[str, tuple[Callable[..., torch.Tensor], tuple]] = {
    "swin_t b32 window softmax, stage 1 (301k rows x 49)": _window_softmax(64, 3, 32),
    "swin_t b32 window softmax, stage 2 (150k rows x 49)": _window_softmax(16, 6, 32),
    "bert 8x128 masked softmax (12k rows x 128)": _masked_softmax(8, 12, 128),
    "vit_b_16 b32 softmax (76k rows x 197)": _masked_softmax(32, 12, 197),
    "swin_t b32 layer norm (100k rows x 96)": _layer_norm(32 * 56 * 56, 96),
    "vit_b_16 b32 layer norm (6.3k rows x 768)": _layer_norm(32 * 197, 768),
    "bert 8x128 layer norm (1k rows x 768)": _layer_norm(8 * 128, 768),
    "gpt2 b1x128 layer norm (128 rows x 768)": _layer_norm(128, 768),
    "gpt2 8x1024 masked softmax (98k rows x 1024)": _masked_softmax(8, 12, 1024),
    "llama-7b 8x128 layer norm (1k rows x 4096)": _layer_norm(8 * 128, 4096),
}


def timed_cell(call: Callable[[], object], err: float, tolerance: float, nbytes: int, reps: int, extra: str = "") -> str:
    """One table cell: "µs (GB/s) [extra]" of `call` replayed from a CUDA graph, or "wrong (err)"
    where its relative error against eager exceeds `tolerance` (untimed)."""
    from streamfuse.profile.timing import time_graph_us

    if err > tolerance:
        return f"wrong ({err:.1e})"
    us = time_graph_us(call, calls=10, reps=reps)
    return f"{us:7.1f} ({nbytes / us / 1e3:5.0f})" + (f" [{extra}]" if extra else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elems", default="2,4,8,16,32", help="reduction_elems_per_thread values, comma-separated")
    ap.add_argument("--grid", default="", help="elems:max_warps[:tile_elems], comma-separated (overrides --elems)")
    ap.add_argument("--only", default="", help="words, comma-separated: keep workloads whose names hold one")
    ap.add_argument("--inductor", action="store_true", help="add torch.compile's kernels as a last column")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("reduction_tiles.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import streamfuse

    if args.grid:
        pairs = [tuple(int(v) for v in p.split(":")) for p in args.grid.split(",")]
    else:
        pairs = [(int(e),) for e in args.elems.split(",")]
    words = [w for w in args.only.split(",") if w]
    workloads = {k: v for k, v in WORKLOADS.items() if not words or any(w in k for w in words)}
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; µs per call (GB/s), "
          f"by reduction_elems_per_thread[:reduction_max_warps]; [BLOCK_M x BLOCK_R, warps] of the kernel")
    heads = [":".join(map(str, p)) for p in pairs] + (["inductor"] if args.inductor else [])
    print(f"{'workload':54s}" + "".join(f"{h:>26s}" for h in heads))
    for name, (fn, shapes) in workloads.items():
        inputs = tuple(torch.randn(s, device=device, generator=gen) for s in shapes)
        want = fn(*inputs)
        nbytes = sum(t.numel() * t.element_size() for t in (*inputs, want))
        cells = []
        for pair in pairs:
            config = streamfuse.Config(cuda_graphs=False, **dict(zip(
                ("reduction_elems_per_thread", "reduction_max_warps", "reduction_tile_elems"), pair, strict=False)))
            compiled = streamfuse.compile(fn, inputs, config)
            got = compiled(*inputs)
            err = float((got - want).abs().max() / want.abs().max())
            tiles = [f"{s.constexprs.get('BLOCK_M')}x{s.constexprs.get('BLOCK_R')},{s.num_warps}w"
                     for s in compiled.sources.values() if "BLOCK_R" in s.constexprs]
            cells.append(timed_cell(lambda c=compiled, x=inputs: c(*x), err, 1e-5, nbytes, args.reps, ";".join(tiles)))
        if args.inductor:
            torch._dynamo.reset()
            ind = torch.compile(fn)
            err = float((ind(*inputs) - want).abs().max() / want.abs().max())
            cells.append(timed_cell(lambda c=ind, x=inputs: c(*x), err, 1e-5, nbytes, args.reps))
        print(f"{name:54s}" + "".join(f"{c:>26s}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
