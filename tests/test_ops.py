"""Table-driven op tests: every generated op x dtype, run through the generated kernel (Triton's
interpreter on CPU, the GPU under `pytest -m gpu` on a CUDA machine) and compared with a float64
eager reference. Each case also asserts the op was generated, not sent to ATen."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from helpers import compile_and_check, randn

import streamfuse

FLOATS = [torch.float32, torch.float16, torch.bfloat16]


@dataclass
class Case:
    name: str
    fn: Callable[..., object]
    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype] = field(default_factory=lambda: list(FLOATS))
    positive: bool = False
    kernels: int = 1
    """Expected launches (all generated)."""


S = (6, 37)  # odd sizes exercise masking
POINTWISE = [
    Case("add", lambda x, y: x + y, [S, S]),
    Case("add_alpha", lambda x, y: torch.add(x, y, alpha=0.5), [S, S]),
    Case("sub", lambda x, y: x - y, [S, S]),
    Case("rsub", lambda x: 1.5 - x, [S]),
    Case("mul", lambda x, y: x * y, [S, S]),
    Case("div", lambda x, y: x / y, [S, S], positive=True),
    Case("neg", lambda x: -x, [S]),
    Case("abs", torch.abs, [S]),
    Case("exp", torch.exp, [S]),
    Case("exp2", torch.exp2, [S]),
    Case("log", torch.log, [S], positive=True),
    Case("log2", torch.log2, [S], positive=True),
    Case("sqrt", torch.sqrt, [S], positive=True),
    Case("rsqrt", torch.rsqrt, [S], positive=True),
    Case("reciprocal", torch.reciprocal, [S], positive=True),
    Case("sigmoid", torch.sigmoid, [S]),
    Case("tanh", torch.tanh, [S]),
    Case("erf", torch.erf, [S]),
    Case("relu", torch.relu, [S]),
    Case("gelu", F.gelu, [S]),
    Case("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"), [S]),
    Case("silu", F.silu, [S]),
    Case("sin", torch.sin, [S]),
    Case("cos", torch.cos, [S]),
    Case("floor", lambda x: torch.floor(x * 3), [S]),
    Case("ceil", lambda x: torch.ceil(x * 3), [S]),
    Case("maximum", torch.maximum, [S, S]),
    Case("minimum", torch.minimum, [S, S]),
    Case("clamp", lambda x: torch.clamp(x, -0.5, 0.7), [S]),
    Case("clamp_min", lambda x: torch.clamp(x, min=0.1), [S]),
    Case("clamp_max", lambda x: torch.clamp(x, max=0.1), [S]),
    Case("where", lambda x, y: torch.where(x > y, x, y * 2), [S, S]),
    Case("masked_fill", lambda x: x.masked_fill(x < 0, -3.0), [S]),
    Case("pow2", lambda x: x**2, [S]),
    Case("pow_half", lambda x: x**0.5, [S], positive=True),
    Case("pow_neg1", lambda x: x**-1, [S], positive=True),
    Case("compare", lambda x, y: ((x > y), (x >= y), (x < 0.5), (x <= y), (x == x), (x != y)), [S, S]),  # six independent results, packed into one launch
    Case("logical", lambda x, y: (torch.logical_not(x > 0), torch.logical_and(x > 0, y > 0),
                                  torch.logical_or(x > 0, y > 0)), [S, S]),
    Case("bitwise_bool", lambda x, y: ((x > 0) & (y > 0), (x > 0) | (y < 0), (x > 0) ^ (y > 0), ~(x > y),
                                       (x > 0) & True), [S, S]),
    Case("cast_chain", lambda x: (x.to(torch.float16).to(torch.float32) * 2).to(x.dtype), [S]),
    Case("leaky_relu", lambda x: F.leaky_relu(x, 0.2), [S]),
    Case("hardtanh", lambda x: F.hardtanh(x, -0.3, 0.4), [S]),
    Case("broadcast_row", lambda x, b: x * b + 1, [S, (S[1],)]),
    Case("broadcast_col", lambda x, b: x - b, [S, (S[0], 1)]),
    Case("scalar_tensor", lambda x, s: x * s, [S, ()]),
]

VIEWS = [
    Case("transpose_add", lambda x, y: x.t() + y, [(37, 6), S]),
    Case("permute_3d", lambda x: (x.permute(2, 0, 1) * 2).contiguous(), [(3, 5, 7)]),
    Case("reshape_merge", lambda x, y: x.reshape(6, 35) + y, [(6, 5, 7), (6, 35)]),
    Case("reshape_split", lambda x, y: x.view(6, 5, 7) * y, [(6, 35), (6, 5, 7)]),
    Case("unsqueeze_expand", lambda x, y: x.unsqueeze(1).expand(6, 4, 37) + y, [S, (6, 4, 37)]),
    Case("slice_step", lambda x: x[:, 3:30:2] * 3, [S]),
    Case("select", lambda x, y: x[2] + y, [S, (37,)]),
    Case("transpose_clone", lambda x: x.transpose(0, 1).contiguous() + 1, [S]),
]

REDUCTIONS = [
    Case("sum_last", lambda x: x.sum(-1), [S]),
    Case("sum_keepdim", lambda x: x.sum(-1, keepdim=True) * 2, [S]),
    Case("mean", lambda x: x.mean(-1), [S]),
    Case("amax", lambda x: x.amax(-1), [S]),
    Case("amin", lambda x: x.amin(-1, keepdim=True), [S]),
    Case("var", lambda x: x.var(-1), [S]),
    Case("var_biased", lambda x: x.var(-1, unbiased=False, keepdim=True), [S]),
    Case("softmax", lambda x: torch.softmax(x, -1), [S]),
    Case("log_softmax", lambda x: torch.log_softmax(x, -1), [S]),
    Case("layer_norm", lambda x, w, b: F.layer_norm(x, (37,), w, b), [S, (37,), (37,)]),
    Case("rms_norm", lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w, [S, (37,)]),
    Case("sum_dim0", lambda x: x.sum(0), [S]),
    Case("mean_middle", lambda x: x.mean(1), [(3, 9, 5)]),
    Case("mean_two_dims", lambda x: x.mean((2, 3), keepdim=True), [(2, 3, 4, 5)]),
    Case("softmax_dim0", lambda x: torch.softmax(x, 0), [S]),
    Case("prologue_epilogue", lambda x, y: torch.softmax(x * 2 + y, -1) * 3 - 1, [S, S]),
]


def _params(cases: list[Case]) -> list[object]:
    return [pytest.param(c, d, id=f"{c.name}-{str(d).removeprefix('torch.')}") for c in cases for d in c.dtypes]


def _run(case: Case, dtype: torch.dtype, config, device) -> None:  # type: ignore[no-untyped-def]
    inputs = [randn(*s, dtype=dtype, device=device, positive=case.positive, seed=i) for i, s in enumerate(case.shapes)]
    compiled = compile_and_check(case.fn, inputs, config.replace(executor="triton"))
    stats = compiled.stats
    assert stats["aten_kernels"] == 0, compiled.explain(source=False)
    assert stats["generated_kernels"] == case.kernels, compiled.explain(source=False)


@pytest.mark.parametrize(("case", "dtype"), _params(POINTWISE))
def test_pointwise_op(case: Case, dtype: torch.dtype, config, device) -> None:  # type: ignore[no-untyped-def]
    _run(case, dtype, config, device)


@pytest.mark.parametrize(("case", "dtype"), _params(VIEWS))
def test_view_op(case: Case, dtype: torch.dtype, config, device) -> None:  # type: ignore[no-untyped-def]
    _run(case, dtype, config, device)


@pytest.mark.parametrize(("case", "dtype"), _params(REDUCTIONS))
def test_reduction_op(case: Case, dtype: torch.dtype, config, device) -> None:  # type: ignore[no-untyped-def]
    _run(case, dtype, config, device)


def test_integer_pointwise(config, device) -> None:  # type: ignore[no-untyped-def]
    x = torch.randint(-50, 50, (5, 9), dtype=torch.int64, device=device)
    y = torch.randint(1, 9, (5, 9), dtype=torch.int32, device=device)
    fn = lambda a, b: ((a * b + 3) - torch.maximum(a, b), torch.where(a > b, a, b), a / b)
    compiled = compile_and_check(fn, [x, y], config.replace(executor="triton"))
    assert compiled.stats["aten_kernels"] == 0


def test_bitwise_ops_on_integers_and_masks(config, device) -> None:  # type: ignore[no-untyped-def]
    """&, |, ^ and ~ on signed and unsigned integers (negative values: two's complement, as ATen) and
    on masks mixed with integers are generated, fused with the arithmetic around them."""
    x = torch.randint(-300, 300, (5, 9), dtype=torch.int64, device=device)
    y = torch.randint(-300, 300, (5, 9), dtype=torch.int32, device=device)
    u = torch.randint(0, 256, (5, 9), dtype=torch.uint8, device=device)
    fn = lambda a, b, c: ((a & b) + 1, (a | 6) * 2, a ^ b, ~b, ~c, c & 0x0F, (c ^ 0xFF) | (a > 0), (a > 0) & (b > 0))
    compiled = compile_and_check(fn, [x, y, u], config.replace(executor="triton"))
    assert compiled.stats["aten_kernels"] == 0


def test_nan_propagates_like_eager(config, device) -> None:  # type: ignore[no-untyped-def]
    x = randn(4, 16, device=device)
    x[1, 3] = float("nan")
    fn = lambda t: (t.amax(-1), torch.relu(t), torch.maximum(t, torch.zeros_like(t) + 0.5), torch.clamp(t, -1, 1))
    out = streamfuse.compile(fn, (x,), config.replace(executor="triton"))(x)
    for o, r in zip(out, fn(x), strict=True):
        torch.testing.assert_close(o, r, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_compare_with_inexact_scalar(dtype: torch.dtype, config, device) -> None:  # type: ignore[no-untyped-def]
    # ATen compares in the tensor's dtype: x > 0.3 compares with half(0.3) (0.30005 in fp16), so an
    # element equal to half(0.3) is not greater (found by tests/test_fuzz.py)
    near = [float(torch.tensor(v, dtype=dtype)) for v in (0.3, 0.1, -0.7)]
    x = torch.tensor(near + [0.2998, 0.30005, 1.0, -0.1], dtype=dtype, device=device)
    fn = lambda t: (t > 0.3, t == 0.3, t >= 0.1, t < -0.7, t != -0.1, (t * 3) > 0.9)
    out = streamfuse.compile(fn, (x,), config.replace(executor="triton"))(x)
    for o, r in zip(out, fn(x), strict=True):
        assert torch.equal(o, r), (o, r)


def test_int_and_bool_to_bfloat16(config, device) -> None:  # type: ignore[no-untyped-def]
    # Triton's interpreter turns a direct int -> bf16 cast into zeros (or fails on a bool scalar):
    # the kernels go through float32, as ATen does (found by tests/test_fuzz.py)
    x = randn(5, 3, device=device)
    fn = lambda t: ((t > 0).to(torch.bfloat16) * 2, (t * 4).to(torch.int32).to(torch.bfloat16),
                    t[0, 0].bool().bfloat16())
    out = streamfuse.compile(fn, (x,), config.replace(executor="triton"))(x)
    for o, r in zip(out, fn(x), strict=True):
        assert torch.equal(o, r), (o, r)


def test_bfloat16_stores_round_to_nearest_even(config, device) -> None:  # type: ignore[no-untyped-def]
    """float32 -> bfloat16 as ATen and the GPU round it (to nearest, ties to even). Triton 3.6's
    interpreter truncates toward zero, which made every bf16 model on the CPU up to one ulp off per
    store (mobilenet_v3_small's output 3.6x further from float64 than eager's); its sources round
    explicitly. Every element is compared exactly: about half would differ under truncation."""
    x = randn(64, 33, device=device) * 3
    fn = lambda t: ((t * 1.7 + 0.1).to(torch.bfloat16), ((t * 1.7).bfloat16().float() / 3).to(torch.bfloat16))
    out = streamfuse.compile(fn, (x,), config.replace(executor="triton"))(x)
    for o, r in zip(out, fn(x), strict=True):
        assert torch.equal(o, r), int((o != r).sum())


def test_the_bfloat16_rewrite_wraps_the_whole_operand() -> None:
    """round_bf16_to_nearest (interpreter sources) takes the operand before `.to(tl.bfloat16)`: a
    name, a call, a parenthesized expression or a subscript, however nested, and leaves the rest."""
    from streamfuse.codegen.kernel import round_bf16_to_nearest as rewrite

    cases = {
        "tl.store(p + o, t17.to(tl.bfloat16), mask=mask)": "tl.store(p + o, _sf_bf16(t17), mask=mask)",
        "t3 = t2.to(tl.bfloat16).to(tl.float32)": "t3 = _sf_bf16(t2).to(tl.float32)",
        "v = (a + f(b, (c))).to(tl.bfloat16)": "v = _sf_bf16((a + f(b, (c))))",
        "x = tl.load(p + o, mask=m).to(tl.bfloat16)": "x = _sf_bf16(tl.load(p + o, mask=m))",
        "y = acc[:, None].to(tl.bfloat16) * 2": "y = _sf_bf16(acc[:, None]) * 2",
        "z = a.to(tl.bfloat16) + b.to(tl.bfloat16)": "z = _sf_bf16(a) + _sf_bf16(b)",
        "w = a.to(tl.float16)": "w = a.to(tl.float16)",
    }
    for line, want in cases.items():
        assert rewrite(line) == want, (line, rewrite(line))


def test_pow_zero_is_one_for_inf_and_nan(config, device) -> None:  # type: ignore[no-untyped-def]
    x = torch.tensor([1.5, float("nan"), float("inf"), float("-inf"), 0.0], device=device)
    fn = lambda t: (t.pow(0) * 2,)
    out = streamfuse.compile(fn, (x,), config.replace(executor="triton"))(x)
    torch.testing.assert_close(out[0], fn(x)[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_single_value_chains_round_through_float32(dtype: torch.dtype, config, device) -> None:  # type: ignore[no-untyped-def]
    """Arithmetic on one-element float32 values is computed in float64 (an optimizer's bias
    corrections); where such a value becomes a half type it goes through float32, as ATen's does
    (softmax over one bf16 element came out 0 in Triton's interpreter: found by tests/test_fuzz.py)."""
    x = torch.tensor([1.2188], dtype=dtype, device=device)
    s = torch.tensor(0.999, device=device)
    fn = lambda a, b: (torch.softmax(a, 0), ((1 - b ** 3) / 7).to(dtype), (a.float() / 3).to(dtype))
    out = streamfuse.compile(fn, (x, s), config.replace(executor="triton"))(x, s)
    for o, r in zip(out, fn(x, s), strict=True):
        torch.testing.assert_close(o, r, rtol=0, atol=0)


def test_single_value_chains_decide_on_the_float32_value(config, device) -> None:  # type: ignore[no-untyped-def]
    """A comparison, an integer cast or a `where` reads a single-value chain's float64 result rounded
    to float32, as eager decides on it: float32(0.7) * 10 is 7.0 in float32, 6.99999988 in float64
    (the cast gave 6 and `!= 7` True), and a float32 underflow to 0 must stay 0 (found by the CPU
    fuzz in session 39, like the NaN gradient below)."""
    x = torch.tensor([0.7], device=device)
    fn = lambda t: ((t * 10).to(torch.int32), (t * 10) != 7.0, torch.where((t * 1e-30) * 1e-20 != 0, 1.0, 2.0))
    want = fn(x)
    out = streamfuse.compile(fn, (x,), config.replace(executor="triton"))(x)
    for o, w in zip(out, want, strict=True):
        torch.testing.assert_close(o, w, rtol=0, atol=0)
    # amin's backward compares its input (a widened product here) with the float32 minimum: without
    # the rounding no element tied, and the gradient was 0 / 0
    fn2 = lambda a: torch.nn.functional.gelu((a * a.mean([0]).reshape([1])).amin(-1).unsqueeze(0) + 0.5)
    a = torch.tensor([-1.2151], device=device)
    grads = []
    for f in (fn2, torch.compile(fn2, backend=streamfuse.make_backend(config.replace(executor="triton")))):
        leaf = a.clone().requires_grad_()
        (g,) = torch.autograd.grad(f(leaf) * 3.0, [leaf])
        grads.append(g)
    torch._dynamo.reset()
    torch.testing.assert_close(grads[1], grads[0])


def test_an_empty_batch_through_a_reshape_runs_compiled(config, device) -> None:  # type: ignore[no-untyped-def]
    """A (0, 5, 32) input through Linear -> ReLU -> Linear: the views to and from 2-D have zero
    elements, and the index of a zero-size reshape is never read (it raised IndexError, and the
    backend ran the graph eagerly with that as its reason)."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(device).eval()
    x = torch.randn(0, 5, 32, device=device)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend=streamfuse.make_backend(config))(x)
    assert out.shape == (0, 5, 8)
    torch._dynamo.reset()


def test_whole_as_strided_scatter_is_a_generated_copy(config, device) -> None:  # type: ignore[no-untyped-def]
    """as_strided_scatter whose view is the whole base (strides differing only in dims of size 1, or a
    contiguous flat base seen row-major in another shape: a channels_last training backward's pooled
    gradients, capture/train_layout.py) is a copy the planner fuses (ir/lowerings.py), not two ATen
    launches; a scatter into part of the base stays ATen's, and both match eager."""
    x = randn(2, 3, 1, 1, device=device)
    y = randn(2, 3, device=device)
    base4, flat = torch.zeros(2, 3, 1, 1, device=device), torch.zeros(6, device=device)

    def whole(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.as_strided_scatter(base4, a * 2.0, (2, 3, 1, 1), (3, 1, 3, 3)) + 1.0,
                torch.as_strided_scatter(flat, b.relu(), (2, 3), (3, 1)) * 3.0)

    compiled = compile_and_check(whole, [x, y], config.replace(executor="triton"))
    assert "as_strided_scatter" not in compiled.explain(source=False).split("refused fusions")[0]
    part = lambda b: torch.as_strided_scatter(torch.zeros(12, device=device), b.relu(), (2, 3), (3, 1), 2) * 3.0
    compiled = compile_and_check(part, [y], config.replace(executor="triton"))
    assert "as_strided_scatter" in compiled.explain(source=False)
