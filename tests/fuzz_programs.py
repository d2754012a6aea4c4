"""The program generator of tests/test_fuzz.py (see its docstring): hypothesis strategies building
small random programs step by step, each step evaluated eagerly as it is drawn, and the profiles'
sizes, tolerances and example counts."""

from __future__ import annotations

import linecache
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st


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

CI_EXAMPLES = {"pointwise": 90, "views": 90, "reductions": 90, "matmul_cat_pool": 90, "indexing": 80, "mixed": 90}
"""Programs per family in the CI profile (CPU, Triton's interpreter): 530 in all (float32 ones with
their gradients), ~5 minutes."""
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
