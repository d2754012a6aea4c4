"""Lowerings applied while converting: aten ops whose torch decompositions cannot be used at
capture (they go through prims or mutating ops), rewritten into ops the planner fuses.

- var / var_mean (every overload) -> var.correction (+ mean.dim)
- inference batch-norm -> (x - mean) * rsqrt(var + eps) * weight + bias, per channel
- training dropout -> philox_rand >= p selects x / (1 - p) (ir/rng.py), so it fuses
- max_pool2d_with_indices with its indices unread -> streamfuse.max_pool2d (a WINDOW op, generated)
- avg_pool2d with one divisor for every window -> streamfuse.avg_pool2d (a WINDOW op, generated)
- constant_pad_nd padding by nothing -> clone (fused)
- slice_scatter with step 1 -> cat of the base's slices before and after, and the source (fused)
- as_strided_scatter over the whole base, element for element -> clone of the source (fused)
- any (every overload) -> amax of the input as 0/1 float32, > 0 (a reduction, fused)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from streamfuse.ir.graph import Arg, Node
from streamfuse.ir.indexing import contiguous_strides, dense_order, slice_bound
from streamfuse.ir.ops import kind_of
from streamfuse.ir.rng import philox_rand

aten = torch.ops.aten


@dataclass
class Builder:
    """Appends new nodes to the graph being converted."""

    fresh: Callable[[str], str]
    nodes: list[Node]
    used_results: frozenset[int] | None = None
    """Which results of the op being lowered the graph reads (getitem indices); None: unknown."""

    def add(self, name: str, target: Any, args: tuple, kwargs: dict | None = None, *,
            shape: tuple[int, ...], dtype: torch.dtype | None, strides: tuple[int, ...] | None = None) -> Node:
        """A new node (contiguous unless `strides` says otherwise), appended to `nodes`."""
        qual = str(target) if isinstance(target, torch._ops.OpOverload) else target.__name__
        node = Node(self.fresh(name), qual, kind_of(qual), target, args, kwargs or {}, shape=tuple(shape),
                    dtype=dtype, strides=strides if strides is not None else contiguous_strides(shape))
        self.nodes.append(node)
        return node


def _lower_var(b: Builder, target: Any, args: tuple, kwargs: dict, val: Any) -> Arg:
    x = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    if target in (aten.var_mean.dim, aten.var.dim):
        unbiased = args[2] if len(args) > 2 else kwargs.get("unbiased", True)
        correction = 1 if unbiased else 0
        keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    else:
        correction = kwargs.get("correction")
        correction = 1 if correction is None else correction
        keepdim = kwargs.get("keepdim", False)
    var_val = val[0] if isinstance(val, (tuple, list)) else val
    var = b.add("var", aten.var.correction, (x, dims), {"correction": correction, "keepdim": keepdim},
                shape=tuple(var_val.shape), dtype=var_val.dtype)
    if target.overloadpacket is aten.var:
        return var
    mean = b.add("mean", aten.mean.dim, (x, dims, keepdim), shape=tuple(val[1].shape), dtype=val[1].dtype)
    return (var, mean)


def _lower_inference_batch_norm(b: Builder, target: Any, args: tuple, kwargs: dict, val: Any) -> Arg | None:
    """native_batch_norm with training=False (how make_fx's capture records eval-mode batch norm) is
    _native_batch_norm_legit_no_training (AOTAutograd's): (x, w, b, mean, var, training, momentum, eps)."""
    full = list(args) + [kwargs.get(k) for k in ("training", "momentum", "eps")[len(args) - 5:]]
    if len(full) < 8 or full[5] is not False or not isinstance(full[3], Node) or not isinstance(full[4], Node):
        return None
    return _lower_batch_norm(b, target, tuple(full[:5]) + (full[6], full[7]), {}, val)


def _lower_batch_norm(b: Builder, target: Any, args: tuple, kwargs: dict, val: Any) -> Arg:
    # ir/fold.py matches this exact chain (after a convolution) to fold it into the conv's weights:
    # a change to the chain's ops or operand order must be mirrored there (tests/test_fold.py checks).
    x, weight, bias, mean, var = args[:5]
    eps = args[6] if len(args) > 6 else kwargs.get("eps", 1e-5)
    assert isinstance(x, Node) and isinstance(mean, Node) and isinstance(var, Node)
    per_channel = (1, x.shape[1]) + (1,) * (len(x.shape) - 2)
    wide = torch.promote_types(x.dtype, mean.dtype)

    def channel(t: Node) -> Node:
        return b.add(f"{t.name}_c", aten.view.default, (t, list(per_channel)), shape=per_channel, dtype=t.dtype)

    full = x.shape
    y = b.add("bn_centered", aten.sub.Tensor, (x, channel(mean)), shape=full, dtype=wide)
    shifted = b.add("bn_var_eps", aten.add.Tensor, (channel(var), eps), shape=per_channel, dtype=var.dtype)
    rstd = b.add("bn_rstd", aten.rsqrt.default, (shifted,), shape=per_channel, dtype=var.dtype)
    y = b.add("bn_normed", aten.mul.Tensor, (y, rstd), shape=full, dtype=wide)
    if isinstance(weight, Node):
        y = b.add("bn_scaled", aten.mul.Tensor, (y, channel(weight)), shape=full,
                  dtype=torch.promote_types(wide, weight.dtype))
    if isinstance(bias, Node):
        y = b.add("bn_shifted", aten.add.Tensor, (y, channel(bias)), shape=full,
                  dtype=torch.promote_types(y.dtype, bias.dtype))
    out_dtype = val[0].dtype
    if y.dtype != out_dtype:
        y = b.add("bn_out", aten._to_copy.default, (y,), {"dtype": out_dtype}, shape=full, dtype=out_dtype)
    return (y, _Unused("batch-norm saved mean"), _Unused("batch-norm saved rstd"))


class _Unused:
    """A result the lowering does not produce; reading it is a converter error."""

    def __init__(self, what: str):
        self.what = what

    def __repr__(self) -> str:
        return f"<unused {self.what}>"


def _lower_dropout(b: Builder, target: Any, args: tuple, kwargs: dict, val: Any) -> Arg:
    """native_dropout(x, p, train) -> (where(rand >= p, x / (1 - p), 0), rand >= p), all pointwise."""
    x, p = args[0], float(args[1])
    train = args[2] if len(args) > 2 else kwargs.get("train", True)
    assert isinstance(x, Node) and x.dtype is not None
    if not train:  # eval-mode native_dropout is the identity with an all-true mask
        mask = b.add("dropout_keep", aten.full.default, (list(x.shape), True), {"dtype": torch.bool},
                     shape=x.shape, dtype=torch.bool)
        return (x, mask)
    rand = b.add("dropout_rand", philox_rand, (None, list(x.shape), 0, val[0].device), shape=x.shape,
                 dtype=torch.float32)
    keep = b.add("dropout_keep", aten.ge.Scalar, (rand, p), shape=x.shape, dtype=torch.bool)
    scale = 1.0 / (1.0 - p) if p < 1.0 else 0.0
    scaled = b.add("dropout_scaled", aten.mul.Tensor, (x, scale), shape=x.shape, dtype=x.dtype)
    out = b.add("dropout", aten.where.ScalarOther, (keep, scaled, 0.0), shape=x.shape, dtype=x.dtype)
    return (out, keep)


def _lower_bernoulli(b: Builder, target: Any, args: tuple, kwargs: dict, val: Any) -> Arg | None:
    """bernoulli.p(x, p): ones where rand < p, in x's shape and dtype (how functionalize traces
    training dropout on inputs ATen has no fused dropout kernel for: empty -> expand -> bernoulli ->
    div -> mul), from the same counter-based random numbers as native_dropout, so it fuses too."""
    x = args[0]
    p = float(args[1]) if len(args) > 1 else float(kwargs.get("p", 0.5))
    if kwargs.get("generator") is not None or (len(args) > 2 and args[2] is not None) or not isinstance(x, Node):
        return None  # a user's generator: its own stream of numbers, through ATen
    rand = b.add("bernoulli_rand", philox_rand, (None, list(x.shape), 0, val.device), shape=x.shape,
                 dtype=torch.float32)
    hit = b.add("bernoulli_hit", aten.lt.Scalar, (rand, p), shape=x.shape, dtype=torch.bool)
    return b.add("bernoulli", aten._to_copy.default, (hit,), {"dtype": val.dtype}, shape=x.shape, dtype=val.dtype)


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any) -> Any:
    """An op's argument by position, else by name, else its default."""
    return args[i] if len(args) > i else kwargs.get(name, default)


def _pair(v: Any, default: list[int]) -> list[int]:
    """A pooling size argument as [h, w] (an int or a one-element list stands for both)."""
    v = default if v is None or (isinstance(v, (list, tuple)) and len(v) == 0) else v
    v = [v] if isinstance(v, int) else list(v)
    return v * 2 if len(v) == 1 else v


def max_pool2d(x: torch.Tensor, kernel: list[int], stride: list[int], padding: list[int], dilation: list[int],
               ceil_mode: bool) -> torch.Tensor:
    """Reference implementation (the NodeStep target) of the lowered max pooling: values only."""
    return torch.nn.functional.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode)


max_pool2d.__name__ = "streamfuse.max_pool2d.default"


def _lower_max_pool2d(b: Builder, target: Any, args: tuple, kwargs: dict, val: Any) -> Arg | None:
    """max_pool2d_with_indices whose indices nobody reads -> a WINDOW node (values only, generated);
    with indices read, the op stays as it is (ATen)."""
    x = args[0]
    values = val[0]
    if b.used_results is None or 1 in b.used_results or not values.is_floating_point():
        return None  # converted as recorded: ATen computes the indices

    kernel = _pair(_arg(args, kwargs, 1, "kernel_size", None), [])
    stride = _pair(_arg(args, kwargs, 2, "stride", None), kernel)
    padding = _pair(_arg(args, kwargs, 3, "padding", 0), [0])
    dilation = _pair(_arg(args, kwargs, 4, "dilation", 1), [1])
    ceil_mode = bool(_arg(args, kwargs, 5, "ceil_mode", False))
    out = b.add("max_pool2d", max_pool2d, (x, kernel, stride, padding, dilation, ceil_mode),
                shape=tuple(values.shape), dtype=values.dtype)
    return (out, _Unused("max-pool indices"))


def avg_pool2d(x: torch.Tensor, kernel: list[int], stride: list[int], padding: list[int], dilation: list[int],
               divisor: int) -> torch.Tensor:
    """Reference implementation (the NodeStep target) of the lowered average pooling: every window
    inside the padded input, its sum divided by `divisor` (padding counted as zeros). `dilation` is
    always [1, 1]: it keeps args 1-4 as pool_params reads them for both pools."""
    return torch.nn.functional.avg_pool2d(x, kernel, stride, padding, False, True, divisor)


avg_pool2d.__name__ = "streamfuse.avg_pool2d.default"


def _lower_avg_pool2d(b: Builder, target: Any, args: tuple, kwargs: dict, val: Any) -> Arg | None:
    """avg_pool2d whose every window divides by the same count -> a WINDOW node (generated): windows
    that all lie inside the padded input (the output size ceil_mode=False gives), and padding counted
    (count_include_pad, or no padding) or a divisor_override. DenseNet's transitions, Inception's
    branches. Otherwise ATen (its per-window divisors)."""
    x = args[0]
    if not isinstance(x, Node) or not val.is_floating_point() or len(x.shape) not in (3, 4):
        return None

    kernel = _pair(_arg(args, kwargs, 1, "kernel_size", None), [])
    stride = _pair(_arg(args, kwargs, 2, "stride", None), kernel)
    padding = _pair(_arg(args, kwargs, 3, "padding", 0), [0])
    count_pad = bool(_arg(args, kwargs, 5, "count_include_pad", True))
    override = _arg(args, kwargs, 6, "divisor_override", None)
    if len(kernel) != 2 or len(stride) != 2 or len(padding) != 2:
        return None
    floor_hw = [(size + 2 * p - k) // s + 1 for size, k, s, p in zip(x.shape[-2:], kernel, stride, padding, strict=True)]
    if list(val.shape[-2:]) != floor_hw:
        return None  # ceil_mode added a window running past the padded input: a smaller divisor there
    if override is None and not count_pad and any(padding):
        return None  # windows at the borders divide by their in-bounds count
    divisor = int(override) if override is not None else kernel[0] * kernel[1]
    return b.add("avg_pool2d", avg_pool2d, (x, kernel, stride, padding, [1, 1], divisor),
                 shape=tuple(val.shape), dtype=val.dtype)


def _lower_zero_pad(b: Builder, target: Any, args: tuple, kwargs: dict, val: Any) -> Arg | None:
    """constant_pad_nd with every pad 0 (swin_t at 224x224 pads each window block by nothing: 15 copy
    launches per call) -> a clone, which fuses into its producer's or its readers' kernel."""
    x, pad = args[0], args[1] if len(args) > 1 else kwargs.get("pad")
    if not isinstance(x, Node) or not isinstance(pad, (list, tuple)) or any(p != 0 for p in pad):
        return None
    if tuple(val.shape) != x.shape or val.dtype != x.dtype:
        return None
    return b.add("pad_clone", aten.clone.default, (x,), shape=tuple(val.shape), dtype=val.dtype,
                 strides=tuple(val.stride()))


def _lower_whole_scatter(b: Builder, target: Any, args: tuple, kwargs: dict, val: Any) -> Arg | None:
    """as_strided_scatter(base, src, size, stride, offset) whose view is all of the result, element
    for element (no offset, and either base's size with strides that differ from the result's only
    in dims of size 1, or a row-major view of a row-major result in another shape) -> a copy of src
    in the result's layout, which fuses into src's kernel. The backward of the
    restride torch's decomposition puts after a [N, C, 1, 1] average pool of a channels_last tensor
    (a squeeze-and-excitation block trained in channels_last: efficientnet_b0 made 17 ATen copies per
    step for it, session 52, before capture/train_layout.py left depthwise networks NCHW; a model the
    user converts to channels_last still takes this path)."""
    base, src = args[0], args[1]
    size = args[2] if len(args) > 2 else kwargs.get("size")
    stride = args[3] if len(args) > 3 else kwargs.get("stride")
    offset = args[4] if len(args) > 4 else kwargs.get("storage_offset")
    if not isinstance(base, Node) or not isinstance(src, Node) or offset not in (None, 0):
        return None
    if not isinstance(size, (list, tuple)) or not isinstance(stride, (list, tuple)) \
            or not all(isinstance(v, int) for v in (*size, *stride)):
        return None  # symbolic sizes: leave it to ATen
    size, out = tuple(size), tuple(val.stride())  # the view's strides are into the result's memory
    if src.shape != size or src.dtype != base.dtype or val.dtype != base.dtype or len(stride) != len(size):
        return None
    row_major = all(n == 1 or s == c for n, s, c in zip(base.shape, out, contiguous_strides(base.shape)))
    if not row_major and dense_order(base.shape, out) is None:
        return None  # a result with gaps or overlaps: not every element is the view's
    if size == base.shape and all(n == 1 or s == t for n, s, t in zip(size, stride, out)):
        return b.add("scatter_whole", aten.clone.default, (src,), shape=base.shape, dtype=val.dtype, strides=out)
    # a contiguous result viewed row-major in another shape (a flat gradient buffer seen as [N, C])
    dense = contiguous_strides(size)
    if math.prod(size) != math.prod(base.shape) or not row_major \
            or any(n > 1 and s != t for n, s, t in zip(size, stride, dense)):
        return None
    copy = b.add("scatter_whole", aten.clone.default, (src,), shape=size, dtype=val.dtype, strides=dense)
    return b.add("scatter_whole_view", aten.view.default, (copy, list(base.shape)), shape=base.shape, dtype=val.dtype)


def _lower_slice_scatter(b: Builder, target: Any, args: tuple, kwargs: dict, val: Any) -> Arg | None:
    """slice_scatter(base, src, dim, start, end) with step 1 -> cat(base[..start], src, base[end..]) along
    dim: the backward of a slice (Llama's rotate_half takes each half of q and k: four ATen
    slice_scatter launches per layer over zeros), where cat fuses with what makes its parts and what
    reads it. The slices are zero-copy views of base."""
    base, src = args[0], args[1]
    dim, start, end, step = ((list(args[2:]) + [None] * 4)[:4])
    dim = kwargs.get("dim", 0) if dim is None else dim
    start, end, step = kwargs.get("start", start), kwargs.get("end", end), kwargs.get("step", step)
    if not isinstance(base, Node) or not isinstance(src, Node) or step not in (None, 1) or not base.shape:
        return None
    if not all(isinstance(v, int) or v is None for v in (dim, start, end)):
        return None  # symbolic bounds: leave it to ATen
    rank = len(base.shape)
    dim = dim % rank
    size = base.shape[dim]
    lo = 0 if start is None else slice_bound(start, size)
    hi = size if end is None else max(slice_bound(end, size), lo)
    if hi <= lo or src.shape != base.shape[:dim] + (hi - lo,) + base.shape[dim + 1:]:
        return None
    if src.dtype != base.dtype or val.dtype != base.dtype or tuple(val.stride()) != contiguous_strides(base.shape):
        return None  # a conversion, or a result in another layout: ATen's
    parts: list[Node] = []
    for a, z in ((0, lo), (hi, size)):
        if z > a:
            shape = base.shape[:dim] + (z - a,) + base.shape[dim + 1:]
            parts.append(b.add("scatter_part", aten.slice.Tensor, (base, dim, a, z), shape=shape, dtype=base.dtype,
                               strides=base.strides))
    if not parts:  # src is all of the result
        return b.add("scatter_all", aten.clone.default, (src,), shape=base.shape, dtype=val.dtype)
    parts.insert(0 if lo == 0 else 1, src)
    return b.add("slice_scatter", aten.cat.default, (parts, dim), shape=base.shape, dtype=val.dtype)


def _lower_any(b: Builder, target: Any, args: tuple, kwargs: dict, val: Any) -> Arg | None:
    """any over dims -> amax(input != 0 as 0/1 float32) > 0: a reduction the planner fuses. SDPA's math
    path (the one bert-base takes on the GPU, its mask expanded with a stride-0 last dim) asks through
    `_safe_softmax` whether each row is all -inf: an ATen `any` launch per layer, and the softmax
    kernel storing a bool tensor for it, where the softmax kernel can compute it beside its own
    max and sum."""
    x = args[0]
    if not isinstance(x, Node) or x.dtype is None or not x.shape:
        return None
    if target is aten.any.default:
        dims: Any = None
        keepdim = False
    else:
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    rank = len(x.shape)
    dims = list(range(rank)) if dims is None else [dims] if isinstance(dims, int) else list(dims)
    dims = sorted({d % rank for d in dims})
    if not dims or any(x.shape[d] == 0 for d in dims) or val.dtype != torch.bool:
        return None  # an empty reduction (False; amax would raise), or an unusual result type
    flag = x if x.dtype == torch.bool else b.add("any_ne", aten.ne.Scalar, (x, 0), shape=x.shape, dtype=torch.bool)
    as_float = b.add("any_float", aten._to_copy.default, (flag,), {"dtype": torch.float32}, shape=x.shape,
                     dtype=torch.float32)
    peak = b.add("any_max", aten.amax.default, (as_float, dims, keepdim), shape=tuple(val.shape), dtype=torch.float32)
    return b.add("any", aten.gt.Scalar, (peak, 0), shape=tuple(val.shape), dtype=torch.bool)


LOWERINGS: dict[Any, Callable[[Builder, Any, tuple, dict, Any], Arg | None]] = {
    # a lowering returns None to leave the op as recorded
    aten.max_pool2d_with_indices.default: _lower_max_pool2d,
    aten.avg_pool2d.default: _lower_avg_pool2d,
    aten.var_mean.correction: _lower_var,
    aten.var_mean.dim: _lower_var,
    aten.var.dim: _lower_var,
    aten.var.correction: _lower_var,
    aten._native_batch_norm_legit_no_training.default: _lower_batch_norm,
    aten.native_batch_norm.default: _lower_inference_batch_norm,
    aten.bernoulli.p: _lower_bernoulli,
    aten.native_dropout.default: _lower_dropout,
    aten.constant_pad_nd.default: _lower_zero_pad,
    aten.as_strided_scatter.default: _lower_whole_scatter,
    aten.slice_scatter.default: _lower_slice_scatter,
    aten.any.default: _lower_any,
    aten.any.dim: _lower_any,
    aten.any.dims: _lower_any,
}
