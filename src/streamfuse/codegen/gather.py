"""An embedding lookup in a generated kernel: a GATHER node (aten.embedding) evaluated as the index
loaded at the row's own position, then a load of the table at that row.

An index outside the table reads nothing and yields NaN: eager raises on it (a device-side assert
on CUDA), and a NaN shows in the result where a read of whatever lies past the table would not."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from streamfuse.codegen.pointwise_ops import Operand
from streamfuse.codegen.types import INT32_LIMIT, TL_DTYPE, compute_dtype
from streamfuse.ir.graph import Node
from streamfuse.ir.indexing import ZERO, Expr, Index

if TYPE_CHECKING:
    from streamfuse.codegen.kernel import Emitter


def emit_embedding(em: Emitter, node: Node, index: Index) -> Operand:
    """table[ids[i...], j] at index (i..., j); the table is a kernel input (fusion/legality.py)."""
    table, ids = node.args[0], node.args[1]
    assert isinstance(table, Node) and isinstance(ids, Node) and node.dtype is not None
    lead, col = index[:-1], index[-1]
    row = em.value(ids, lead)
    row_deps = frozenset().union(*(e.deps for e in lead))
    inside = em.tmp(f"({row.text} >= 0) & ({row.text} < {table.shape[0]})", torch.bool).text
    wide_row = row.text if table.numel <= INT32_LIMIT or row.dtype == torch.int64 else f"{row.text}.to(tl.int64)"
    slot = em.input_slot[table]
    offset = ZERO
    if table.shape[0] != 1:
        offset = offset + Expr(wide_row, row_deps) * Expr(f"in{slot}_s0")
    if table.shape[1] != 1:
        offset = offset + col * Expr(f"in{slot}_s1")
    deps = row_deps | col.deps
    mask = em.mask_for(deps)
    if em.guard is not None and deps & em.guard[1]:
        mask = em.guard[0] if mask is None else f"{mask} & {em.guard[0]}"
    mask = inside if mask is None else f"{mask} & {inside}"
    ptr = f"in{slot}_ptr" if offset.is_zero else f"in{slot}_ptr + {offset.text}"
    wide = compute_dtype(node.dtype)
    # a one-element table ([1, 1]) is read through the bare pointer, which takes no block mask (its
    # one element exists; an id out of range still gives NaN below). CPU fuzz, session 39
    text = f"tl.load({ptr})" if offset.is_zero else f"tl.load({ptr}, mask={mask}, other=0)"
    if wide != table.dtype:
        text += f".to({TL_DTYPE[wide]})"
    value = em.tmp(text, wide)
    return em.tmp(f"tl.where({inside}, {value.text}, float('nan'))", wide)
