"""Experiment (issue 3): can a Triton GEMM with the bias + exact-GELU epilogue fused come within 5% of
cuBLAS's GEMM alone at bf16 [M, 4096] x [4096, 4096] on the H200, with the Hopper tensor-memory
accelerator (TMA: tensor descriptors, bulk copies into shared memory) and a persistent grid?

Not wired into streamfuse: a stand-alone kernel to measure before building it into the template.
Run 22 (docs/PERF.md) measured it before the tile-origin helper was factored out of both kernels
(the interpreter check below covers that refactor; the GPU has not run it since).

    python benchmarks/tma_matmul.py [--sizes 512 4096]          (GPU)
    TRITON_INTERPRET=1 python benchmarks/tma_matmul.py --check   (CPU: correctness at a small size;
                                                                  the interpreter truncates bf16 casts,
                                                                  so errors reach 2 ulps there)

Prints, per M: cuBLAS F.linear (GEMM + bias), eager GEMM + GELU, and each TMA variant's GPU time from
CUDA-graph replay, its ratio to cuBLAS alone, and its max error against a float64 reference.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


@triton.jit
def _gelu_bias_tile(acc, bias_ptr, offs_n, N):
    bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    y = acc + bias[None, :]
    y = y.to(tl.bfloat16).to(tl.float32)  # the product + bias rounded as F.linear's result would be
    return 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))


@triton.jit
def _tile_origin(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The first row and column of output tile `tile`, tiles grouped GROUP_M down M (L2 reuse of B)."""
    n_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (tile // per_group) * GROUP_M
    rows = tl.minimum(n_m - first_m, GROUP_M)
    return (first_m + (tile % per_group) % rows) * BLOCK_M, ((tile % per_group) // rows) * BLOCK_N


@triton.jit
def tma_persistent(a_desc, b_desc, c_desc, bias_ptr, M, N, K,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr, WIDEN: tl.constexpr,
                   WS: tl.constexpr):
    """A fixed grid of NUM_PROGRAMS programs walks the output tiles (grouped GROUP_M down M for L2
    reuse of B panels); operands arrive by TMA; the epilogue runs on the fp32 accumulator and the
    tile leaves through a TMA store. WS: Triton's warp specialization of the tile loop (producer warps
    issue the TMA loads, consumer warps the tensor-core products)."""
    n_k = tl.cdiv(K, BLOCK_K)
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WS):
        om, on = _tile_origin(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(n_k):
            a = a_desc.load([om, kk * BLOCK_K])
            b = b_desc.load([on, kk * BLOCK_K])  # W is [N, K]: a [BLOCK_N, BLOCK_K] tile
            if WIDEN:  # Triton's interpreter multiplies bf16 tiles wrongly; fp32 products are exact
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b.T, acc)
        y = _gelu_bias_tile(acc, bias_ptr, on + tl.arange(0, BLOCK_N), N)
        c_desc.store([om, on], y.to(tl.bfloat16))


@triton.jit
def tma_tiled(a_desc, b_desc, c_desc, bias_ptr, M, N, K,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
              WIDEN: tl.constexpr, WS: tl.constexpr):
    """One output tile per program (no persistence), operands by TMA; WS: warp specialization of the K loop."""
    om, on = _tile_origin(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in tl.range(0, tl.cdiv(K, BLOCK_K), warp_specialize=WS):
        a = a_desc.load([om, kk * BLOCK_K])
        b = b_desc.load([on, kk * BLOCK_K])
        if WIDEN:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b.T, acc)
    y = _gelu_bias_tile(acc, bias_ptr, on + tl.arange(0, BLOCK_N), N)
    c_desc.store([om, on], y.to(tl.bfloat16))


# (name, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, persistent, flatten, warp-specialized)
VARIANTS = [
    ("persistent 128x256x64 w8 s3", 128, 256, 64, 8, 3, True, True, False),
    ("persistent 128x256x64 w8 s3 noflat", 128, 256, 64, 8, 3, True, False, False),
    ("persistent 128x128x64 w8 s4", 128, 128, 64, 8, 4, True, True, False),
    ("persistent 128x128x128 w8 s3", 128, 128, 128, 8, 3, True, True, False),
    ("tiled 128x256x64 w8 s3", 128, 256, 64, 8, 3, False, False, False),
    ("tiled 128x128x64 w4 s4", 128, 128, 64, 4, 4, False, False, False),
    # session 58: warp specialization (Triton 3.6 on Hopper), and deeper pipelines
    ("persistent 128x128x64 w8 s4 ws", 128, 128, 64, 8, 4, True, True, True),
    ("persistent 128x256x64 w8 s3 ws", 128, 256, 64, 8, 3, True, True, True),
    ("tiled 128x256x64 w8 s3 ws", 128, 256, 64, 8, 3, False, False, True),
    ("tiled 128x128x64 w8 s5 ws", 128, 128, 64, 8, 5, False, False, True),
    ("tiled 128x128x64 w8 s5", 128, 128, 64, 8, 5, False, False, False),
]


def launcher(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, out: torch.Tensor, variant: tuple,
             sm_count: int):
    _, bm, bn, bk, warps, stages, persistent, flatten, ws = variant
    m, k = x.shape
    n = w.shape[0]
    a_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(w, [bn, bk])
    c_desc = TensorDescriptor.from_tensor(out, [bm, bn])
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    widen = x.device.type != "cuda"
    if persistent:
        programs = min(sm_count, tiles)
        return lambda: tma_persistent[(programs,)](a_desc, b_desc, c_desc, bias, m, n, k, bm, bn, bk, 8, programs,
                                                   flatten, widen, ws, num_warps=warps, num_stages=stages)
    return lambda: tma_tiled[(tiles,)](a_desc, b_desc, c_desc, bias, m, n, k, bm, bn, bk, 8, widen, ws,
                                       num_warps=warps, num_stages=stages)


def streamfuse_row(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, ref: torch.Tensor, timing: Any) -> tuple:
    """streamfuse's own template with Config.matmul_tma (tuned tile), for comparison with the
    stand-alone kernels above; a failure is reported as a row, not raised."""
    import streamfuse

    def fn(t: torch.Tensor) -> torch.Tensor:
        return F.gelu(F.linear(t, w, bias))

    config = streamfuse.Config(matmul_strategy="triton", matmul_tma=True)
    try:
        sf = streamfuse.compile(fn, (x,), config)
        err = float((sf(x).double() - ref).abs().max())
        src = next(s for s in sf.sources.values() if s.fn_name.startswith("sf_mm"))
        c = src.constexprs
        name = (f"streamfuse matmul_tma {c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{src.num_warps} "
                f"s{src.num_stages} k{c['SPLIT_K']}")
        return name, timing(lambda: sf(x)), err
    except Exception as e:  # noqa: BLE001 - an experiment: report and go on
        print(f"  streamfuse matmul_tma failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return "streamfuse matmul_tma (failed)", float("nan"), float("nan")


def report(rows: list[tuple[str, float, float]], m: int, k: int, n: int) -> None:
    """Print the newest row (the first ones too, once), so a run cut short still reports."""
    if len(rows) <= 3:
        print(f"\nbf16 [{m}, {k}] x [{k}, {n}] + bias + GELU")
    base = rows[0][1]
    for name, us, err in rows if len(rows) <= 3 else rows[-1:]:
        print(f"  {name:38} {us:9.1f} µs  {us / base:5.3f}x cuBLAS alone  max err {err:.2e}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="*", default=[512, 4096])
    parser.add_argument("--check", action="store_true", help="small correctness check (CPU interpreter)")
    args = parser.parse_args()
    if args.check:
        device, sizes, n, k, sm_count = "cpu", [48], 64, 96, 4
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --check under TRITON_INTERPRET=1)")
            return 1
        device, sizes, n, k = "cuda", args.sizes, 4096, 4096
        sm_count = torch.cuda.get_device_properties(0).multi_processor_count
        print(f"card: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}")
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device=device, dtype=torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(device=device, dtype=torch.bfloat16)
    for m in sizes:
        x = torch.randn(m, k, generator=gen).to(device=device, dtype=torch.bfloat16)
        ref = F.gelu(F.linear(x.double(), w.double(), bias.double()))
        rows: list[tuple[str, float, float]] = []
        timing = None
        if not args.check:
            from streamfuse.profile.timing import time_graph_us

            timing = time_graph_us
            rows.append(("cuBLAS GEMM+bias alone", timing(lambda x=x: F.linear(x, w, bias)),
                         float((F.linear(x, w, bias).double() - F.linear(x.double(), w.double(), bias.double())).abs().max())))
            rows.append(("eager GEMM+GELU", timing(lambda x=x: F.gelu(F.linear(x, w, bias))),
                         float((F.gelu(F.linear(x, w, bias)).double() - ref).abs().max())))
        for variant in VARIANTS if not args.check else VARIANTS[:1] + VARIANTS[4:5]:
            out = torch.full((m, n), float("nan"), device=device, dtype=torch.bfloat16)
            try:
                if args.check:  # the interpreter: smaller blocks
                    variant = (variant[0], 16, 32, 32, 4, 2, variant[6], variant[7], False)
                run = launcher(x, w, bias, out, variant, sm_count)
                run()
                err = float((out.double() - ref).abs().max())
                us = timing(run) if timing else float("nan")
            except Exception as e:  # noqa: BLE001 - an experiment: report and go on
                print(f"  {variant[0]}: failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                continue
            rows.append((variant[0], us, err))
            report(rows, m, k, n)
        if not args.check:
            rows.append(streamfuse_row(x, w, bias, ref, timing))
            report(rows, m, k, n)
        print(f"\nbf16 [{m}, {k}] x [{k}, {n}] + bias + GELU: done")
    return 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1" and "--check" in sys.argv:
        print("--check needs TRITON_INTERPRET=1 set before the run")
        sys.exit(1)
    sys.exit(main())
