"""Reductions over rows longer than Config.max_persistent_reduction, side by side in one run: the
looped template (Config.long_row_reduction) at a few launch settings, the same kernels with the
long rows sent to ATen (long_row_reduction=False: ATen's sum after a generated prologue kernel that
writes its input out), and torch.compile's (default mode) kernels. GPU time per call and achieved
bandwidth over the bytes each call must move (its inputs read once, its results written once).

    python benchmarks/long_rows.py [--reps 20] [--only bn,loss]

Why: a training batch norm's backward sums the gradient and the gradient times the normalised
input over N, H and W, rows of 100,352 elements per channel in resnet50's first stage at batch 32
(401,408 at its stem). Run 195's profile has one such kernel at 218 µs per launch; this prints how
far each is from the copy bandwidth, and whether more programs per row (grid_min_waves, which sets
the split) or a longer step (LOOP_TILE) pays.

Each workload is compiled by streamfuse.compile (cuda_graphs off; the whole call is captured and
replayed here, so the time is the kernels' alone) and checked against eager before timing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _bn_backward(n: int, c: int, hw: int, relu: bool) -> tuple[Callable[..., tuple[torch.Tensor, ...]], tuple]:
    """The reduction of a batch norm's backward: sum(g) and sum(g * (x - mean)) per channel, the
    gradient first masked by the ReLU after the batch norm where `relu`."""

    def fn(g: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if relu:
            g = torch.where(y <= 0, 0.0, g)
        centred = x - mean[None, :, None, None]
        return g.sum((0, 2, 3)), (g * centred).sum((0, 2, 3))

    shape = (n, c, hw, hw)
    return fn, (shape, shape, (c,), shape)


def _loss_mean(elems: int) -> tuple[Callable[..., torch.Tensor], tuple]:
    """A projected loss over every element (GPT-2's logits at 8x128: 51 M values): one long row."""

    def fn(out: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
        return (out * direction).mean()

    return fn, ((elems,), (elems,))


WORKLOADS: dict[str, tuple[Callable[..., object], tuple]] = {
    "bn resnet50 b32 stem: 64 ch x 401k, relu": _bn_backward(32, 64, 112, True),
    "bn resnet50 b32 stage 1: 256 ch x 100k": _bn_backward(32, 256, 56, False),
    "bn resnet50 b32 stage 1: 64 ch x 100k, relu": _bn_backward(32, 64, 56, True),
    "bn resnet50 b32 stage 2: 512 ch x 25k": _bn_backward(32, 512, 28, False),
    "loss gpt2 8x128 logits: 1 x 51M": _loss_mean(8 * 128 * 50257),
}

VARIANTS: dict[str, dict[str, object]] = {
    "looped": {},
    "waves=4": {"grid_min_waves": 4},
    "waves=8": {"grid_min_waves": 8},
    "tile=4096": {"tile": 4096},
    "aten": {"long_row_reduction": False},
}
"""Launch settings of the looped template ("tile" patches fusion/geometry.LOOP_TILE), and ATen."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="words, comma-separated: keep workloads whose names hold one")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("long_rows.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from reduction_tiles import timed_cell

    import streamfuse
    from streamfuse.fusion import geometry

    words = [w for w in args.only.split(",") if w]
    workloads = {k: v for k, v in WORKLOADS.items() if not words or any(w in k for w in words)}
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, float32; µs per call (GB/s over inputs "
          f"read once and results written once); [BLOCK_R, warps, split] of each looped kernel")
    heads = [*VARIANTS, "inductor"]
    print(f"{'workload':44s}" + "".join(f"{h:>26s}" for h in heads))
    default_tile = geometry.LOOP_TILE
    for name, (fn, shapes) in workloads.items():
        inputs = tuple(torch.randn(s, device=device, generator=gen) for s in shapes)
        want = fn(*inputs)
        wants = want if isinstance(want, tuple) else (want,)
        nbytes = sum(t.numel() * t.element_size() for t in (*inputs, *wants))
        if "relu" not in name and len(inputs) == 4:
            nbytes -= inputs[3].numel() * inputs[3].element_size()  # y is not read without the mask
        cells = []

        def close(got: object, wants: tuple[torch.Tensor, ...] = wants) -> float:
            gots = got if isinstance(got, tuple) else (got,)
            return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(gots, wants, strict=True))

        for settings in VARIANTS.values():
            geometry.LOOP_TILE = int(settings.get("tile", default_tile))  # type: ignore[call-overload]
            fields = {k: v for k, v in settings.items() if k != "tile"}
            try:
                compiled = streamfuse.compile(fn, inputs, streamfuse.Config(cuda_graphs=False, **fields))
                tiles = [f"{s.constexprs['BLOCK_R']},{s.num_warps}w,{s.grid[1] if len(s.grid) > 1 else 1}"
                         for s in compiled.sources.values() if "BLOCK_R" in s.constexprs and s.constexprs["BLOCK_M"] == 1]
                cells.append(timed_cell(lambda c=compiled, x=inputs: c(*x), close(compiled(*inputs)), 1e-4, nbytes,
                                        args.reps, ";".join(tiles)))
            finally:
                geometry.LOOP_TILE = default_tile
        torch._dynamo.reset()
        ind = torch.compile(fn)
        cells.append(timed_cell(lambda c=ind, x=inputs: c(*x), close(ind(*inputs)), 1e-4, nbytes, args.reps))
        print(f"{name:44s}" + "".join(f"{c:>26s}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
