"""The reduction templates (codegen/kernel.py's Emitter computes the values):

- persistent: each program holds BLOCK_M whole rows in registers (rows up to
  Config.max_persistent_reduction), the reductions computed by one tree reduction per row tile;
- looped (Group.rows_contiguous): the rows lie next to each other in memory (a mean over H and W
  of a channels_last tensor, a column sum), so the threads run along BLOCK_M adjacent rows and each
  program walks its rows' columns BLOCK_R at a time, accumulating elementwise;
- looped over long rows (longer than Config.max_persistent_reduction, e.g. a batch-norm
  backward's sums over N, H and W): the same template with one row per program and the threads
  along the row (fusion/geometry.looped_launch).
"""

from __future__ import annotations

import math

import torch

from streamfuse.codegen.kernel import Emitter, KernelSource, needs_int64, store_cast, store_offset, store_strides
from streamfuse.codegen.types import TL_DTYPE, compute_dtype
from streamfuse.config import Config
from streamfuse.fusion.geometry import long_rows, loopable, looped_launch, looped_split, reduction_launch
from streamfuse.fusion.groups import Group, ReductionDomain
from streamfuse.ir.graph import Node
from streamfuse.ir.indexing import ZERO, Expr, Index, delinearize
from streamfuse.ir.ops import OpKind, packet_name


def generate_reduction(group: Group, dom: ReductionDomain, config: Config, target: str,
                        sm_count: int, pdl: bool) -> KernelSource:
    if (group.rows_contiguous or long_rows(dom, config)) and loopable(group):
        return _generate_looped_reduction(group, dom, config, target, sm_count, pdl)
    # legality refuses a kernel over long rows that cannot loop in one pass (fusion/legality.check_group)
    assert not long_rows(dom, config), f"rows of {dom.row_size} elements need the looped template"
    m, r = dom.rows, dom.row_size
    block_m, block_r, num_warps = reduction_launch(dom, config, sm_count, group.split)
    pid = "tl.program_id(0).to(tl.int64)" if needs_int64(group, m * r) else "tl.program_id(0)"
    em = Emitter(group, target, masks={frozenset({"rows"}): "rmask", frozenset({"cols"}): "cmask",
                                        frozenset({"rows", "cols"}): "mask"}, pdl=pdl)
    em.lines += [f"rows = {pid} * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]", "cols = tl.arange(0, BLOCK_R)[None, :]"]
    full_rows, full_cols = m % block_m == 0, r == block_r
    em.lines += [] if full_rows else [f"rmask = rows < {m}"]
    em.lines += _column_masks(full_rows, full_cols, r)
    _static_masks(em, full_rows, full_cols)
    outer = list(em.hoist(delinearize(Expr.var("rows"), dom.outer_shape), "xo"))
    inner = list(em.hoist(delinearize(Expr.var("cols"), dom.reduce_shape), "xr"))
    full = tuple(inner.pop(0) if d in dom.dims else outer.pop(0) for d in range(len(dom.shape)))
    em.full_index, em.domain = full, dom
    for j, out in enumerate(group.outputs):
        if out.shape == dom.shape:
            v = em.value(out, full)
            offset, deps = store_offset(full, out).text, frozenset({"rows", "cols"})
        else:
            row = _row_index(full, dom, out.shape)
            v = em.value(out, row)
            offset = "rows" if store_strides(out) is None else store_offset(row, out).text
            deps = frozenset({"rows"})
        em.store(f"out{j}_ptr + {offset}", store_cast(v, out), em.mask_for(deps))
    return em.finish("red", ["BLOCK_M: tl.constexpr", "BLOCK_R: tl.constexpr"],
                     grid=(math.ceil(m / block_m),), num_warps=num_warps,
                     constexprs={"BLOCK_M": block_m, "BLOCK_R": block_r})


def _column_masks(full_rows: bool, full_cols: bool, r: int) -> list[str]:
    """The lines binding the column mask and the tile mask of a reduction (after `rows`, `rmask` and
    `cols`); an extent the block divides needs no mask."""
    lines = [] if full_cols else [f"cmask = cols < {r}"]
    if not (full_rows or full_cols):
        lines.append("mask = rmask & cmask")
    elif not full_rows:
        lines.append("mask = rmask")
    elif not full_cols:
        lines.append("mask = cmask")
    return lines


def _static_masks(em: Emitter, full_rows: bool, full_cols: bool) -> None:
    """Record the masks that are statically all-true, so loads and stores go unmasked."""
    em.full_masks |= ({"rmask"} if full_rows else set()) | ({"cmask"} if full_cols else set())
    if full_rows and full_cols:
        em.full_masks.add("mask")


_LOOPED = {"sum": "0.0", "mean": "0.0", "amax": 'float("-inf")', "amin": 'float("inf")'}
"""Reductions the looped template accumulates elementwise over its steps, with their identities."""


def _generate_looped_reduction(group: Group, dom: ReductionDomain, config: Config, target: str,
                               sm_count: int, pdl: bool) -> KernelSource:
    """The reduction with threads along the rows (Group.rows_contiguous): each program takes BLOCK_M
    adjacent rows and walks their columns BLOCK_R at a time, accumulating every reduction elementwise
    in a [BLOCK_M, BLOCK_R] tile and storing the outputs of the domain's shape as it goes; after the
    loop each tile is reduced along its columns and the row outputs are computed and stored.

    With SPLIT > 1 (fusion/geometry.looped_split: too few row tiles to fill the GPU), SPLIT
    programs share a row tile, each walking CHUNK columns of it; each writes its reduced values to a
    workspace and bumps the tile's counter (a release atomic after a barrier, as the matmul
    template's split-K); the program that finds the counter at SPLIT - 1 combines the partial values
    in split order (results do not depend on which program finishes last), resets the counter for
    the next launch, and computes and stores the row outputs."""
    m, r = dom.rows, dom.row_size
    block_m, block_r, num_warps = looped_launch(dom, config, sm_count, group.rows_contiguous)
    split, chunk = looped_split(dom, config, sm_count, group.rows_contiguous)
    tiles = math.ceil(m / block_m)
    pid = "tl.program_id(0).to(tl.int64)" if needs_int64(group, m * r) else "tl.program_id(0)"
    em = Emitter(group, target, masks={frozenset({"rows"}): "rmask", frozenset({"cols"}): "cmask",
                                        frozenset({"rows", "cols"}): "mask"}, pdl=pdl)
    em.lines.append(f"rows = {pid} * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]")
    full_rows, full_cols = m % block_m == 0, r % block_r == 0
    em.lines += [] if full_rows else [f"rmask = rows < {m}"]
    _static_masks(em, full_rows, full_cols)
    outer = list(em.hoist(delinearize(Expr.var("rows"), dom.outer_shape), "xo"))
    reductions = [n for n in group.nodes if n.kind is OpKind.REDUCTION]
    accs = [f"acc{k}" for k in range(len(reductions))]
    wides = [compute_dtype(n.dtype) for n in reductions]  # type: ignore[arg-type]
    em.lines += [f"{a} = tl.full([BLOCK_M, BLOCK_R], {_LOOPED[packet_name(n.op)]}, {TL_DTYPE[w]})"
                 for a, n, w in zip(accs, reductions, wides, strict=True)]
    cache, bound = dict(em.cache), dict(em.bound)  # what the loop binds is gone after it
    if split > 1:  # this program's slice; a chunk is whole steps, so a slice past the row has none
        em.lines.append(f"for r0 in range(tl.program_id(1) * {chunk}, "
                        f"tl.minimum(tl.program_id(1) * {chunk} + {chunk}, {r}), BLOCK_R):")
    else:
        em.lines.append(f"for r0 in range(0, {r}, BLOCK_R):")
    start = len(em.lines)
    em.lines.append("cols = r0 + tl.arange(0, BLOCK_R)[None, :]")
    em.lines += _column_masks(full_rows, full_cols, r)
    inner = list(em.hoist(delinearize(Expr.var("cols"), dom.reduce_shape), "xr"))
    full = tuple(inner.pop(0) if d in dom.dims else outer.pop(0) for d in range(len(dom.shape)))
    em.full_index, em.domain = full, dom
    for acc, n, wide in zip(accs, reductions, wides, strict=True):
        src = n.args[0]
        assert isinstance(src, Node)
        loaded = em.value(src, full)
        x = loaded.text if loaded.dtype == wide else f"{loaded.text}.to({TL_DTYPE[wide]})"
        x = em.where_valid(f"tl.broadcast_to({x}, (BLOCK_M, BLOCK_R))", _LOOPED[packet_name(n.op)])
        name = packet_name(n.op)
        if name in ("sum", "mean"):
            em.lines.append(f"{acc} = {acc} + {x}")
        else:
            helper = "_sf_max_nan" if name == "amax" else "_sf_min_nan"
            em.helpers.add(helper)
            em.lines.append(f"{acc} = {helper}({acc}, {x})")
    row_outputs = []
    for j, out in enumerate(group.outputs):
        if out.shape == dom.shape:
            v = em.value(out, full)
            em.store(f"out{j}_ptr + {store_offset(full, out).text}", store_cast(v, out),
                     em.mask_for(frozenset({"rows", "cols"})))
        else:
            row_outputs.append((j, out))
    em.lines[start:] = [f"    {line}" for line in em.lines[start:]]
    em.cache, em.bound = cache, bound
    totals = []
    for acc, n in zip(accs, reductions, strict=True):
        name = packet_name(n.op)
        totals.append(f"tl.sum({acc}, axis=1)" if name in ("sum", "mean") else
                      f"tl.reduce({acc}, 1, {'_sf_max_nan' if name == 'amax' else '_sf_min_nan'})")
    body_start = len(em.lines)
    if split > 1:
        totals = _combine_split(em, reductions, totals, split)
        body_start = len(em.lines)
    for n, total, wide in zip(reductions, totals, wides, strict=True):
        total = f"({total})[:, None]"
        em.reduced[n] = em.tmp(total if packet_name(n.op) != "mean" else f"{total} / {r}.0", wide)
    rows_only = tuple(ZERO if d in dom.dims else e for d, e in enumerate(full))
    for j, out in row_outputs:
        row = _row_index(rows_only, dom, out.shape)
        v = em.value(out, row)
        offset = "rows" if store_strides(out) is None else store_offset(row, out).text
        em.store(f"out{j}_ptr + {offset}", store_cast(v, out), em.mask_for(frozenset({"rows"})))
    if split > 1:  # the row outputs under `if last:`
        em.lines[body_start:] = [f"    {line}" for line in em.lines[body_start:]]
        em.scratch_params = SPLIT_SCRATCH_PARAMS
    source = em.finish("red", ["BLOCK_M: tl.constexpr", "BLOCK_R: tl.constexpr"],
                       grid=(tiles, split) if split > 1 else (tiles,), num_warps=num_warps,
                       constexprs={"BLOCK_M": block_m, "BLOCK_R": block_r})
    if split > 1:
        source.scratch = [(tiles * len(reductions) * split * block_m, torch.float32), (tiles, torch.int32)]
    return source


SPLIT_SCRATCH_PARAMS = ["ws_ptr", "lock_ptr"]
"""The split looped reduction's workspace (partial values) and per-tile counters."""


def _combine_split(em: Emitter, reductions: list[Node], totals: list[str], split: int) -> list[str]:
    """Store this program's partial values, count it in, and (as the last of the tile's SPLIT
    programs) load every partial in split order and combine them: the combined values' names."""
    em.lines.append("tile = tl.program_id(0)")
    em.lines.append("offs_m = tl.arange(0, BLOCK_M)")
    for k, total in enumerate(totals):
        em.lines.append(f"tl.store(ws_ptr + ((tile * {len(reductions)} + {k}) * {split} + tl.program_id(1)) * BLOCK_M "
                        f"+ offs_m, {total})")
    em.lines += ["tl.debug_barrier()",  # every thread's partial is written before the release below
                 f'last = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel") == {split - 1}',
                 "if last:"]
    names = []
    for k, n in enumerate(reductions):
        name = packet_name(n.op)
        base = f"ws_ptr + (tile * {len(reductions)} + {k}) * {split} * BLOCK_M + offs_m"
        em.lines.append(f"    part{k} = tl.load({base}, cache_modifier=\".cg\")")
        em.lines.append(f"    for s in tl.static_range(1, {split}):")
        nxt = f'tl.load({base} + s * BLOCK_M, cache_modifier=".cg")'
        if name in ("sum", "mean"):
            em.lines.append(f"        part{k} = part{k} + {nxt}")
        else:
            em.lines.append(f"        part{k} = {'_sf_max_nan' if name == 'amax' else '_sf_min_nan'}(part{k}, {nxt})")
        names.append(f"part{k}")
    em.lines.append("    tl.atomic_xchg(lock_ptr + tile, 0)")  # ready for the next launch
    return names


def _row_index(full: Index, dom: ReductionDomain, shape: tuple[int, ...]) -> Index:
    if shape == dom.keepdim_shape:
        return tuple(ZERO if d in dom.dims else e for d, e in enumerate(full))
    return tuple(e for d, e in enumerate(full) if d not in dom.dims)
