"""Random-graph fuzzing: small random programs of pointwise, broadcast, view, reduction, matmul, cat
and pooling ops, over random shapes (size-1 and odd dims), input layouts (transposed, sliced,
expanded) and dtypes (float32; float16/bfloat16 for about half), run eagerly, through
`streamfuse.compile` and through `torch.compile(backend=streamfuse.make_backend(config))` (Dynamo reset,
a fresh function object per program), and compared with eager: same number of outputs, shapes,
dtypes and devices, values within tolerance, inputs unchanged. Any exception from streamfuse on a
program that eager runs is a failure, and so is a fallback to eager (StreamfuseFallbackWarning).

A program is Python source (one line per op) built step by step by hypothesis: each step is evaluated
on the example inputs while it is drawn, so every program runs eagerly (a step eager rejects is a
GeneratorError: a bug here), and a failure prints the program itself, a ready-made repro
(`Program.__repr__`: the inputs' shapes, dtypes, layouts and seed, then the source).

Profiles:
- CI (default): `test_fuzz[family]`, 5 families x 120 programs, derandomized, ~2 minutes on 2 CPU
  cores (Triton's interpreter; on a CUDA machine the same programs run on the GPU).
- long: `pytest tests/test_fuzz.py --fuzz-examples=2000` (programs per family, any machine), and
  `pytest -m gpu -k fuzz` on the device machine (`test_fuzz_long_on_gpu`: compiled kernels on CUDA,
  larger shapes: several programs per kernel, long rows, real matmul tiles).

Numerics. Values stay bounded (|v| <= LIMIT, a worst-case bound tracked per value), so float16
never overflows in eager while streamfuse computes in float32. Comparisons (and casts to bool) only
read values every correct implementation computes bit for bit (inputs, their views, casts of those),
so a `where` never flips on rounding noise; casts to bfloat16 are not among them on CPU, where
Triton's interpreter rounds float32 -> bfloat16 towards zero (ATen: to nearest even). Tolerances:
see TOLERANCE and SUM_TOLERANCE.

Bugs it found are fixed and have regression tests of their own (tests/test_ops.py, test_fusion.py;
a reduction over an operand broadcast along the reduced dims: tests/test_fusion.py).
"""

from __future__ import annotations

import linecache
import math
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streamfuse
from streamfuse import Config
from streamfuse.runtime.fallback import StreamfuseFallbackWarning

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
LIMIT = 1e4
"""Largest |value| any intermediate may reach (worst case): float16 tops out at 65504."""


@dataclass(frozen=True)
class Sizes:
    dims: tuple[int, ...] = (3, 1, 2, 4, 5, 7, 8, 13)
    """Sizes a fresh dim is drawn from. Hypothesis shrinks towards the first, and draws it most often
    at the start: an all-ones shape there would make many programs trivial."""
    max_numel: int = 192
    """Elements in an input (keeps the interpreter fast)."""
    max_value_numel: int = 4096
    """Elements in any intermediate (broadcasts and expands multiply sizes)."""


TINY = Sizes()
LARGE = Sizes(dims=(3, 1, 2, 7, 8, 13, 32, 33, 64, 100, 128, 257, 1024), max_numel=1 << 16, max_value_numel=1 << 18)
"""The GPU profile: sizes past one program's block, reductions over long rows, real tiles."""
SCALARS = (0.5, -1.5, 2.0, 3.0, 0.25, -0.75)
THRESHOLDS = (0.3, 0.0, -0.1, 0.5, -0.5, 1.0)
"""Comparison constants; 0.3 and -0.1 are not exact in any float dtype (ATen rounds them to the tensor's)."""
SNAPS = tuple(t for t in THRESHOLDS if t != 0.0)
"""Input elements are sometimes these (rounded to the input's dtype): ties in comparisons."""

# (rtol relative to max|eager|, atol) by the narrowest float dtype a program computes in: a float32
# result upcast from a float16 value carries float16 rounding (eager rounds every intermediate to
# float16, streamfuse computes in float32 and rounds on store and at narrowing casts)
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.float16: (2e-2, 1e-3), torch.bfloat16: (2e-2, 1e-3)}
# and per unit of sum(|terms|) of the sums (reductions, matmuls) an output is computed from: each term
# may differ by a rounding (eager rounds it to the narrow dtype, streamfuse does not), ~2 ulps
SUM_TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 6e-3}
# Triton's interpreter (CPU) rounds float32 -> bfloat16 towards zero, not to nearest even (its
# cast_impl passes no rounding mode): each bfloat16 store errs by up to 1 ulp, always towards zero, so
# errors add up instead of cancelling (a program computing v * var(v) was off by 3.6% of its max, and
# exactly eager's result with the rounding fixed). Twice the bfloat16 budget there.
INTERPRETER_BF16 = ((4e-2, 1e-3), 1.2e-2)

NAMESPACE = {"torch": torch, "F": F}

CI_EXAMPLES = {"pointwise": 120, "views": 120, "reductions": 120, "matmul_cat_pool": 120, "mixed": 120}
"""Programs per family in the CI profile (CPU, Triton's interpreter): 600 in all, ~2 minutes."""
GPU_EXAMPLES = 150
"""Programs per family in the GPU profile (`pytest -m gpu -k fuzz`)."""


# --------------------------------------------------------------------------------------------
# programs


@dataclass
class InputSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: str
    """contiguous | transposed | sliced | expanded"""
    perm: tuple[int, ...] = ()
    """transposed: the dims in memory order (outermost first)."""
    steps: tuple[int, ...] = ()
    """sliced: per-dim step (the storage is larger, read with an offset of 1 where the step is > 1)."""
    expanded: tuple[int, ...] = ()
    """expanded: dims stored with size 1 and expanded to the shape."""

    def make(self, seed: int, device: str | torch.device = "cpu") -> torch.Tensor:
        rank = len(self.shape)
        if self.layout == "transposed":
            base_shape = [self.shape[d] for d in self.perm]
        elif self.layout == "sliced":
            base_shape = [s * k + (1 if k > 1 else 0) for s, k in zip(self.shape, self.steps, strict=True)]
        elif self.layout == "expanded":
            base_shape = [1 if d in self.expanded else s for d, s in enumerate(self.shape)]
        else:
            base_shape = list(self.shape)
        gen = torch.Generator().manual_seed(seed)
        magnitude = torch.rand(base_shape, generator=gen, dtype=torch.float64) * 1.75 + 0.25  # never zero
        sign = torch.where(torch.rand(base_shape, generator=gen) < 0.5, -1.0, 1.0).double()
        # one element in 8 is a comparison constant: ties, where rounding of the constant matters
        snap = torch.rand(base_shape, generator=gen) < 0.125
        pick = torch.randint(0, len(SNAPS), base_shape, generator=gen)
        values = torch.where(snap, torch.tensor(SNAPS, dtype=torch.float64)[pick], magnitude * sign)
        base = values.to(dtype=self.dtype, device=device)
        if self.layout == "transposed":
            return base.permute([self.perm.index(d) for d in range(rank)])
        if self.layout == "sliced":
            index = tuple(slice(1 if k > 1 else 0, None, k) for k in self.steps)
            return base[index]
        if self.layout == "expanded":
            return base.expand(self.shape)
        return base

    def __repr__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        extra = {"transposed": f" perm={list(self.perm)}", "sliced": f" steps={list(self.steps)}",
                 "expanded": f" expanded dims={list(self.expanded)}"}.get(self.layout, "")
        return f"{self.name}: {dt}{list(self.shape)} {self.layout}{extra}"


@dataclass
class Program:
    inputs: list[InputSpec]
    lines: list[str]
    outputs: list[str]
    seed: int
    precision: torch.dtype = torch.float32
    """The narrowest float dtype of any value in the program: it sets the tolerance."""
    scales: list[tuple[float, float]] = field(default_factory=list)
    """Per output, on the example inputs: the largest |value| among it and the values it is computed
    from, and the largest sum(|terms|) of a sum it is computed from. Rounding errors scale with
    those (the mean of a layer norm is ~0 but averages values ~1; a sum of 1000 terms ~1 may be off
    by 1000 roundings), so tolerances are taken against them, not only the output's max."""
    config: dict[str, Any] = field(default_factory=dict)
    """Config fields this program compiles with (beyond the test's config)."""

    def source(self) -> str:
        args = ", ".join(i.name for i in self.inputs)
        body = "".join(f"    {line}\n" for line in self.lines)
        return f"def program({args}):\n{body}    return ({', '.join(self.outputs)},)\n"

    def function(self) -> Callable[..., Any]:
        """A fresh function object each call (torch.compile caches per code object)."""
        src = self.source()
        filename = f"<fuzz-program-{abs(hash(src)):x}>"
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        namespace = dict(NAMESPACE)
        exec(compile(src, filename, "exec"), namespace)  # noqa: S102 - our own generated source
        return namespace["program"]

    def make_inputs(self, device: str | torch.device = "cpu") -> list[torch.Tensor]:
        return [spec.make(self.seed + 1000 * i, device) for i, spec in enumerate(self.inputs)]

    def __repr__(self) -> str:
        inputs = "\n".join(f"#   {spec!r}" for spec in self.inputs)
        return (f"\n# inputs (seed {self.seed}, values +-[0.25, 2] and SNAPS; see InputSpec.make):\n{inputs}\n"
                f"# config: {self.config}, tolerance of {self.precision}\n{self.source()}")


@dataclass
class Value:
    name: str
    sample: torch.Tensor
    """The value on the example inputs (eager, CPU): shape, dtype and strides exactly as eager's."""
    bound: float
    """Upper bound on |value| for any inputs in +-[0.25, 2] (or SNAPS)."""
    exact: bool
    """Every correct implementation computes it bit for bit (inputs, views, casts, max of those)."""
    is_input: bool = False
    magnitude: float = 0.0
    """max |value| over this value and everything it is computed from (on the example inputs)."""
    terms: float = 0.0
    """max sum(|terms|) of the sums and products (reductions, matmuls) this value is computed from."""
    probe: torch.Tensor | None = None
    """The value on other inputs, all contiguous with distinct elements: where it repeats along a dim,
    the program broadcast it there (not the inputs' layout)."""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.sample.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.sample.dtype

    @property
    def rank(self) -> int:
        return self.sample.dim()

    @property
    def floating(self) -> bool:
        return self.sample.dtype in FLOATS


class GeneratorError(Exception):
    """A drawn step that eager rejects: a bug in this generator, not in streamfuse."""


class Builder:
    def __init__(self, draw: Callable[[st.SearchStrategy[Any]], Any], dtype: torch.dtype, seed: int,
                 sizes: Sizes = TINY):
        self.draw = draw
        self.sizes = sizes
        self.dtype = dtype
        self.seed = seed
        self.inputs: list[InputSpec] = []
        self.values: list[Value] = []
        self.lines: list[str] = []

    # ---- values -------------------------------------------------------------------------

    def add_input(self, shape: Sequence[int], dtype: torch.dtype | None = None) -> Value:
        shape = tuple(shape)
        assert math.prod(shape) <= self.sizes.max_value_numel, f"generator bug: input of shape {shape}"
        dtype = dtype or self.dtype
        name = f"x{len(self.inputs)}"
        rank = len(shape)
        layout = self.draw(st.sampled_from(["contiguous", "contiguous", "transposed", "sliced", "expanded"]))
        spec = InputSpec(name, shape, dtype, "contiguous")
        big = [d for d, s in enumerate(shape) if s > 1]
        if layout == "transposed" and rank >= 2:
            perm = tuple(self.draw(st.permutations(range(rank))))
            if perm != tuple(range(rank)):
                spec = InputSpec(name, shape, dtype, layout, perm=perm)
        elif layout == "sliced" and rank >= 1:
            steps = tuple(self.draw(st.lists(st.sampled_from([1, 2, 3]), min_size=rank, max_size=rank)))
            if any(k > 1 for k in steps):
                spec = InputSpec(name, shape, dtype, layout, steps=steps)
        elif layout == "expanded" and big:
            dims = tuple(sorted(self.draw(st.sets(st.sampled_from(big), min_size=1, max_size=len(big)))))
            spec = InputSpec(name, shape, dtype, layout, expanded=dims)
        self.inputs.append(spec)
        sample = spec.make(self.seed + 1000 * (len(self.inputs) - 1))
        probe = InputSpec(name, shape, dtype, "contiguous").make(self.seed + 1000 * len(self.inputs) + 777)
        value = Value(name, sample, bound=2.0, exact=True, is_input=True, magnitude=_max_abs(sample), probe=probe)
        self.values.append(value)
        return value

    def emit(self, expr: str, bound: float, exact: bool = False, sums: bool = False) -> Value:
        """Append `v_i = expr`, evaluated on the example values (so the program stays valid)."""
        env = dict(NAMESPACE) | {v.name: v.sample for v in self.values}
        try:
            sample = eval(expr, env)  # noqa: S307 - our own generated source
        except Exception as exc:  # noqa: BLE001
            raise GeneratorError(f"eager rejects {expr!r}: {exc}\n{self.partial_source()}") from exc
        if not isinstance(sample, torch.Tensor):
            raise GeneratorError(f"{expr!r} is not a tensor")
        name = f"v{sum(not v.is_input for v in self.values)}"
        self.lines.append(f"{name} = {expr}")
        if sample.dtype not in FLOATS:
            bound = 1.0 if sample.dtype is torch.bool else bound
        used = set(re.findall(r"\b[xv]\d+\b", expr))
        magnitude = max([_max_abs(sample)] + [v.magnitude for v in self.values if v.name in used])
        terms = max([0.0] + [v.terms for v in self.values if v.name in used])
        if sums:  # a sum (or matrix product) of many terms: rounding errors scale with the sum of |terms|
            abs_env = dict(NAMESPACE) | {v.name: v.sample.double().abs() if v.floating else v.sample
                                         for v in self.values}
            terms = max(terms, _max_abs(eval(expr.replace(".view(", ".reshape("), abs_env)))  # noqa: S307
        probe_env = dict(NAMESPACE) | {v.name: v.probe for v in self.values}
        probe = eval(expr.replace(".view(", ".reshape("), probe_env)  # noqa: S307 - other strides: no .view
        value = Value(name, sample, bound=float(bound), exact=exact, magnitude=magnitude, terms=terms, probe=probe)
        self.values.append(value)
        return value

    def try_emit(self, expr: str, bound: float, exact: bool = False) -> Value | None:
        """emit, or None where eager rejects `expr` (used for ops whose validity rules are intricate)."""
        env = dict(NAMESPACE) | {v.name: v.sample for v in self.values}
        try:
            eval(expr, env)  # noqa: S307
        except Exception:  # noqa: BLE001
            return None
        return self.emit(expr, bound, exact)

    def partial_source(self) -> str:
        return "\n".join([repr(i) for i in self.inputs] + self.lines)

    def pick(self, pred: Callable[[Value], bool] = lambda v: True) -> Value | None:
        """A value satisfying pred, preferring recent ones (hypothesis shrinks towards index 0)."""
        cands = [v for v in reversed(self.values) if pred(v)]
        if not cands:
            return None
        if len(cands) == 1 or self.coin(0.5):  # half the time the latest: chains, which fuse
            return cands[0]
        return self.draw(st.sampled_from(cands))

    def coin(self, p_true: float = 0.5) -> bool:
        # sampled_from shrinks to its first element, so order the common choice first
        weight = max(1, round(p_true * 4))
        return self.draw(st.sampled_from([True] * weight + [False] * (4 - weight)))

    def fresh_shape(self, rank: int) -> tuple[int, ...]:
        dims = list(self.draw(st.lists(st.sampled_from(self.sizes.dims), min_size=rank, max_size=rank)))
        while math.prod(dims) > self.sizes.max_numel:
            dims[dims.index(max(dims))] //= 2
        return tuple(dims)

    def fits(self, shape_a: Sequence[int], shape_b: Sequence[int]) -> bool:
        return _fits(shape_a, shape_b, self.sizes.max_value_numel)

    def broadcast_partner(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A shape that broadcasts to `shape`: a suffix of it with some dims set to 1."""
        keep = self.draw(st.integers(0, len(shape)))
        suffix = list(shape[len(shape) - keep:])
        ones = self.draw(st.lists(st.booleans(), min_size=len(suffix), max_size=len(suffix)))
        return tuple(1 if one else s for s, one in zip(suffix, ones, strict=True))


def _max_abs(t: torch.Tensor) -> float:
    if not t.is_floating_point() or t.numel() == 0:
        return 0.0
    finite = t[t.isfinite()]
    return float(finite.abs().max()) if finite.numel() else 0.0


def _fits(shape_a: Sequence[int], shape_b: Sequence[int], limit: int) -> bool:
    """The shapes broadcast together, to at most `limit` elements."""
    try:
        out = torch.broadcast_shapes(tuple(shape_a), tuple(shape_b))
    except RuntimeError:
        return False
    return math.prod(out) <= limit


def _lit(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _index(rank: int, dim: int, item: str) -> str:
    """`a[:, :, item]`-style subscript selecting `item` along `dim`."""
    return "[" + ", ".join([":"] * dim + [item]) + "]"


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


FAMILIES: dict[str, list[Callable[[Builder], None]]] = {
    "pointwise": [step_unary, step_binary, step_compare, step_cast, step_binary, step_view, step_compare],
    "views": [step_view, step_unary, step_view, step_binary, step_view],
    "reductions": [step_reduction, step_rowwise, step_reduction, step_unary, step_binary, step_view],
    "matmul_cat_pool": [step_matmul, step_cat, step_pool, step_unary, step_binary, step_view],
    "mixed": [step_unary, step_binary, step_view, step_compare, step_cast, step_reduction, step_rowwise, step_matmul,
              step_cat, step_pool],
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


# --------------------------------------------------------------------------------------------
# checking


def _flat(x: Any) -> list[Any]:
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _flat(v)]
    return [x]


def _tolerance(dtype: torch.dtype, device: torch.device) -> tuple[tuple[float, float], float]:
    if dtype == torch.bfloat16 and device.type == "cpu":
        return INTERPRETER_BF16
    return TOLERANCE[dtype], SUM_TOLERANCE[dtype]


def assert_matches_eager(got: Any, expected: Sequence[torch.Tensor], where: str,
                         precision: torch.dtype = torch.float32, scales: Sequence[tuple[float, float]] = ()) -> None:
    outs = _flat(got)
    assert len(outs) == len(expected), f"{where}: {len(outs)} outputs, eager has {len(expected)}"
    for i, (o, e) in enumerate(zip(outs, expected, strict=True)):
        assert isinstance(o, torch.Tensor), f"{where}: output {i} is a {type(o).__name__}"
        assert o.shape == e.shape, f"{where}: output {i} has shape {list(o.shape)}, eager {list(e.shape)}"
        assert o.dtype == e.dtype, f"{where}: output {i} has dtype {o.dtype}, eager {e.dtype}"
        assert o.device == e.device, f"{where}: output {i} is on {o.device}, eager on {e.device}"
        if e.dtype not in FLOATS:
            assert torch.equal(o, e), f"{where}: output {i} ({e.dtype}) differs from eager:\n{o}\n{e}"
            continue
        (rtol, atol), per_term = max(_tolerance(e.dtype, e.device), _tolerance(precision, e.device))
        o64, e64 = o.double().cpu(), e.double().cpu()
        assert torch.equal(o64.isnan(), e64.isnan()), \
            f"{where}: output {i} has NaNs at other positions than eager:\nstreamfuse:\n{o}\neager:\n{e}"
        assert torch.equal(o64.isinf(), e64.isinf()) and torch.equal(o64[o64.isinf()], e64[e64.isinf()]), \
            f"{where}: output {i} has other infinities than eager:\nstreamfuse:\n{o}\neager:\n{e}"
        finite = e64.isfinite()
        magnitude, terms = scales[i] if i < len(scales) else (0.0, 0.0)
        scale = max(float(e64[finite].abs().max()) if finite.any() else 0.0, magnitude)
        err = (o64 - e64)[finite].abs()
        worst = float(err.max()) if err.numel() else 0.0
        tol = atol + rtol * scale + per_term * terms
        assert worst <= tol, (f"{where}: output {i} ({e.dtype}{list(e.shape)}) differs from eager by {worst:.3g} "
                              f"> {tol:.3g} (max |value| {scale:.3g}, sum |terms| {terms:.3g})\n"
                              f"streamfuse:\n{o}\neager:\n{e}")


def check_program(program: Program, config: Config, device: str | torch.device) -> None:
    with warnings.catch_warnings():
        # a fallback to eager would hide the failure behind right answers: here it is the failure
        warnings.simplefilter("error", StreamfuseFallbackWarning)
        _check_program(program, config, device)


def _check_program(program: Program, config: Config, device: str | torch.device) -> None:
    config = config.replace(**program.config)
    inputs = program.make_inputs(device)
    originals = [t.clone() for t in inputs]
    expected = [t.clone() if isinstance(t, torch.Tensor) else t for t in _flat(program.function()(*inputs))]

    compiled = streamfuse.compile(program.function(), tuple(inputs), config)
    first = compiled(*inputs)
    assert_matches_eager(first, expected, "streamfuse.compile", program.precision, program.scales)
    # a second call (replayed graphs, reused buffers) gives the same, and leaves the first results alone
    assert_matches_eager(compiled(*inputs), expected, "streamfuse.compile, 2nd call", program.precision,
                         program.scales)
    assert_matches_eager(first, expected, "streamfuse.compile, 1st results after the 2nd call",
                         program.precision, program.scales)
    for i, (t, t0) in enumerate(zip(inputs, originals, strict=True)):
        assert torch.equal(t, t0), f"streamfuse.compile changed input {i}"

    torch._dynamo.reset()
    backend = torch.compile(program.function(), backend=streamfuse.make_backend(config))
    assert_matches_eager(backend(*inputs), expected, "torch.compile(backend=streamfuse)",
                         program.precision, program.scales)
    for i, (t, t0) in enumerate(zip(inputs, originals, strict=True)):
        assert torch.equal(t, t0), f"torch.compile(backend=streamfuse) changed input {i}"


FUZZ_SETTINGS = dict(deadline=None, derandomize=True, print_blob=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                            HealthCheck.filter_too_much, HealthCheck.large_base_example])


def _run(family: str, examples: int, config: Config, device: str | torch.device, sizes: Sizes = TINY) -> None:
    @settings(max_examples=examples, **FUZZ_SETTINGS)
    @given(program=programs(family, sizes=sizes))
    def fuzz(program: Program) -> None:
        check_program(program, config, device)

    fuzz()


def _examples(request: pytest.FixtureRequest, default: int) -> int:
    n = request.config.getoption("--fuzz-examples", default=None)
    return int(n) if n else default


@pytest.mark.parametrize("family", sorted(CI_EXAMPLES))
def test_fuzz(family: str, config: Config, device: torch.device, request: pytest.FixtureRequest) -> None:
    _run(family, _examples(request, CI_EXAMPLES[family]), config, device)


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(CI_EXAMPLES))
def test_fuzz_long_on_gpu(family: str, config: Config, request: pytest.FixtureRequest) -> None:
    """The long profile: compiled kernels on CUDA, larger shapes (several programs per kernel, long rows)."""
    _run(family, _examples(request, GPU_EXAMPLES), config, "cuda", LARGE)
