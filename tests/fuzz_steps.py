"""The op families of the fuzz test's program generator (tests/fuzz_programs.py holds the
programs, values and builder): each step appends one or a few lines of a random program, and
`programs` is the hypothesis strategy drawing a whole program of one family."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from fuzz_programs import FLOATS, LIMIT, SCALARS, THRESHOLDS, TINY, Builder, Program, Sizes, Value, _index, _lit
from hypothesis import strategies as st


# ---- op families: each appends one or a few lines -----------------------------------------


def step_unary(b: Builder) -> None:
    a = b.pick(lambda v: v.floating)
    if a is None:
        return
    ops: list[tuple[str, float, bool]] = [
        (f"torch.tanh({a.name})", 1.0, False),
        (f"torch.sigmoid({a.name})", 1.0, False),
        (f"torch.relu({a.name})", a.bound, a.exact),
        (f"F.gelu({a.name})", a.bound, False),
        (f"F.gelu({a.name}, approximate='tanh')", a.bound, False),
        (f"(-{a.name})", a.bound, a.exact),
        (f"{a.name}.abs()", a.bound, a.exact),
    ]
    if a.bound <= 4.0:
        ops.append((f"torch.exp({a.name})", math.exp(a.bound), False))
    c = b.draw(st.sampled_from(SCALARS))
    ops += [
        (f"({a.name} * {c})", a.bound * abs(c), False),
        (f"({a.name} + {c})", a.bound + abs(c), False),
        (f"({c} - {a.name})", a.bound + abs(c), False),
        (f"({a.name} / {c})", a.bound / abs(c), False),
    ]
    expr, bound, exact = b.draw(st.sampled_from(ops))
    if bound > LIMIT:
        expr, bound, exact = f"torch.tanh({a.name})", 1.0, False
    b.emit(expr, bound, exact)


def _operand(b: Builder, a: Value, floating_only: bool = False) -> Value:
    """A second operand that broadcasts with `a`: an existing value, or a fresh input."""
    if b.coin(0.5):
        other = b.pick(lambda v: v is not a and b.fits(a.shape, v.shape) and (v.floating or not floating_only))
        if other is not None:
            return other
    if b.coin(0.75):
        shape = b.broadcast_partner(a.shape)
    else:  # the other way round: `a` broadcasts to the new operand
        shape = b.fresh_shape(1) + a.shape
        if math.prod(shape) > b.sizes.max_value_numel:
            shape = a.shape
    return b.add_input(shape, a.dtype if a.floating else b.dtype)


def step_binary(b: Builder) -> None:
    a = b.pick(lambda v: v.floating)
    if a is None:
        return
    op = b.draw(st.sampled_from(["add", "mul", "sub", "div", "maximum", "where", "where_scalar"]))
    o = _operand(b, a, floating_only=op in ("div", "sub"))  # bool tensors have no `-`
    if op == "add":
        b.emit(f"({a.name} + {o.name})", a.bound + o.bound)
    elif op == "sub":
        b.emit(f"({a.name} - {o.name})", a.bound + o.bound)
    elif op == "mul":
        if a.bound * o.bound > LIMIT:
            b.emit(f"({a.name} + {o.name})", a.bound + o.bound)
        else:
            b.emit(f"({a.name} * {o.name})", a.bound * o.bound)
    elif op == "div":  # a denominator bounded away from 0
        b.emit(f"({a.name} / ({o.name}.abs() + 0.5))", a.bound * 2)
    elif op == "maximum":
        if o.floating:
            b.emit(f"torch.maximum({a.name}, {o.name})", max(a.bound, o.bound), a.exact and o.exact)
        else:
            b.emit(f"({a.name} + {o.name})", a.bound + o.bound)
    else:
        cond = _condition(b, tuple(torch.broadcast_shapes(a.shape, o.shape)))
        other = o.name if op != "where_scalar" else str(b.draw(st.sampled_from(SCALARS)))
        bound = max(a.bound, o.bound if op != "where_scalar" else 3.0)
        b.emit(f"torch.where({cond}, {a.name}, {other})", bound, False)


def _condition(b: Builder, shape: tuple[int, ...]) -> str:
    """A bool expression broadcasting with `shape`, computed only from exact values."""
    existing = b.pick(lambda v: v.dtype is torch.bool and b.fits(shape, v.shape))
    if existing is not None and b.coin(0.25):
        return existing.name
    x = b.pick(lambda v: v.exact and v.floating and b.fits(shape, v.shape))
    if x is None:
        x = b.add_input(b.broadcast_partner(shape))
    cmp = b.draw(st.sampled_from([">", "<", ">=", "<=", "==", "!="]))
    if b.coin(0.5):
        y = b.pick(lambda v: v.exact and v.floating and v is not x and b.fits(x.shape, v.shape)
                   and b.fits(shape, torch.broadcast_shapes(x.shape, v.shape)))
        if y is not None:
            return f"({x.name} {cmp} {y.name})"
    return f"({x.name} {cmp} {b.draw(st.sampled_from(THRESHOLDS))})"


def step_compare(b: Builder) -> None:
    """A bool value (kept for `where`, casts and as an output)."""
    a = b.pick(lambda v: v.floating)
    shape = a.shape if a is not None else b.fresh_shape(2)
    cond = _condition(b, shape)
    b.emit(cond, 1.0, True)


def step_cast(b: Builder) -> None:
    a = b.pick()
    if a is None:
        return
    if a.dtype is torch.bool:
        to = b.draw(st.sampled_from(["torch.float32", "torch.float16", "torch.bfloat16", "torch.int32"]))
        b.emit(f"{a.name}.to({to})", 1.0, True)
        return
    if not a.floating:
        b.emit(f"{a.name}.to(torch.float32)", a.bound, a.exact)
        return
    targets = ["torch.float32", "torch.float16", "torch.bfloat16"]
    if a.exact:
        targets.append("torch.bool")  # only exact values: a rounding difference near 0 would flip it
    to = b.draw(st.sampled_from(targets))
    # Triton's interpreter rounds float32 -> bfloat16 towards zero (ATen and GPUs: to nearest even), so
    # a value rounded to bfloat16 is not bit-exact on CPU: a comparison must not read it
    exact = a.exact and not (to == "torch.bfloat16" and a.dtype != torch.bfloat16)
    b.emit(f"{a.name}.to({to})", a.bound, exact)


def step_view(b: Builder) -> None:
    """One or two views, of a computed value mostly, then often an op that reads the view in the same
    kernel: there a view is index math in the consumer's loads (a view of an input, or a view that
    leaves the kernel, is a zero-copy alias instead)."""
    a = b.pick(lambda v: not v.is_input) if b.coin(0.75) else None
    a = a or b.pick()
    if a is None:
        return
    v = _emit_view(b, a)
    if b.coin(0.25):
        v = _emit_view(b, v)
    if v.floating and b.coin(0.5):
        c = b.draw(st.sampled_from(SCALARS))
        b.emit(f"({v.name} + {c})", v.bound + abs(c))


def _emit_view(b: Builder, a: Value) -> Value:
    r, shape = a.rank, a.shape
    kinds = ["slice", "reshape", "unsqueeze", "expand"]
    if r >= 1:
        kinds += ["select", "flatten_all"]
    if r >= 2:
        kinds += ["permute", "transpose"]
    if 1 in shape:
        kinds.append("squeeze")
    kind = b.draw(st.sampled_from(kinds))
    if kind == "slice" and r == 0:
        kind = "unsqueeze"
    n = a.name
    if kind == "reshape":
        new = _reshape_target(b, shape)
        view = b.try_emit(f"{n}.view({_lit(new)})", a.bound, a.exact) if b.coin(0.5) else None
        return view or b.emit(f"{n}.reshape({_lit(new)})", a.bound, a.exact)
    if kind == "flatten_all":
        expr = f"{n}.reshape(-1)"
    elif kind == "unsqueeze":
        expr = f"{n}.unsqueeze({b.draw(st.integers(-r - 1, r))})"
    elif kind == "squeeze":
        ones = [d for d, s in enumerate(shape) if s == 1]
        expr = f"{n}.squeeze({b.draw(st.sampled_from(ones))})" if b.coin(0.75) else f"{n}.squeeze()"
    elif kind == "expand":
        new = list(shape)
        for d, s in enumerate(shape):
            if s == 1 and b.coin(0.5):
                new[d] = b.draw(st.sampled_from([2, 3, 5]))
        lead = [b.draw(st.sampled_from([2, 3]))] if b.coin(0.5) or new == list(shape) else []
        new = lead + new
        if math.prod(new) > b.sizes.max_value_numel:
            new, lead = list(shape), []
        spelled = [s if (d < len(lead) or s != shape[d - len(lead)] or b.coin(0.5)) else -1
                   for d, s in enumerate(new)]
        expr = f"{n}.expand({', '.join(map(str, spelled))})"
    elif kind == "slice":
        big = [d for d, s in enumerate(shape) if s > 2] or [d for d, s in enumerate(shape) if s > 1]
        d = b.draw(st.sampled_from(big)) if big and b.coin(0.75) else b.draw(st.integers(0, r - 1))
        size = shape[d]
        # mostly long slices (a step only shows where two or more elements are kept)
        start = b.draw(st.sampled_from([s for s in (1, 0, -size, 2 - size) if -size <= s < size]
                                       + [b.draw(st.integers(-size, size - 1))]))
        begin = start % size
        stop = None if b.coin(0.5) else b.draw(st.sampled_from([-1, size] + list(range(begin + 1, size + 1))))
        if stop is not None and (stop % size if stop < 0 else stop) <= begin:
            stop = None
        step = b.draw(st.sampled_from([2, 1, 3]))
        if b.coin(0.75):
            item = f"{start}:{'' if stop is None else stop}:{step}"
            expr = f"{n}{_index(r, d, item)}"
        else:
            end = size if stop is None else stop % size if stop < 0 else stop
            expr = f"{n}.narrow({d}, {begin}, {end - begin})"
    elif kind == "select":
        d = b.draw(st.integers(-r, r - 1))
        i = b.draw(st.integers(-shape[d], shape[d] - 1))
        expr = f"{n}.select({d}, {i})" if b.coin(0.5) else f"{n}{_index(r, d % r, str(i))}"
    elif kind == "permute":
        expr = f"{n}.permute({', '.join(map(str, b.draw(st.permutations(range(r)))))})"
    else:  # transpose
        if r == 2 and b.coin(0.25):
            expr = f"{n}.t()"
        else:
            expr = f"{n}.transpose({b.draw(st.integers(-r, r - 1))}, {b.draw(st.integers(-r, r - 1))})"
    return b.emit(expr, a.bound, a.exact)


def _reshape_target(b: Builder, shape: tuple[int, ...]) -> list[int]:
    """Merge a run of adjacent dims, split one dim into two factors, or add/drop size-1 dims."""
    r = len(shape)
    moves = ["ones"]
    if r >= 2:
        moves.append("merge")
    if any(_factors(s) for s in shape):
        moves.append("split")
    move = b.draw(st.sampled_from(moves))
    if move == "merge":
        i = b.draw(st.integers(0, r - 2))
        j = b.draw(st.integers(i + 2, r))
        new = list(shape[:i]) + [math.prod(shape[i:j])] + list(shape[j:])
        if b.coin(0.25):
            new[i] = -1
        return new
    if move == "split":
        d = b.draw(st.sampled_from([d for d, s in enumerate(shape) if _factors(s)]))
        f = b.draw(st.sampled_from(_factors(shape[d])))
        return list(shape[:d]) + [f, shape[d] // f] + list(shape[d + 1:])
    new = [s for s in shape if s != 1 or b.coin(0.5)]
    pos = b.draw(st.integers(0, len(new)))
    return new[:pos] + [1] + new[pos:]


def _factors(n: int) -> list[int]:
    return [f for f in range(2, n) if n % f == 0]


def step_reduction(b: Builder) -> None:
    a = b.pick(lambda v: v.floating and v.rank >= 1)
    if a is None:
        a = b.add_input(b.fresh_shape(b.draw(st.integers(1, 3))))
    r, shape, n = a.rank, a.shape, a.name
    kind = b.draw(st.sampled_from(["sum", "mean", "amax", "amin", "var", "softmax", "log_softmax",
                                   "layer_norm", "full"]))
    dims = sorted(b.draw(st.sets(st.integers(0, r - 1), min_size=1, max_size=r)))
    spelled = [d - r if b.coin(0.25) else d for d in dims]
    dim_arg = str(spelled[0]) if len(spelled) == 1 and b.coin(0.5) else _lit(spelled)
    keep = b.draw(st.booleans())
    softmax_dim = b.draw(st.integers(-r, r - 1))
    norm_dims = b.draw(st.integers(1, min(r, 2)))
    count = math.prod(shape[d] for d in dims)
    if kind == "sum":
        bound = a.bound * count
        if bound > LIMIT:
            kind = "mean"
        else:
            b.emit(f"{n}.sum({dim_arg}, keepdim={keep})", bound, sums=True)
            return
    if kind == "mean":
        b.emit(f"{n}.mean({dim_arg}, keepdim={keep})", a.bound)
    elif kind in ("amax", "amin"):
        b.emit(f"{n}.{kind}({dim_arg}, keepdim={keep})", a.bound, a.exact)
    elif kind == "var":
        correction = b.draw(st.sampled_from([1, 0])) if count > 1 else 0
        bound = 8 * a.bound**2
        if bound > LIMIT:
            b.emit(f"torch.tanh({n})", 1.0)
            return
        b.emit(f"torch.var({n}, {dim_arg}, correction={correction}, keepdim={keep})", bound)
    elif kind == "softmax":
        b.emit(f"torch.softmax({n}, {softmax_dim})", 1.0)
    elif kind == "log_softmax":
        b.emit(f"torch.log_softmax({n}, {softmax_dim})", 2 * a.bound + math.log(shape[softmax_dim]) + 1)
    elif kind == "layer_norm":
        normalized = shape[r - norm_dims:]
        args = [n, _lit(normalized)]
        bound = math.sqrt(math.prod(normalized)) + 1
        if b.coin(0.5):
            w = b.add_input(normalized, a.dtype)
            args.append(w.name)
            bound *= 2
            if b.coin(0.5):
                args.append(b.add_input(normalized, a.dtype).name)
                bound += 2
        b.emit(f"F.layer_norm({', '.join(args)})", bound)
    elif kind == "full":
        fn = b.draw(st.sampled_from(["sum", "mean", "amax"]))
        bound = a.bound * (math.prod(shape) if fn == "sum" else 1)
        if bound > LIMIT:
            fn, bound = "mean", a.bound
        b.emit(f"{n}.{fn}()", bound, a.exact and fn == "amax", sums=fn == "sum")


def step_rowwise(b: Builder) -> None:
    """A reduction broadcast back over the rows it reduced (normalizations, attention-style scaling):
    `a - a.mean(d, keepdim=True)`, or the reduced value reshaped back to the keepdim shape by a view."""
    a = b.pick(lambda v: v.floating and v.rank >= 1 and v.bound <= 100)
    if a is None:
        a = b.add_input(b.fresh_shape(b.draw(st.integers(1, 3))))
    r, shape = a.rank, a.shape
    dims = sorted(b.draw(st.sets(st.integers(0, r - 1), min_size=1, max_size=r)))
    fn = b.draw(st.sampled_from(["mean", "amax", "sum", "var", "amin"]))
    count = math.prod(shape[d] for d in dims)
    bound = {"mean": a.bound, "amax": a.bound, "amin": a.bound, "sum": a.bound * count, "var": 8 * a.bound**2}[fn]
    if bound > LIMIT:
        fn, bound = "mean", a.bound
    if fn == "var":
        call = f"torch.var({a.name}, {_lit(dims)}, correction={1 if count > 1 else 0}, keepdim=KEEP)"
    else:
        call = f"{a.name}.{fn}({_lit(dims)}, keepdim=KEEP)"
    keepdim_shape = [1 if d in dims else s for d, s in enumerate(shape)]
    if b.coin(0.5):
        red = b.emit(call.replace("KEEP", "True"), bound, sums=fn == "sum")
    else:  # reduce without keepdim, then view back: a per-row value reshaped across the kernel
        flat = b.emit(call.replace("KEEP", "False"), bound, sums=fn == "sum")
        if b.coin(0.5):
            red = b.emit(f"{flat.name}.reshape({_lit(keepdim_shape)})", bound)
        else:
            red = flat
            for d in dims:
                red = b.emit(f"{red.name}.unsqueeze({d})", bound)
    op = b.draw(st.sampled_from(["-", "/", "*", "+"]))
    if op == "/":
        b.emit(f"({a.name} / ({red.name}.abs() + 1))", a.bound)
    elif op == "*" and a.bound * bound <= LIMIT:
        b.emit(f"({a.name} * {red.name})", a.bound * bound)
    else:
        b.emit(f"({a.name} {'+' if op == '+' else '-'} {red.name})", a.bound + bound)


def step_matmul(b: Builder) -> None:
    a = b.pick(lambda v: v.floating and v.rank >= 1)
    if a is None:
        a = b.add_input(b.fresh_shape(2))
    kind = b.draw(st.sampled_from(["mm", "addmm", "linear", "bmm", "matmul"]))
    if kind in ("mm", "addmm") and a.rank != 2:
        a = b.emit(f"{a.name}.reshape(-1, {a.shape[-1]})", a.bound, a.exact)
    if kind == "bmm" and a.rank != 3:
        rows = a.shape[-2] if a.rank >= 2 else 1
        a = b.emit(f"{a.name}.reshape(-1, {rows}, {a.shape[-1]})", a.bound, a.exact)
    k = a.shape[-1]
    if k * a.bound * 2 > 100:  # keep the product's bound small: squash the lhs first
        a = b.emit(f"torch.tanh({a.name})", 1.0)
    n_out = b.draw(st.sampled_from(b.sizes.dims))
    m_rows = math.prod(a.shape[:-1])
    batch = max(math.prod(a.shape[:-2]), 2)  # the rhs has at most this many matrices
    while n_out > 1 and max(m_rows, batch * k) * n_out > b.sizes.max_value_numel:
        n_out //= 2

    def rhs(shape: tuple[int, ...]) -> Value:
        """An existing value of this shape and dtype (bounded), or its transpose; else a fresh input."""
        def ok(v: Value) -> bool:
            return v.dtype == a.dtype and k * a.bound * v.bound <= LIMIT / 4
        same = b.pick(lambda v: v.shape == shape and ok(v))
        if same is not None and b.coin(0.5):
            return same
        if len(shape) == 2:
            flipped = b.pick(lambda v: v.shape == shape[::-1] and ok(v))
            if flipped is not None and b.coin(0.5):
                return b.emit(f"{flipped.name}.t()", flipped.bound, flipped.exact)
        return b.add_input(shape, a.dtype)

    def prod_bound(x: Value, y: Value) -> float:
        return k * x.bound * y.bound

    if kind == "mm":
        w = rhs((k, n_out))
        expr, bound = f"torch.mm({a.name}, {w.name})", prod_bound(a, w)
    elif kind == "addmm":
        w = rhs((k, n_out))
        bias = b.add_input(b.draw(st.sampled_from([(n_out,), (a.shape[0], n_out), (1, n_out)])), a.dtype)
        alpha, beta = b.draw(st.sampled_from([(1, 1), (0.5, 1), (1, 2.0), (-1.5, 0.5)]))
        extra = "" if (alpha, beta) == (1, 1) else f", beta={beta}, alpha={alpha}"
        expr = f"torch.addmm({bias.name}, {a.name}, {w.name}{extra})"
        bound = abs(alpha) * prod_bound(a, w) + abs(beta) * bias.bound
    elif kind == "linear":
        w = rhs((n_out, k))
        if b.coin(0.5):
            bias = b.add_input((n_out,), a.dtype)
            expr, bound = f"F.linear({a.name}, {w.name}, {bias.name})", prod_bound(a, w) + bias.bound
        else:
            expr, bound = f"F.linear({a.name}, {w.name})", prod_bound(a, w)
    elif kind == "bmm":
        w = rhs((a.shape[0], k, n_out))
        expr, bound = f"torch.bmm({a.name}, {w.name})", prod_bound(a, w)
    else:  # `@` with broadcasting of the batch dims, or a vector on either side
        if b.coin(0.25):
            shape: tuple[int, ...] = (k,)
        else:
            batch = b.broadcast_partner(a.shape[:-2]) if a.rank > 2 else ()
            if b.coin(0.25) and math.prod(a.shape) * 2 <= b.sizes.max_value_numel:
                batch = (2,) + tuple(1 for _ in a.shape[:-2])  # rhs with more batch dims than lhs
            shape = tuple(batch) + (k, n_out)
        w = rhs(shape)
        if not b.fits(a.shape[:-2], w.shape[:-2]):
            w = rhs((k, n_out))
        expr, bound = f"({a.name} @ {w.name})", prod_bound(a, w)
    b.emit(expr, bound, sums=True)


def step_cat(b: Builder) -> None:
    a = b.pick(lambda v: v.rank >= 1)
    if a is None:
        a = b.add_input(b.fresh_shape(2))
    r = a.rank
    d = b.draw(st.integers(0, r - 1))
    parts = [a]
    for _ in range(b.draw(st.integers(1, 2))):
        def compatible(v: Value) -> bool:
            return (v.rank == r and v.dtype == a.dtype
                    and all(v.shape[i] == a.shape[i] for i in range(r) if i != d))
        other = b.pick(compatible) if b.coin(0.5) else None
        if other is None:
            shape = list(a.shape)
            shape[d] = b.draw(st.sampled_from([1, 2, 3]))
            other = b.add_input(shape, a.dtype if a.floating else b.dtype)
            if not a.floating:  # a bool/int value: cat a cast input of its dtype
                other = b.emit(f"({other.name} > 0).to({a.dtype})", 1.0, True)
        parts.append(other)
    if math.prod(a.shape) * len(parts) > b.sizes.max_value_numel:
        parts = parts[:1]
    order = b.draw(st.permutations(parts))
    spelled = d - r if b.coin(0.25) else d
    b.emit(f"torch.cat([{', '.join(p.name for p in order)}], {spelled})", max(p.bound for p in parts),
           all(p.exact for p in parts))


def step_pool(b: Builder) -> None:
    a = b.pick(lambda v: v.floating and v.rank in (3, 4) and min(v.shape[-2:]) >= 1)
    if a is None:
        rank = b.draw(st.sampled_from([4, 3]))
        lead = b.fresh_shape(rank - 2)
        h, w = b.draw(st.integers(1, 9)), b.draw(st.integers(1, 9))
        while math.prod(lead) * h * w > b.sizes.max_numel:
            lead = tuple(max(1, s // 2) for s in lead)
        a = b.add_input(lead + (h, w))
    h, w = a.shape[-2:]
    kind = b.draw(st.sampled_from(["max", "avg"]))
    kh, kw = b.draw(st.integers(1, 3)), b.draw(st.integers(1, 3))
    kernel = str(kh) if kh == kw else f"({kh}, {kw})"
    stride = b.draw(st.sampled_from([None, 1, 2, 3, (1, 2)]))
    pad = b.draw(st.sampled_from([0, 1, (0, 1), (1, 0)]))
    ceil = b.draw(st.booleans())
    args = [a.name, kernel]
    if stride is not None:
        args.append(f"stride={stride}")
    if pad != 0:
        args.append(f"padding={pad}")
    if ceil:
        args.append("ceil_mode=True")
    if kind == "max":
        dil = b.draw(st.sampled_from([1, 1, 2]))
        if dil != 1:
            args.append(f"dilation={dil}")
        expr, exact = f"F.max_pool2d({', '.join(args)})", a.exact
    else:
        if b.coin(0.25):
            args.append("count_include_pad=False")
        expr, exact = f"F.avg_pool2d({', '.join(args)})", False
    if b.try_emit(expr, a.bound, exact) is None:  # a window larger than the padded input: the simplest pool
        b.emit(f"F.{kind}_pool2d({a.name}, 1)", a.bound, exact)


def step_index(b: Builder) -> None:
    """Ops real models index and scan with: index_select and gather by positions computed in the
    program (arange arithmetic, argmax), embedding lookups, cumsum, tril/triu masks, flip, roll,
    masked_fill, stack, pads (by nothing too) and masks from positions alone (folded at compile time)."""
    a = b.pick(lambda v: v.floating and v.rank >= 1)
    if a is None:
        a = b.add_input(b.fresh_shape(b.draw(st.integers(1, 3))))
    n, r, shape = a.name, a.rank, a.shape
    d = b.draw(st.integers(0, r - 1))
    size = shape[d]
    dev = f"device={n}.device"
    kind = b.draw(st.sampled_from(["index_select", "gather", "gather_argmax", "embedding", "cumsum", "tril",
                                   "flip", "roll", "masked_fill", "stack", "pad", "position_mask"]))
    if kind == "index_select":
        k = b.draw(st.integers(1, 4))
        b.emit(f"{n}.index_select({d}, (torch.arange({k}, {dev}) * {b.draw(st.sampled_from([1, 2, 3]))}) % {size})",
               a.bound, a.exact)
    elif kind == "gather":  # every position along d, shifted by one: a permutation of the rows
        idx = f"((torch.arange({size}, {dev}) + 1) % {size}).view({_lit([size if i == d else 1 for i in range(r)])})"
        b.emit(f"torch.gather({n}, {d}, {idx}.expand({_lit(list(shape))}))", a.bound, a.exact)
    elif kind == "gather_argmax" and a.exact:  # positions from the data: ties are exact, so equal in both
        b.emit(f"torch.gather({n}, {d}, {n}.argmax({d}, keepdim=True))", a.bound, a.exact)
    elif kind == "embedding" and r == 2:
        rows = b.draw(st.integers(1, 6))
        b.emit(f"F.embedding((torch.arange({rows}, {dev}) * 5 + 1) % {shape[0]}, {n})", a.bound, a.exact)
    elif kind == "cumsum":
        bound = a.bound * size
        if bound <= LIMIT:
            b.emit(f"{n}.cumsum({d})", bound, sums=True)
        else:
            b.emit(f"torch.tanh({n}).cumsum({d})", float(size), sums=True)
    elif kind == "tril" and r >= 2:
        fn = b.draw(st.sampled_from(["tril", "triu"]))
        b.emit(f"torch.{fn}({n}, {b.draw(st.integers(-1, 1))})", a.bound, a.exact)
    elif kind == "flip":
        b.emit(f"{n}.flip({d})", a.bound, a.exact)
    elif kind == "roll":
        b.emit(f"torch.roll({n}, {b.draw(st.integers(-2, 2))}, {d})", a.bound, a.exact)
    elif kind == "pad":  # by nothing (a fused copy) or by one on either side of the last dim
        left, right = b.draw(st.sampled_from([(0, 0), (1, 0), (0, 1)]))
        b.emit(f"F.pad({n}, ({left}, {right}))", a.bound, a.exact)
    elif kind == "position_mask":  # a mask from positions alone (folded at compile time) applied to the data
        lo = b.draw(st.integers(0, max(0, size - 1)))
        pos = f"torch.arange({size}, {dev}).view({_lit([size if i == d else 1 for i in range(r)])})"
        b.emit(f"{n}.masked_fill(({pos} >= {lo}) & ({pos} % 2 == 0), -1.5)", max(a.bound, 1.5), a.exact)
    elif kind == "stack":
        o = b.pick(lambda v: v is not a and v.shape == a.shape and v.dtype == a.dtype)
        if o is None:
            b.emit(f"torch.stack([{n}, {n} * 0.5], {b.draw(st.integers(0, r))})", a.bound)
        else:
            b.emit(f"torch.stack([{n}, {o.name}], {b.draw(st.integers(0, r))})", max(a.bound, o.bound),
                   a.exact and o.exact)
    else:  # masked_fill by a comparison of exact values (never flips on rounding), or the fallback op
        if a.exact:
            c = b.draw(st.sampled_from(SCALARS))
            b.emit(f"{n}.masked_fill({n} > 0, {c})", max(a.bound, abs(c)), True)
        else:
            b.emit(f"{n}.masked_fill(torch.ones_like({n}, dtype=torch.bool).tril(), 0.0)" if r >= 2
                   else f"{n}.flip(0)", a.bound)


FAMILIES: dict[str, list[Callable[[Builder], None]]] = {
    "pointwise": [step_unary, step_binary, step_compare, step_cast, step_binary, step_view, step_compare],
    "views": [step_view, step_unary, step_view, step_binary, step_view],
    "reductions": [step_reduction, step_rowwise, step_reduction, step_unary, step_binary, step_view],
    "matmul_cat_pool": [step_matmul, step_cat, step_pool, step_unary, step_binary, step_view],
    "indexing": [step_index, step_unary, step_index, step_binary, step_view, step_reduction],
    "mixed": [step_unary, step_binary, step_view, step_compare, step_cast, step_reduction, step_rowwise, step_matmul,
              step_cat, step_pool, step_index],
}


@st.composite
def programs(draw: Callable[[st.SearchStrategy[Any]], Any], family: str, dtypes: Sequence[torch.dtype] = FLOATS,
             max_steps: int = 6, sizes: Sizes = TINY) -> Program:
    # float32 for half the programs, float16 or bfloat16 for the others
    dtype = draw(st.sampled_from([dtypes[0]] * 2 + list(dtypes[1:]))) if len(dtypes) > 1 else dtypes[0]
    seed = draw(st.integers(0, 2**16))
    b = Builder(draw, dtype, seed, sizes)
    base = b.fresh_shape(draw(st.integers(1, 4)))
    b.add_input(base)
    if b.coin(0.5):
        b.add_input(b.broadcast_partner(base) if b.coin(0.5) else base)
    steps = FAMILIES[family]
    for step in draw(st.lists(st.sampled_from(steps), min_size=2, max_size=max_steps)):
        step(b)
    computed = [v for v in b.values if not v.is_input]
    if not computed:
        b.emit(f"({b.values[-1].name} * 2.0)" if b.values[-1].floating else f"{b.values[-1].name}.clone()",
               2 * b.values[-1].bound)
        computed = [b.values[-1]]
    # every value no later step reads is returned (so no op is dead code), the last one first, and up to
    # two intermediates besides (a value both stored and read on in the same kernel)
    used = {name for line in b.lines for name in re.findall(r"\b[xv]\d+\b", line.split(" = ", 1)[1])}
    sinks = [v for v in reversed(computed) if v.name not in used]
    inner = [v for v in computed if v.name in used]
    extra = draw(st.lists(st.sampled_from(inner), max_size=2, unique_by=lambda v: v.name)) if inner else []
    outputs = [v.name for v in sinks + extra]
    config = {"matmul_strategy": draw(st.sampled_from(["auto", "triton"]))}
    narrow = [v.dtype for v in b.values if v.dtype in (torch.float16, torch.bfloat16)]
    precision = torch.bfloat16 if torch.bfloat16 in narrow else narrow[0] if narrow else torch.float32
    scales = [next((v.magnitude, v.terms) for v in b.values if v.name == name) for name in outputs]
    return Program(b.inputs, b.lines, outputs, seed, precision, scales, config)
