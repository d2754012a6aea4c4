"""Hand-written Triton variants of the foundation kernels, timed as pure GPU time (CUDA-graph
replay), to choose what the code generator should emit. Kept as the record of that choice
(docs/PERF.md). Run on a GPU: python benchmarks/variants.py"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from streamfuse.profile.timing import time_graph_us  # noqa: E402


@triton.jit
def chain(x_ptr, o_ptr, N, BLOCK: tl.constexpr, MASK: tl.constexpr, HINT: tl.constexpr, COPY: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if MASK:
        if HINT:
            x = tl.load(x_ptr + offs, mask=offs < N, other=0, eviction_policy="evict_first")
        else:
            x = tl.load(x_ptr + offs, mask=offs < N, other=0)
    else:
        if HINT:
            x = tl.load(x_ptr + offs, eviction_policy="evict_first")
        else:
            x = tl.load(x_ptr + offs)
    if COPY:
        y = x
    else:
        y = tl.exp(tl.where(tl.sigmoid(x * 1.5 + 0.25) * x - 0.1 < 0, 0, tl.sigmoid(x * 1.5 + 0.25) * x - 0.1)) / 3.0
    if MASK:
        if HINT:
            tl.store(o_ptr + offs, y, mask=offs < N, cache_modifier=".cs")
        else:
            tl.store(o_ptr + offs, y, mask=offs < N)
    else:
        if HINT:
            tl.store(o_ptr + offs, y, cache_modifier=".cs")
        else:
            tl.store(o_ptr + offs, y)


@triton.jit
def chain_persistent(x_ptr, o_ptr, N, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    for start in range(pid * BLOCK, N, step):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs)
        y = tl.sigmoid(x * 1.5 + 0.25) * x - 0.1
        y = tl.exp(tl.where(y < 0, 0, y)) / 3.0
        tl.store(o_ptr + offs, y)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def softmax_k(x_ptr, o_ptr, M, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
              MASK: tl.constexpr, NANRED: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tl.arange(0, BLOCK_R)[None, :]
    if MASK:
        mask = (rows < M) & (cols < R)
        x = tl.load(x_ptr + rows * R + cols, mask=mask, other=0)
        xm = tl.where(mask, x, float("-inf"))
    else:
        x = tl.load(x_ptr + rows * R + cols)
        xm = x
    if NANRED:
        m = tl.reduce(xm, 1, _max_nan)[:, None]
    else:
        m = tl.max(xm, axis=1)[:, None]
    e = tl.exp(x - m)
    if MASK:
        e = tl.where(mask, e, 0.0)
    s = tl.sum(e, axis=1)[:, None]
    if MASK:
        tl.store(o_ptr + rows * R + cols, e / s, mask=mask)
    else:
        tl.store(o_ptr + rows * R + cols, e / s)


@triton.jit
def softmax_persistent(x_ptr, o_ptr, M, R: tl.constexpr, BLOCK_R: tl.constexpr, STAGES: tl.constexpr):
    cols = tl.arange(0, BLOCK_R)
    for row in tl.range(tl.program_id(0), M, tl.num_programs(0), num_stages=STAGES):
        x = tl.load(x_ptr + row * R + cols)
        m = tl.max(x, axis=0)
        e = tl.exp(x - m)
        s = tl.sum(e, axis=0)
        tl.store(o_ptr + row * R + cols, e / s)


def main() -> int:
    torch.manual_seed(0)
    n = 64 * 2**20
    xs = [torch.randn(n, device="cuda") for _ in range(3)]
    o = torch.empty_like(xs[0])
    state = {"i": 0}

    def nxt() -> torch.Tensor:
        state["i"] = (state["i"] + 1) % 3
        return xs[state["i"]]

    copy_t = time_graph_us(lambda: o.copy_(nxt()))
    bw = 2 * 4 * n / (copy_t * 1e-6)
    print(f"torch copy_ 64M fp32: {copy_t:.1f} us = {bw / 1e12:.2f} TB/s (the ceiling below)")
    rows = []
    for copy in (True, False):
        for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 16)):
            for mask in (True, False):
                for hint in (False, True):
                    t = time_graph_us(lambda: chain[(n // block,)](nxt(), o, n, BLOCK=block, MASK=mask, HINT=hint,
                                                                  COPY=copy, num_warps=warps))
                    rows.append((f"{'copy ' if copy else 'chain'} block={block} w={warps} mask={mask} hint={hint}", t))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for waves in (4, 8, 16):
        for block, warps in ((1024, 4), (2048, 8), (4096, 8)):
            t = time_graph_us(lambda: chain_persistent[(sms * waves,)](nxt(), o, n, BLOCK=block, num_warps=warps))
            rows.append((f"chain persistent grid={sms}x{waves} block={block} w={warps}", t))
    for label, t in rows:
        print(f"{label:60} {t:8.1f} us {2 * 4 * n / (t * 1e-6) / bw * 100:6.1f}% of copy")

    m, r = 4096, 4096
    xs2 = [torch.randn(m, r, device="cuda") for _ in range(3)]
    o2 = torch.empty_like(xs2[0])

    def nxt2() -> torch.Tensor:
        state["i"] = (state["i"] + 1) % 3
        return xs2[state["i"]]

    ref = torch.softmax(xs2[0], -1)
    rows = [("torch.softmax", time_graph_us(lambda: torch.softmax(nxt2(), -1)))]
    for bm, warps in ((1, 4), (1, 8), (1, 16), (2, 8), (2, 16), (4, 16)):
        for mask in (True, False):
            for nanred in (False, True):
                softmax_k[(m // bm,)](xs2[0], o2, m, R=r, BLOCK_M=bm, BLOCK_R=r, MASK=mask, NANRED=nanred,
                                      num_warps=warps)
                torch.testing.assert_close(o2, ref)
                t = time_graph_us(lambda: softmax_k[(m // bm,)](nxt2(), o2, m, R=r, BLOCK_M=bm, BLOCK_R=r,
                                                                  MASK=mask, NANRED=nanred, num_warps=warps))
                rows.append((f"softmax bm={bm} w={warps} mask={mask} nan-reduce={nanred}", t))
    for waves in (2, 4, 8):
        for warps in (4, 8, 16):
            for stages in (1, 2, 3):
                grid = (sms * waves,)
                softmax_persistent[grid](xs2[0], o2, m, R=r, BLOCK_R=r, STAGES=stages, num_warps=warps)
                torch.testing.assert_close(o2, ref)
                t = time_graph_us(lambda: softmax_persistent[grid](nxt2(), o2, m, R=r, BLOCK_R=r, STAGES=stages,
                                                                   num_warps=warps))
                rows.append((f"softmax persistent grid={sms}x{waves} w={warps} stages={stages}", t))
    for label, t in rows:
        print(f"{label:60} {t:8.1f} us {2 * 4 * m * r / (t * 1e-6) / bw * 100:6.1f}% of copy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
