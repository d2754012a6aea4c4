"""Pooling in a generated kernel: a WINDOW node (streamfuse.max_pool2d / avg_pool2d, lowered in
ir/lowerings.py) evaluated as its taps, each a shifted read of its input masked at the borders."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from streamfuse.codegen.pointwise_ops import Operand, cast
from streamfuse.codegen.types import compute_dtype
from streamfuse.ir.graph import Node
from streamfuse.ir.indexing import Index, avg_pool_divisor, pool_params

if TYPE_CHECKING:
    from streamfuse.codegen.kernel import Emitter


def emit_window(em: Emitter, node: Node, index: Index) -> Operand:
    """Pooling over the window's taps. Max: a tap outside the input (padding) is -inf, and NaN
    propagates as in ATen. Average: padding taps are zeros, the sum divided by the node's divisor
    (one for every window: ir/lowerings.py lowers no other)."""
    src = node.args[0]
    assert isinstance(src, Node) and node.dtype is not None
    kernel, stride, padding, dilation = pool_params(node)
    average = node.op == "streamfuse.avg_pool2d.default"
    wide = compute_dtype(node.dtype)
    if not average:
        em.helpers.add("_sf_max_nan")
    in_hw, out_hw = src.shape[-2:], node.shape[-2:]
    acc: str | None = None
    for kh in range(kernel[0]):
        for kw in range(kernel[1]):
            coords, conds, deps = list(index), [], frozenset[str]()
            for axis, k in ((0, kh), (1, kw)):
                d = len(index) - 2 + axis
                first = k * dilation[axis] - padding[axis]
                last = (out_hw[axis] - 1) * stride[axis] + first
                pos = index[d] * stride[axis] + first
                coords[d] = pos
                if first < 0:
                    conds.append(f"({pos.text} >= 0)")
                if last >= in_hw[axis]:
                    conds.append(f"({pos.text} < {in_hw[axis]})")
                deps |= index[d].deps
            cond = em.tmp(" & ".join(conds), torch.bool).text if conds else None
            v = em.guarded(cond, deps, lambda c=tuple(coords): em.value(src, c))
            outside = "0.0" if average else 'float("-inf")'
            tap = cast(v, wide) if cond is None else f"tl.where({cond}, {cast(v, wide)}, {outside})"
            if acc is None:
                acc = tap
            elif average:
                acc = em.tmp(f"{acc} + {tap}", wide).text
            else:
                acc = em.tmp(f"_sf_max_nan({acc}, {tap})", wide).text
    assert acc is not None
    if average:
        return em.tmp(f"{acc} / {float(avg_pool_divisor(node))!r}", wide)
    return Operand(acc, wide) if acc.isidentifier() else em.tmp(acc, wide)
