"""float32 products on tensor cores at float32's accuracy: Triton's input_precision="tf32x3" against cuBLAS.

With TF32 off (PyTorch's default for matmuls) a float32 product runs on the CUDA cores: cuBLAS's SIMT
kernels. "tf32x3" splits each operand into a TF32 high part and a TF32 remainder and sums three
tensor-core products (high*high + high*low + low*high); the dropped low*low term is ~2^-22 of the
product, below float32 accumulation's own error over K >= 256. This probe times, per shape of a
BERT-base / GPT-2 training step (1024 tokens), cuBLAS float32, cuBLAS TF32 (one pass, less accurate),
and a plain Triton GEMM with "ieee", "tf32x3" and "tf32", and reports each one's error against float64.
The plain GEMM (Triton's own autotuner over a few Hopper tiles) is a feasibility check of the
arithmetic, not streamfuse's template (codegen/matmul.py): what the template reaches inside a
training step, tuned by tune/autotune.py and checked against cuBLAS, is what
`scripts/gpu_check.sh s65-x3` measures (benchmarks/training.py --set float32_matmul=tf32x3).

    python benchmarks/tf32x3_probe.py [--json FILE]
"""
from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
    for bm, bn, bk, w, s in [(128, 128, 32, 8, 3), (128, 128, 32, 4, 3), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4),
                             (128, 256, 32, 8, 3), (64, 64, 32, 4, 4), (128, 128, 16, 8, 4)]
]


@triton.autotune(configs=CONFIGS, key=["M", "N", "K", "PREC"])
@triton.jit
def _mm(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn,
        PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * sam + kk[None, :] * sak, mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        b = tl.load(b_ptr + kk[:, None] * sbk + rn[None, :] * sbn, mask=(kk[:, None] < K) & (rn[None, :] < N),
                    other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    tl.store(c_ptr + rm[:, None] * scm + rn[None, :] * scn, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def triton_mm(a: torch.Tensor, b: torch.Tensor, prec: str) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty(m, n, device=a.device, dtype=torch.float32)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
    _mm[grid](a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
              PREC=prec)
    return c


def shapes() -> list[tuple[str, int, int, int, bool, bool]]:
    """(what, M, N, K, A transposed in memory, B transposed in memory) of a 1024-token training step."""
    t, h, f, v = 1024, 768, 3072, 50257
    return [
        ("qkv/out fwd", t, h, h, False, True), ("fc1 fwd", t, f, h, False, True), ("fc2 fwd", t, h, f, False, True),
        ("fc1 dX", t, h, f, False, False), ("fc2 dX", t, f, h, False, False),
        ("fc1 dW", f, h, t, True, False), ("fc2 dW", h, f, t, True, False), ("qkv dW", h, h, t, True, False),
        ("gpt2 head fwd", t, v, h, False, True), ("gpt2 head dX", t, h, v, False, False),
        ("gpt2 head dW", v, h, t, True, False),
    ]


def operand(rows: int, cols: int, transposed: bool, gen: torch.Generator) -> torch.Tensor:
    if transposed:
        return torch.randn(cols, rows, device="cuda", generator=gen).t()
    return torch.randn(rows, cols, device="cuda", generator=gen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{torch.cuda.get_device_name()}; µs per product (do_bench median), error = max|c - c64| / max|c64|")
    print(f"{'shape':16} {'M':>6} {'N':>6} {'K':>6} | {'cuBLAS f32':>17} {'cuBLAS tf32':>17} "
          f"{'triton ieee':>17} {'triton tf32x3':>17} {'triton tf32':>17} | x3 vs cuBLAS f32")
    for what, m, n, k, at, bt in shapes():
        a, b = operand(m, k, at, gen), operand(k, n, bt, gen)
        ref = (a.double() @ b.double())
        scale = ref.abs().max().item()
        cells = {}
        for name, prec, tf32 in [("cublas_f32", None, False), ("cublas_tf32", None, True), ("triton_ieee", "ieee", False),
                                 ("triton_tf32x3", "tf32x3", False), ("triton_tf32", "tf32", False)]:
            fn = functools.partial(torch.mm, a, b) if prec is None else functools.partial(triton_mm, a, b, prec)
            torch.backends.cuda.matmul.allow_tf32 = tf32
            out = fn()
            err = ((out.double() - ref).abs().max().item()) / scale
            us = triton.testing.do_bench(fn, warmup=25, rep=100) * 1000.0
            cells[name] = (us, err)
        torch.backends.cuda.matmul.allow_tf32 = False
        speed = cells["cublas_f32"][0] / cells["triton_tf32x3"][0]
        print(f"{what:16} {m:6} {n:6} {k:6} | " + " ".join(f"{us:8.1f} {err:8.1e}" for us, err in cells.values())
              + f" | {speed:.2f}x")
        rows.append({"shape": what, "m": m, "n": n, "k": k, **{f"{name}_us": us for name, (us, _) in cells.items()},
                     **{f"{name}_err": err for name, (_, err) in cells.items()}})
    total = {name: sum(r[f"{name}_us"] for r in rows) for name in cells}
    print("sum over shapes, µs: " + ", ".join(f"{name} {us:.0f}" for name, us in total.items()))
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
