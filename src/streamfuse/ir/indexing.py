"""Index algebra: how a view or broadcast maps an index of its output to an index of its input.

An index is a tuple of `Expr`, one per dimension. An Expr is integer arithmetic in Python
syntax (`+ * // %`, which Triton shares) over named index variables, with the set of
variables it depends on. Fusion uses this to check legality; codegen to emit loads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from streamfuse.ir.graph import Node
from streamfuse.ir.ops import packet_name


@dataclass(frozen=True)
class Expr:
    text: str
    deps: frozenset[str] = frozenset()
    digit: tuple[Expr, int, int | None] | None = field(default=None, compare=False)
    """(base, div, mod) where this is `(base // div) % mod` (mod None: no modulo), as floordiv and
    mod build it: what `linearize` needs to fold `(x // 16) * 16 + x % 16` back into `x`."""

    @staticmethod
    def var(name: str) -> Expr:
        return Expr(name, frozenset({name}))

    @staticmethod
    def const(value: int) -> Expr:
        return Expr(str(value))

    @property
    def is_zero(self) -> bool:
        return self.text == "0"

    def __add__(self, other: Expr | int) -> Expr:
        other = _lift(other)
        if other.is_zero:
            return self
        if self.is_zero:
            return other
        return Expr(f"{self.text} + {other.text}", self.deps | other.deps)

    def __mul__(self, other: Expr | int) -> Expr:
        other = _lift(other)
        if self.is_zero or other.is_zero:
            return ZERO
        if other.text == "1":
            return self
        if self.text == "1":
            return other
        return Expr(f"{_paren(self)} * {_paren(other)}", self.deps | other.deps)

    def floordiv(self, divisor: int) -> Expr:
        if divisor == 1 or self.is_zero:
            return self
        base, div, mod = self.digit or (self, 1, None)
        digit = (base, div * divisor, None) if mod is None else (self, divisor, None)
        return Expr(f"{_paren(self)} // {divisor}", self.deps, digit)

    def mod(self, modulus: int) -> Expr:
        if modulus == 1:
            return ZERO
        base, div, mod = self.digit or (self, 1, None)
        digit = (base, div, modulus) if mod is None or mod % modulus == 0 else (self, 1, modulus)
        return Expr(f"{_paren(self)} % {modulus}", self.deps, digit)


ZERO = Expr("0")
Index = tuple[Expr, ...]


def _lift(v: Expr | int) -> Expr:
    return v if isinstance(v, Expr) else Expr.const(v)


def _paren(e: Expr) -> str:
    simple = e.text.replace("_", "").isalnum()
    return e.text if simple else f"({e.text})"


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


CHANNELS_LAST_ORDER = (0, 2, 3, 1)
"""The dims of a 4-D NCHW tensor from outermost to innermost in memory, in channels_last."""


def dense_order(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, ...] | None:
    """The dims from outermost to innermost in memory (size-1 dims first, in dim order) where
    `strides` lay `shape` out densely in an order other than row-major (a permuted result, a
    channels_last tensor); None for row-major, or for a layout with gaps or overlaps."""
    if len(strides) != len(shape):
        return None
    ones = [d for d in range(len(shape)) if shape[d] == 1]
    live = sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: -strides[d])
    expected = 1
    for d in reversed(live):
        if strides[d] != expected:
            return None
        expected *= shape[d]
    if live == sorted(live):
        return None
    return tuple(ones + live)


def channels_last_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Strides of a dense channels_last tensor of NCHW `shape`."""
    _, c, h, w = shape
    return (c * h * w, 1, w * c, c)


def linearize(index: Index, shape: Sequence[int]) -> Expr:
    """Row-major linear offset of `index` in a tensor of `shape`."""
    return strided_sum([(e, st) for e, st, size in zip(index, contiguous_strides(shape), shape, strict=True)
                        if size != 1])


def strided_sum(terms: Sequence[tuple[Expr, int]]) -> Expr:
    """sum(e * stride), outermost term first, with neighbouring digits of one base folded: the
    index a view's reshape splits (`x // 16`, `x % 16` at strides 16 and 1) sums back to `x`
    instead of `(x // 16) * 16 + x % 16` (swin_t's window softmax, whose mask add views the
    windows' dim as [batch, windows]: 764 sm_90 PTX instructions with such terms, 748 folded)."""
    folded: list[tuple[Expr, int]] = []
    for e, st in terms:
        folded.append((e, st))
        while len(folded) > 1:
            (outer, so), (inner, si) = folded[-2], folded[-1]
            if outer.digit is None or inner.digit is None:
                break
            (bo, do, mo), (bi, di, mi) = outer.digit, inner.digit
            if bo != bi or mi is None or do != di * mi or so != si * mi:
                break
            folded[-2:] = [(_digit(bi, di, None if mo is None else mo * mi), si)]
    out = ZERO
    for e, st in folded:
        out = out + e * st
    return out


def _digit(base: Expr, div: int, mod: int | None) -> Expr:
    """`(base // div) % mod` (mod None: no modulo)."""
    e = base.floordiv(div)
    return e if mod is None else e.mod(mod)


def delinearize(linear: Expr, shape: Sequence[int]) -> Index:
    """Inverse of `linearize` for offsets inside `shape`."""
    strides = contiguous_strides(shape)
    out = []
    outermost = True
    for size, st in zip(shape, strides, strict=True):
        if size == 1:
            out.append(ZERO)
            continue
        e = linear.floordiv(st)
        out.append(e if outermost else e.mod(size))
        outermost = False
    return tuple(out)


def broadcast_index(index: Index, in_shape: Sequence[int], out_shape: Sequence[int]) -> Index:
    """Index into an input of `in_shape` that broadcasts (numpy rules) to `out_shape`."""
    offset = len(out_shape) - len(in_shape)
    if offset < 0:
        raise ValueError(f"cannot broadcast {tuple(in_shape)} to {tuple(out_shape)}")
    return tuple(ZERO if s == 1 else index[offset + k] for k, s in enumerate(in_shape))


def reshape_index(index: Index, in_shape: Sequence[int], out_shape: Sequence[int]) -> Index:
    """Index into the input of a row-major reshape `in_shape -> out_shape`.

    Dimensions are matched in runs of equal products, so that dims a reshape leaves alone map
    one to one (and size-1 dims vanish) instead of going through a full linearization."""
    if math.prod(in_shape) != math.prod(out_shape):
        raise ValueError(f"reshape changes numel: {tuple(in_shape)} -> {tuple(out_shape)}")
    if math.prod(in_shape) == 0:  # an empty tensor (batch 0): no element is ever read
        return tuple(ZERO for _ in in_shape)
    ins = [k for k, s in enumerate(in_shape) if s != 1]
    outs = [k for k, s in enumerate(out_shape) if s != 1]
    result: list[Expr] = [ZERO] * len(in_shape)
    i = j = 0
    while i < len(ins) or j < len(outs):
        gi, gj = [ins[i]], [outs[j]]
        i, j = i + 1, j + 1
        pi, pj = in_shape[gi[0]], out_shape[gj[0]]
        while pi != pj:
            if pi < pj:
                gi.append(ins[i])
                pi *= in_shape[ins[i]]
                i += 1
            else:
                gj.append(outs[j])
                pj *= out_shape[outs[j]]
                j += 1
        if len(gi) == 1 and len(gj) == 1:
            result[gi[0]] = index[gj[0]]
            continue
        lin = linearize(tuple(index[k] for k in gj), [out_shape[k] for k in gj])
        for k, e in zip(gi, delinearize(lin, [in_shape[k] for k in gi]), strict=True):
            result[k] = e
    return tuple(result)


def view_input_index(node: Node, index: Index) -> Index:
    """Map an index of view/broadcast node `node`'s output to an index of its input (args[0])."""
    src = node.args[0]
    assert isinstance(src, Node)
    in_shape, out_shape = src.shape, node.shape
    name = packet_name(node.op)
    if name in ("view", "_unsafe_view", "reshape", "unsqueeze", "squeeze"):
        return reshape_index(index, in_shape, out_shape)
    if name == "expand":
        return broadcast_index(index, in_shape, out_shape)
    if name in ("permute", "transpose", "t"):
        perm = permutation(node)
        result: list[Expr] = [ZERO] * len(in_shape)
        for out_dim, in_dim in enumerate(perm):
            result[in_dim] = index[out_dim]
        return tuple(result)
    if name == "slice":
        dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(in_shape))
        start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
        step = node.args[4] if len(node.args) > 4 else 1
        start = slice_bound(start, in_shape[dim])
        out = list(index)
        out[dim] = index[dim] * step + start
        return tuple(out)
    if name == "select":
        dim = _norm_dim(node.args[1], len(in_shape))
        pos = node.args[2]
        pos = pos + in_shape[dim] if pos < 0 else pos
        return tuple(index[:dim]) + (Expr.const(pos),) + tuple(index[dim:])
    raise NotImplementedError(f"no index map for {node.op}")


def concat_parts(node: Node) -> tuple[list[Node], int]:
    """(tensors, non-negative dim) of a cat node."""
    tensors = node.args[0] if node.args else node.kwargs["tensors"]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return list(tensors), _norm_dim(dim, len(node.shape))


def pool_params(node: Node) -> tuple[list[int], list[int], list[int], list[int]]:
    """(kernel, stride, padding, dilation) of a streamfuse.max_pool2d or avg_pool2d node (ir/lowerings.py),
    each [h, w]."""
    kernel, stride, padding, dilation = (list(node.args[i]) for i in range(1, 5))  # type: ignore[call-overload]
    return kernel, stride, padding, dilation


def avg_pool_divisor(node: Node) -> int:
    """What every window of a streamfuse.avg_pool2d node divides its sum by (ir/lowerings.py)."""
    return int(node.args[5])  # type: ignore[call-overload]


def permutation(node: Node) -> list[int]:
    """Output dim k of a permute/transpose reads input dim perm[k]."""
    rank = len(node.shape)
    name = packet_name(node.op)
    if name == "permute":
        return [_norm_dim(d, rank) for d in node.args[1]]
    perm = list(range(rank))
    if name == "t":
        return perm[::-1]
    a, b = _norm_dim(node.args[1], rank), _norm_dim(node.args[2], rank)
    perm[a], perm[b] = perm[b], perm[a]
    return perm


def _norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def slice_bound(start: int, size: int) -> int:
    """A slice's start or end as ATen takes it: counted from the end if negative, clamped to [0, size]."""
    if start < 0:
        start += size
    return min(max(start, 0), size)


def squeeze_equal(a: Sequence[int], b: Sequence[int]) -> bool:
    """True if the shapes differ only by size-1 dimensions."""
    return [s for s in a if s != 1] == [s for s in b if s != 1]


def is_contiguous_meta(node: Node) -> bool:
    """`node`'s traced strides are row-major (dims of size 1 aside, whose stride nothing reads)."""
    return all(st == c for st, c, size in zip(node.strides, contiguous_strides(node.shape), node.shape, strict=True)
               if size != 1)
