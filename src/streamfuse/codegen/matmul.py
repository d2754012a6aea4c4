"""The matmul template: C = A @ B (mm), or beta * bias + alpha * A @ B (addmm), with the group's
pointwise epilogue applied to the accumulator tile before the one store.

Each program owns a BLOCK_M x BLOCK_N tile of C; programs are grouped GROUP_M tiles down the M
axis so that neighbours share B panels in L2 (the ordering of Triton's matmul tutorial). The K
loop accumulates in float32 with `tl.dot`; fp32 operands use IEEE products unless torch allows
TF32, so results match cuBLAS's default numerics. The epilogue reads the product through
`Emitter.fixed` and every other operand (bias, residual) as a masked strided load at the tile's
index. The source does not depend on the tile sizes (they are constexpr parameters), so the
tuner compiles one source with several tiles.

Split-K (SPLIT_K > 1) is for skinny products (batch-size M, large K), whose few output tiles leave
most SMs idle and whose programs wait on one K step after another: SPLIT_K programs share a tile,
each summing its slice of K. Each writes its fp32 partial tile to a workspace and bumps the tile's
counter (a release atomic after a CTA barrier); the program that finds the counter at SPLIT_K - 1
is last, sums the partials in split order (so results do not depend on which program finishes
last), applies the epilogue, stores, and resets the counter for the next launch. No second kernel
and no atomics on data: deterministic, and safe to replay in a CUDA graph (the workspace and
counters belong to the launch site: runtime/steps.py allocates them once per kernel step).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from streamfuse.codegen.kernel import INT32_LIMIT, Emitter, KernelSource, needs_int64, store_cast, store_strides
from streamfuse.codegen.pointwise_ops import Operand
from streamfuse.codegen.types import TL_DTYPE
from streamfuse.config import Config
from streamfuse.fusion.geometry import fill_split
from streamfuse.fusion.groups import Group
from streamfuse.fusion.legality import matmul_dims, matmul_operands, tile_core
from streamfuse.ir.graph import Node
from streamfuse.ir.indexing import ZERO, Expr, Index, broadcast_index, delinearize

TILE_PARAMS = ["BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr", "BLOCK_K: tl.constexpr",
               "GROUP_M: tl.constexpr", "SPLIT_K: tl.constexpr", "EVEN_K: tl.constexpr"]
SCRATCH_PARAMS = ["ws_ptr", "lock_ptr"]


@dataclass(frozen=True)
class MatmulTile:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    split_k: int = 1

    def shared_bytes(self, itemsize: int) -> int:
        """Shared memory for the pipelined operand tiles: one A and one B tile per stage."""
        return self.num_stages * (self.block_m * self.block_k + self.block_k * self.block_n) * itemsize

    def __str__(self) -> str:
        split = f" k{self.split_k}" if self.split_k > 1 else ""
        return (f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages} "
                f"g{self.group_m}{split}")


def generate_matmul(group: Group, target: str, tma: bool = False, pdl: bool = False,
                    constants: frozenset[Node] = frozenset(), float32: str = "ieee") -> KernelSource:
    """`tma`: load A and B through tensor descriptors (Config.matmul_tma) where `tma_layout` allows.
    `float32`: tl.dot's input precision for float32 operands while TF32 is off (Config.float32_matmul).
    `pdl`: programmatic dependent launch (codegen/kernel.generate); a matrix-vector product whose B
    is in `constants` reads its first B tile, and a constant bias, before the grid-dependency wait."""
    mm = group.contraction
    assert mm is not None and mm.dtype is not None
    a, b = matmul_operands(mm)
    _, m, n, k = matmul_dims(mm)
    batched = len(a.shape) == 3
    em = Emitter(group, target, masks={frozenset({"rm"}): "mmask", frozenset({"rn"}): "nmask",
                                       frozenset({"rm", "rn"}): "mask"}, pdl=pdl)
    em.waits = prefetch = pdl and m == 1 and b in constants
    wide = needs_int64(group, m * n) or max(a.numel, b.numel) > INT32_LIMIT
    *sa_batch, sa0, sa1 = _strides(em, a)
    *sb_batch, sb0, sb1 = _strides(em, b)
    pa, pb = f"in{em.input_slot[a]}_ptr", f"in{em.input_slot[b]}_ptr"
    if batched:  # one batch per range of programs; each operand's batch offset moves its base pointer
        pa, pb = f"({pa} + pid_b * {sa_batch[0]})", f"({pb} + pid_b * {sb_batch[0]})"
    precision = "" if mm.dtype != torch.float32 else (
        ', input_precision="tf32"' if torch.backends.cuda.matmul.allow_tf32 else f', input_precision="{float32}"')
    # Triton's CPU interpreter multiplies bf16 tiles wrongly (numpy has no bf16): widen them there;
    # the products are exact in fp32, so the result is the same
    operands = "a.to(tl.float32), b.to(tl.float32)" if target != "cuda" and mm.dtype == torch.bfloat16 else "a, b"
    layout = tma_layout(mm) if tma and not wide else None
    em.lines += [
        "tile = tl.program_id(0) // SPLIT_K",  # the SPLIT_K programs of one tile are neighbours
        "pid_k = tl.program_id(0) % SPLIT_K",
        "pid = tile",
        f"n_pid_m = tl.cdiv({m}, BLOCK_M)",
        f"n_pid_n = tl.cdiv({n}, BLOCK_N)",
        *([f"pid_b = (pid // (n_pid_m * n_pid_n)){'.to(tl.int64)' if wide else ''}",
           "pid = pid % (n_pid_m * n_pid_n)"] if batched else []),
        "per_group = GROUP_M * n_pid_n",
        "first_m = (pid // per_group) * GROUP_M",
        "group_rows = tl.minimum(n_pid_m - first_m, GROUP_M)",
        "pid_m = first_m + (pid % per_group) % group_rows",
        "pid_n = (pid % per_group) // group_rows",
        "offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)" + (".to(tl.int64)" if wide else ""),
        "offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)" + (".to(tl.int64)" if wide else ""),
        # this program's K slice: k_steps consecutive BLOCK_K steps
        f"k_steps = tl.cdiv(tl.cdiv({k}, BLOCK_K), SPLIT_K)",
        "k_first = pid_k * k_steps * BLOCK_K",
        "offs_k = tl.arange(0, BLOCK_K)",
    ]
    tile_lines = [
        f"rm = {f'pid_b * {m} + ' if batched else ''}offs_m[:, None]",  # row of the [batch * M, N] product
        "rn = offs_n[None, :]",
        f"mmask = offs_m[:, None] < {m}",
        f"nmask = rn < {n}",
        "mask = mmask & nmask",
    ]
    tile_index = (Expr.var("rm"), Expr.var("rn"))
    if prefetch:  # the tile's coordinates and its constant bias, read before the wait with the weights
        em.lines += tile_lines
        bias = mm.args[0] if mm.op == "aten.addmm.default" else None
        if isinstance(bias, Node) and bias in constants:
            em.value(bias, broadcast_index(tile_index, bias.shape, mm.shape))  # cached for _product
    em.lines += [
        # rows and columns past the edge wrap around (their results are masked at the store),
        # so the K loop's loads need no row/column masks
        *(_gemv_loop(pa, pb, sa1, sb0, sb1, n, k, prefetch) if m == 1 else
          _tma_loop(pa, pb, sa0, sb0, sb1, m, n, k, layout, operands) if layout else
          _dot_loop(pa, pb, sa0, sa1, sb0, sb1, m, n, k, operands, precision)),
        "last = True",
        "if SPLIT_K > 1:",
        "    offs_t = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]",
        "    ws_tile = ws_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N) + offs_t",
        "    tl.store(ws_tile + pid_k * (BLOCK_M * BLOCK_N), acc)",
        "    tl.debug_barrier()",  # every thread's partial is written before the release below
        '    last = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1',
        "if last:",
    ]
    body_start = len(em.lines)
    em.lines += [
        "if SPLIT_K > 1:",
        "    acc = tl.load(ws_tile, cache_modifier=\".cg\")",
        "    for s in tl.static_range(1, SPLIT_K):",
        "        acc += tl.load(ws_tile + s * (BLOCK_M * BLOCK_N), cache_modifier=\".cg\")",
        "    tl.atomic_xchg(lock_ptr + tile, 0)",  # ready for the next launch
        *([] if prefetch else tile_lines),
    ]
    em.fixed[mm] = _product(em, mm, tile_index)
    layouts = [_store_layout(out, batched) for out in group.outputs]
    for j, (out, strides) in enumerate(zip(group.outputs, layouts, strict=True)):
        v = em.value(out, _index_in(em, out.shape, n, tile_index))
        offset = f"rm * {n} + rn" if strides is None else f"rm * {strides[0]} + rn * {strides[1]}"
        em.store(f"out{j}_ptr + {offset}", store_cast(v, out), "mask")
    em.lines[body_start:] = [f"    {line}" for line in em.lines[body_start:]]  # under `if last:`
    em.scratch_params = SCRATCH_PARAMS
    source = em.finish("mm", TILE_PARAMS, grid=(1,), num_warps=4, constexprs={})
    source.descriptors = layout is not None
    source.output_strides = layouts
    return source


def _store_layout(out: Node, batched: bool) -> tuple[int, ...] | None:
    """The strides the template stores output `out` with: the traced layout of a two-dimensional
    output (store_strides), row-major otherwise (None)."""
    strides = store_strides(out)
    return strides if strides is not None and not batched and len(out.shape) == 2 else None


def tma_layout(mm: Node) -> str | None:
    """How B lies for tensor-descriptor loads, or None where they do not apply. Descriptors need
    16-bit operands here (the measured case, PERF.md run 22), two dims, a unit inner stride and
    16-byte-aligned outer strides; B is "nk" (K contiguous: a Linear weight read transposed) or "kn"."""
    a, b = matmul_operands(mm)
    if mm.dtype not in (torch.float16, torch.bfloat16) or len(a.shape) != 2 or a.shape[0] == 1:
        return None
    def aligned(stride: int) -> bool:
        return stride * a.itemsize % 16 == 0

    if a.strides[1] != 1 or not aligned(a.strides[0]):
        return None
    if b.strides[0] == 1 and aligned(b.strides[1]):
        return "nk"
    if b.strides[1] == 1 and aligned(b.strides[0]):
        return "kn"
    return None


def _dot_loop(pa: str, pb: str, sa0: str, sa1: str, sb0: str, sb1: str, m: int, n: int, k: int,
              operands: str, precision: str) -> list[str]:
    """The K loop on the tensor cores: one [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tl.dot per step."""
    return [
        f"a_ptrs = {pa} + (offs_m % {m})[:, None] * {sa0} + (k_first + offs_k)[None, :] * {sa1}",
        *_k_loop(pb, sa1, sb0, sb1, n, k, "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
                 "offs_k[None, :]", f"acc = tl.dot({operands}, acc{precision})"),
    ]


def _tma_loop(pa: str, pb: str, sa0: str, sb0: str, sb1: str, m: int, n: int, k: int, layout: str,
              operands: str) -> list[str]:
    """The K loop with A and B tiles brought in by the tensor-memory accelerator (device-side tensor
    descriptors): no per-element pointer tiles in registers (which made 128x256 tiles spill), and
    out-of-range rows, columns and K are zero-filled by the hardware."""
    b_desc = (f"tl.make_tensor_descriptor({pb}, shape=[{n}, {k}], strides=[{sb1}, 1], block_shape=[BLOCK_N, BLOCK_K])"
              if layout == "nk" else
              f"tl.make_tensor_descriptor({pb}, shape=[{k}, {n}], strides=[{sb0}, 1], block_shape=[BLOCK_K, BLOCK_N])")
    b_load = ("b = b_desc.load([pid_n * BLOCK_N, k_at]).T" if layout == "nk" else
              "b = b_desc.load([k_at, pid_n * BLOCK_N])")
    return [
        f"a_desc = tl.make_tensor_descriptor({pa}, shape=[{m}, {k}], strides=[{sa0}, 1], block_shape=[BLOCK_M, BLOCK_K])",
        f"b_desc = {b_desc}",
        "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
        "for kk in range(0, k_steps):",
        "    k_at = k_first + kk * BLOCK_K",
        "    a = a_desc.load([pid_m * BLOCK_M, k_at])",
        f"    {b_load}",
        f"    acc = tl.dot({operands}, acc)",
    ]


def _gemv_loop(pa: str, pb: str, sa1: str, sb0: str, sb1: str, n: int, k: int, prefetch: bool) -> list[str]:
    """The K loop of a one-row product (batch-1 inference): a matrix-vector product on the CUDA
    cores, bandwidth-bound on B. tl.dot would pad the row to 16 (wasting 15/16 of the tensor-core
    work) and, for float32, fall back to a slow FMA path; here each step multiplies the row slice
    into the B tile in float32 and sums down K, exact products in every dtype. BLOCK_M is 1.

    `prefetch` (programmatic dependent launch, B a constant such as a Linear weight): the first B
    tile is loaded before the grid-dependency wait, so the weight read, the bulk of a matrix-vector
    product's time, overlaps the previous kernel; only the row (its output) is read after the wait."""
    init = "acc_n = tl.zeros((BLOCK_N,), dtype=tl.float32)"
    step = "acc_n += tl.sum(a.to(tl.float32)[:, None] * b.to(tl.float32), axis=0)"
    b_ptrs = f"b_ptrs = {pb} + (k_first + offs_k)[:, None] * {sb0} + (offs_n % {n})[None, :] * {sb1}"
    a_ptrs = f"a_ptrs = {pa} + (k_first + offs_k) * {sa1}"
    if not prefetch:
        return [a_ptrs, *_k_loop(pb, sa1, sb0, sb1, n, k, init, "offs_k", step), "acc = acc_n[None, :]"]
    return [
        a_ptrs, b_ptrs, init,
        "if EVEN_K:",
        "    b = tl.load(b_ptrs)",
        "else:",
        f"    b = tl.load(b_ptrs, mask=offs_k[:, None] < {k} - k_first, other=0.0)",
        "gdc_wait()",
        "if EVEN_K:",
        "    a = tl.load(a_ptrs)",
        "else:",
        f"    a = tl.load(a_ptrs, mask=offs_k < {k} - k_first, other=0.0)",
        step,
        *_k_steps(sa1, sb0, k, "offs_k", step, first=1),
        "acc = acc_n[None, :]",
    ]


def _k_loop(pb: str, sa1: str, sb0: str, sb1: str, n: int, k: int, init: str, a_k: str, step: str) -> list[str]:
    """This program's K slice, one BLOCK_K step at a time: load the A slice (`a_ptrs`, its K offsets
    laid out as `a_k`) and the B tile, masked only where K does not divide evenly; then `step`."""
    return [
        f"b_ptrs = {pb} + (k_first + offs_k)[:, None] * {sb0} + (offs_n % {n})[None, :] * {sb1}",
        init,
        *_k_steps(sa1, sb0, k, a_k, step, first=0),
    ]


def _k_steps(sa1: str, sb0: str, k: int, a_k: str, step: str, first: int) -> list[str]:
    """Steps `first`.. of the K slice (the loop itself; `a_ptrs` and `b_ptrs` point at step `first`)."""
    advance = [f"a_ptrs += BLOCK_K * {sa1}", f"b_ptrs += BLOCK_K * {sb0}"]
    return [
        *advance[: 2 * first],  # after a peeled first step
        f"for kk in range({first}, k_steps):",
        "    if EVEN_K:",
        "        a = tl.load(a_ptrs)",
        "        b = tl.load(b_ptrs)",
        "    else:",
        f"        k_left = {k} - k_first - kk * BLOCK_K",
        f"        a = tl.load(a_ptrs, mask={a_k} < k_left, other=0.0)",
        "        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)",
        f"    {step}",
        *(f"    {line}" for line in advance),
    ]


def _strides(em: Emitter, operand: Node) -> tuple[str, ...]:
    """Stride parameter names of an operand, one per dim ("0" for a dim of size 1, which has none)."""
    slot = em.input_slot[operand]
    return tuple(f"in{slot}_s{d}" if size != 1 else "0" for d, size in enumerate(operand.shape))


def _product(em: Emitter, mm: Node, tile_index: Index) -> Operand:
    """The contraction's value on the tile, rounded to its dtype as cuBLAS's result would be."""
    assert mm.dtype is not None
    value = "acc"
    if mm.op == "aten.addmm.default":
        bias = mm.args[0]
        assert isinstance(bias, Node)
        alpha, beta = mm.kwargs.get("alpha", 1), mm.kwargs.get("beta", 1)
        scaled = value if alpha == 1 else f"acc * {float(alpha)!r}"
        b = em.value(bias, broadcast_index(tile_index, bias.shape, mm.shape))
        b_text = b.text if b.dtype == torch.float32 else f"{b.text}.to(tl.float32)"
        value = f"{scaled} + {b_text}" if beta == 1 else f"{scaled} + {float(beta)!r} * {b_text}"
    if mm.dtype != torch.float32:
        value = f"({value}).to({TL_DTYPE[mm.dtype]}).to(tl.float32)"
    return em.tmp(value, torch.float32)


def _index_in(em: Emitter, shape: tuple[int, ...], n: int, tile_index: Index) -> Index:
    """The tile's index in a reshape of it that keeps the last dim ([B, T, N] for an [M, N] tile;
    tile rows count through the batches of a bmm), with the trailing dims of size one that
    legality.tile_core strips (a product viewed back to [N, S, 1, 1]) at index 0, so that N's dim
    gets the tile's column."""
    core = tile_core(shape, n)
    zeros = (ZERO,) * (len(shape) - len(core))
    if len(core) == 2:
        return (*tile_index, *zeros)
    rows = em.hoist(delinearize(tile_index[0], core[:-1]), "xm")
    return (*rows, tile_index[1], *zeros)


def with_tile(source: KernelSource, group: Group, tile: MatmulTile) -> KernelSource:
    """The source with `tile`'s launch configuration (grid, warps, stages, constexprs, scratch)."""
    assert group.contraction is not None
    k = matmul_dims(group.contraction)[3]
    constexprs = {"BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k,
                  "GROUP_M": tile.group_m, "SPLIT_K": tile.split_k,
                  "EVEN_K": int(k % (tile.block_k * tile.split_k) == 0)}
    tiles = tile_grid(group, tile) // tile.split_k
    scratch = [(0, torch.float32), (0, torch.int32)]
    if tile.split_k > 1:
        scratch = [(tiles * tile.split_k * tile.block_m * tile.block_n, torch.float32), (tiles, torch.int32)]
    return dataclasses.replace(source, grid=(tile_grid(group, tile),), num_warps=tile.num_warps,
                               num_stages=tile.num_stages, constexprs=constexprs, scratch=scratch)


def heuristic_tile(group: Group, config: Config, sm_count: int = 132) -> MatmulTile:
    """A reasonable tile without tuning: narrow M tiles for skinny products, large ones otherwise;
    split-K where the output tiles alone would leave SMs idle."""
    assert group.contraction is not None
    batch, m, n, k = matmul_dims(group.contraction)
    itemsize = group.contraction.itemsize
    bk = 128 if itemsize <= 2 else 64
    if m == 1:
        tile = MatmulTile(1, 64, 128 if itemsize <= 2 else 64, 4, 3)
    elif m <= 32:
        tile = MatmulTile(16 if m <= 16 else 32, 64, bk, 4, 4)
    elif m <= 256:
        # 8 warps: with 4, a 64x128 float32 accumulator spilled 20 registers under split-K (run 99)
        tile = MatmulTile(64, 128, bk // 2, 8, 4)
    else:
        tile = MatmulTile(128, 128, bk // 2, 8, 3)
    tile = clamp_tile(tile, m, n, k)
    split = _fill(tile, batch, m, n, k, sm_count, config)
    return clamp_tile(dataclasses.replace(tile, split_k=split), m, n, k)


def _fill(tile: MatmulTile, batch: int, m: int, n: int, k: int, sm_count: int, config: Config) -> int:
    return fill_split(batch * math.ceil(m / tile.block_m) * math.ceil(n / tile.block_n),
                      math.ceil(k / tile.block_k), sm_count, config.matmul_max_split_k)


def clamp_tile(tile: MatmulTile, m: int, n: int, k: int) -> MatmulTile:
    """Blocks no larger than the (power-of-two rounded) problem; at least 16 (tl.dot's minimum),
    except the one row of a matrix-vector product (which has no tl.dot)."""
    def fit(block: int, extent: int) -> int:
        return max(16, min(block, 1 << max(0, (extent - 1).bit_length())))

    if m == 1:
        tile = dataclasses.replace(tile, block_m=1, group_m=1)
    block_k = fit(tile.block_k, k)
    # buffering more tiles than a program's K slice has steps only costs shared memory
    stages = max(1, min(tile.num_stages, math.ceil(math.ceil(k / block_k) / tile.split_k)))
    return dataclasses.replace(tile, block_m=1 if m == 1 else fit(tile.block_m, m), block_n=fit(tile.block_n, n),
                               block_k=block_k, num_stages=stages)


SMALL_M = 256
"""Products with at most this many rows (batch x M) tune without the 128x128-class tiles."""
SKINNY_M = 64
"""Products with more rows than this tune without the skinny tiles (at most 32 x 32)."""


def candidate_tiles(group: Group, config: Config, sm_count: int = 132) -> list[MatmulTile]:
    """The tuner's search space for this product: well-known Hopper/Ampere configurations, clamped to
    the problem, deduplicated, within the shared-memory cap; tiles too few to fill the GPU also
    come with split-K (the split that fills it, and half that)."""
    assert group.contraction is not None
    batch, m, n, k = matmul_dims(group.contraction)
    itemsize = group.contraction.itemsize
    scale = 2 if itemsize <= 2 else 1  # twice the K depth for 16-bit operands
    # the tiles that won or came within 5% on the H200 (run 93: 21 bfloat16 products of convnext_tiny,
    # vit_b_16 and bert-base at both batches; earlier runs' Linear and MLP products): 12 of the 19
    # this list held, each candidate being a Triton compile of the first compile's time
    raw = [
        MatmulTile(128, 128, 32 * scale, 8, 3), MatmulTile(128, 128, 64 * scale, 8, 3),
        MatmulTile(64, 256, 32 * scale, 8, 3), MatmulTile(128, 64, 32 * scale, 4, 4),
        MatmulTile(64, 128, 32 * scale, 4, 4), MatmulTile(64, 64, 32 * scale, 4, 4),
        MatmulTile(32, 64, 64 * scale, 4, 4), MatmulTile(16, 64, 64 * scale, 4, 4),
        MatmulTile(32, 32, 128 * scale, 4, 4), MatmulTile(16, 64, 128 * scale, 4, 5),
        # skinny products are bandwidth-bound on B: narrow N tiles give enough programs to fill the GPU
        MatmulTile(16, 16, 128 * scale, 4, 4), MatmulTile(16, 32, 256 * scale, 4, 3),
    ]
    if batch * m <= SMALL_M:
        # run 93's timings: at M <= 256 (197 tokens, 128-token sequences) no 128x128 or 64x256 tile came
        # within 11% of the best (64x64 won 8 of 10 such products), so they are not compiled
        raw = [t for t in raw if t.block_m * t.block_n < 128 * 128]
    if batch * m > SKINNY_M:
        # the skinny tiles are for a few rows: over 21 bfloat16 products of 128 to 100,352 rows (run 93,
        # docs/bench/tiles-autotune.json) none won, and the closest came 6% behind the best
        raw = [t for t in raw if t.block_m > 32 or t.block_n > 32]
    if m == 1:  # the matrix-vector loop: a [BLOCK_K, BLOCK_N] tile of B in registers per step
        raw = [MatmulTile(1, bn, bk * scale, w, st) for bn, bk, w, st in (
            (16, 256, 4, 3), (32, 128, 4, 3), (32, 256, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2),
            (64, 128, 8, 3), (128, 32, 4, 3), (128, 64, 8, 2), (256, 32, 8, 2))]
    seen: dict[MatmulTile, None] = {}
    for t in raw:
        c = clamp_tile(t, m, n, k)
        split = _fill(c, batch, m, n, k, sm_count, config)
        for s in sorted({1, max(1, split // 2), split}):
            tile = clamp_tile(dataclasses.replace(c, split_k=s), m, n, k)
            if tile.shared_bytes(itemsize) <= config.matmul_max_shared_bytes:
                seen.setdefault(tile, None)
    return list(seen) or [heuristic_tile(group, config, sm_count)]


def tile_grid(group: Group, tile: MatmulTile) -> int:
    """Programs launched: SPLIT_K per output tile."""
    assert group.contraction is not None
    batch, m, n, _ = matmul_dims(group.contraction)
    return batch * math.ceil(m / tile.block_m) * math.ceil(n / tile.block_n) * tile.split_k
