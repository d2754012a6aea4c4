"""What folding the weights' own computation (Config.fold_weights, ir/weight_fold.py) buys on a GPU:
streamfuse.compile with it and without it, timed in turns (CUDA events, calls back to back), beside
eager, on

  - suite text models under bfloat16 autocast (every Linear's float32 weight cast per call unfolded),
    at batch 1 and at the throughput batch;
  - the same models in float32 (position tables: T5's relative bias, Llama's rotary cos/sin,
    BERT's token-type and position embeddings);
  - a HiFi-GAN-style vocoder block (weight-normalised 1-D convolutions, batch 1).

    python benchmarks/weight_fold.py [--models bert-base,t5,gpt2 prefill] [--reps 3]

Prints µs per call (median of the rounds), fold / no-fold speed, launches per call, relative error
against eager, and the snapshot memory the fold keeps. GPU only."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import streamfuse
from streamfuse.bench.models import model_workloads
from streamfuse.bench.runner import rel_error
from streamfuse.profile.timing import time_cuda_us


class _ResBlock(nn.Module):
    def __init__(self, channels: int, kernel: int = 3, dilations: tuple[int, ...] = (1, 3, 5)) -> None:
        super().__init__()
        self.convs = nn.ModuleList(parametrizations.weight_norm(
            nn.Conv1d(channels, channels, kernel, dilation=d, padding=d * (kernel - 1) // 2)) for d in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = x + conv(F.leaky_relu(x, 0.1))
        return x


class Vocoder(nn.Module):
    """Two upsampling stages of a HiFi-GAN-like generator: every convolution weight-normalised."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = parametrizations.weight_norm(nn.Conv1d(80, 256, 7, padding=3))
        self.ups = nn.ModuleList(parametrizations.weight_norm(nn.ConvTranspose1d(c, c // 2, 16, 8, padding=4))
                                 for c in (256, 128))
        self.blocks = nn.ModuleList(_ResBlock(c // 2) for c in (256, 128))
        self.post = parametrizations.weight_norm(nn.Conv1d(64, 1, 7, padding=3))

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = self.pre(mel)
        for up, block in zip(self.ups, self.blocks, strict=True):
            x = block(up(F.leaky_relu(x, 0.1)))
        return torch.tanh(self.post(F.leaky_relu(x)))


def compare(name: str, fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...], reps: int,
            region: Callable[[], Any] = contextlib.nullcontext) -> None:
    with region(), torch.no_grad():
        ref = fn(*inputs)
        built = {"no fold": streamfuse.compile(fn, inputs, streamfuse.Config(fold_weights=False)),
                 "fold": streamfuse.compile(fn, inputs)}
        runs: dict[str, Callable[[], Any]] = {"eager": lambda: fn(*inputs)}
        for plan, compiled in built.items():
            err = rel_error(compiled(*inputs), ref, floor=0.0)
            notes = [n for n in compiled.graph.notes if "parameters and buffers alone" in n]
            print(f"  {plan}: {compiled.stats['kernels']} launches, rel err {err:.1e}"
                  + (f"; {notes[0]}" if notes else ""), flush=True)
            runs[plan] = lambda c=compiled: c(*inputs)
        times: dict[str, list[float]] = {p: [] for p in runs}
        for _ in range(reps):
            for plan, run in runs.items():
                times[plan].append(time_cuda_us(run))
    med = {p: statistics.median(t) for p, t in times.items()}
    print(f"== {name}: " + ", ".join(f"{p} {m:.1f} µs" for p, m in med.items())
          + f"; fold {med['no fold'] / med['fold']:.3f}x of no fold, {med['eager'] / med['fold']:.2f}x of eager",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bert-base,t5,gpt2 prefill")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: benchmarks/weight_fold.py needs a CUDA GPU")
    if args.reps < 1:
        raise SystemExit(f"error: --reps takes a positive number; got {args.reps}")
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)

    def autocast() -> Any:
        return torch.autocast("cuda", dtype=torch.bfloat16)

    for w in model_workloads(args.models, "all", "float32"):
        model, inputs = w.make(dev)
        compare(f"{w.name}, bf16 autocast", model, inputs, args.reps, autocast)
        compare(f"{w.name}, float32", model, inputs, args.reps)
        del model
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    vocoder = Vocoder().to(dev).eval()
    mel = torch.randn(1, 80, 64, device=dev)
    compare("vocoder block b1 (weight_norm), float32", vocoder, (mel,), args.reps)


if __name__ == "__main__":
    main()
