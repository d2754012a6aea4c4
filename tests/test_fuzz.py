"""Random-graph fuzzing: small random programs of pointwise, broadcast, view, reduction, matmul, cat
and pooling ops, over random shapes (size-1 and odd dims), input layouts (transposed, sliced,
expanded) and dtypes (float32; float16/bfloat16 for about half), run eagerly, through
`streamfuse.compile` and through `torch.compile(backend=streamfuse.make_backend(config))` (Dynamo reset,
a fresh function object per program), and compared with eager: same number of outputs, shapes,
dtypes and devices, values within tolerance, inputs unchanged. Any exception from streamfuse on a
program that eager runs is a failure, and so is a fallback to eager (StreamfuseFallbackWarning).
Float32 programs are also differentiated through the backend: every input's gradient against eager's
(`check_gradients`: AOTAutograd's backward graph runs through streamfuse as well).

A program is Python source (one line per op) built step by step by hypothesis: each step is evaluated
on the example inputs while it is drawn, so every program runs eagerly (a step eager rejects is a
GeneratorError: a bug here), and a failure prints the program itself, a ready-made repro
(`Program.__repr__`: the inputs' shapes, dtypes, layouts and seed, then the source).

Profiles:
- CI (default): `test_fuzz[family]`, 6 families, 530 programs, derandomized, ~5 minutes on 2 CPU
  cores (Triton's interpreter; on a CUDA machine the same programs run on the GPU).
- long rows (CI): `test_fuzz_long_rows`, the reductions and mixed families (100 programs, ~1.5 minutes)
  with Config.max_persistent_reduction=8, so nearly every reduction takes the looped template or ATen.
- long: `pytest tests/test_fuzz.py --fuzz-examples=2000` (programs per family, any machine), and
  `pytest -m gpu -k fuzz` on the device machine (`test_fuzz_long_on_gpu`: compiled kernels on CUDA,
  larger shapes: several programs per kernel, long rows, real matmul tiles).

Numerics. Values stay bounded (|v| <= LIMIT, a worst-case bound tracked per value), so float16
never overflows in eager while streamfuse computes in float32. Comparisons (and casts to bool) only
read values every correct implementation computes bit for bit (inputs, their views, casts of those),
so a `where` never flips on rounding noise; casts to bfloat16 are not among them on CPU, where
Triton's interpreter rounds float32 -> bfloat16 towards zero (ATen: to nearest even). Tolerances:
see TOLERANCE and SUM_TOLERANCE.

The generator lives in tests/fuzz_programs.py (programs, values, the builder, sizes and tolerances)
and tests/fuzz_steps.py (the op families and the `programs` strategy); this file checks.

Bugs it found are fixed and have regression tests of their own (tests/test_ops.py, test_fusion.py;
a reduction over an operand broadcast along the reduced dims: tests/test_fusion.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from fuzz_programs import (CI_EXAMPLES, FLOATS, GPU_EXAMPLES, INTERPRETER_BF16, LARGE, SUM_TOLERANCE, TINY,
                           TOLERANCE, InputSpec, Program, Sizes)
from fuzz_steps import programs
from hypothesis import HealthCheck, Phase, given, settings
from replay_emulation import emulate_replay

import streamfuse
import streamfuse.capture.backend as backend_module
from streamfuse import Config
from streamfuse.runtime.fallback import StreamfuseFallbackWarning
from streamfuse.runtime.replay import ReplayGraph


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
    if program.precision == torch.float32:
        check_gradients(program, config, inputs)


def check_gradients(program: Program, config: Config, inputs: list[torch.Tensor]) -> None:
    """Training through the backend: the gradients of every float32 input, of the float outputs
    projected on fixed random directions, against eager's (the backward graph AOTAutograd derives
    runs through streamfuse too). Float32 programs only, where the forward's tolerance carries over."""
    leaves = [t.detach().clone().requires_grad_(t.dtype == torch.float32) for t in inputs]
    if not any(t.requires_grad for t in leaves):
        return

    def grads(fn: Any) -> list[torch.Tensor | None]:
        xs = [t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
        outs = [o for o in _flat(fn(*xs)) if isinstance(o, torch.Tensor) and o.dtype in FLOATS and o.requires_grad]
        if not outs:
            return []
        gen = torch.Generator().manual_seed(program.seed)
        loss = sum((o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum() for o in outs)
        got = torch.autograd.grad(loss, [x for x in xs if x.requires_grad], allow_unused=True)
        return [None if g is None else g.detach() for g in got]

    expected = grads(program.function())
    if not expected:
        return
    torch._dynamo.reset()
    got = grads(torch.compile(program.function(), backend=streamfuse.make_backend(config)))
    assert [g is None for g in got] == [g is None for g in expected], "backward: other inputs have gradients"
    want = [g for g in expected if g is not None]
    # judged against the largest gradient of the program: a gradient that is zero in exact arithmetic
    # (layer_norm's weight over one element) is rounding noise amplified by rsqrt(eps) in eager
    scale = max((float(g.abs().max()) for g in want if g.numel() and g.isfinite().all()), default=0.0)
    try:
        assert_matches_eager([g for g in got if g is not None], want,
                             "torch.compile(backend=streamfuse) backward (input gradients)",
                             scales=[(scale, 0.0)] * len(want))
    except AssertionError:
        # float64 arbitrates (as benchmarks/training.py does): a layer norm over values equal in
        # exact arithmetic multiplies the backward's rounding by rsqrt(eps) ~ 316, in eager as
        # much as here; streamfuse passes if it is no further from float64 than twice eager float32
        exact = [g for g in grads_in(program, leaves, torch.float64) if g is not None]
        if not within_eager_error([g for g in got if g is not None], want, exact, rounding_spread(program, leaves)):
            raise


def grads_in(program: Program, leaves: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor | None]:
    """Eager's input gradients with float32 inputs cast to `dtype` (float64: the reference both
    float32 runs are measured against), the same projection directions as check_gradients."""
    xs = [t.detach().to(dtype if t.dtype == torch.float32 else t.dtype).requires_grad_(t.requires_grad)
          for t in leaves]
    outs = [o for o in _flat(program.function()(*xs)) if isinstance(o, torch.Tensor) and o.is_floating_point()
            and o.requires_grad]
    gen = torch.Generator().manual_seed(program.seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=gen).to(o.device).double()).sum() for o in outs)
    got = torch.autograd.grad(loss, [x for x in xs if x.requires_grad], allow_unused=True)
    return [None if g is None else g.detach() for g in got]


def rounding_spread(program: Program, leaves: list[torch.Tensor], draws: int = 4) -> list[float]:
    """How far eager float32's input gradients move when the float32 inputs move by one unit in the
    last place (random signs, `draws` times): what rounding alone does to them. A gradient that is
    zero in exact arithmetic, a sum of terms of ~300 that cancel (a layer norm over equal values:
    rsqrt(eps)), comes out 0.0 in eager on the GPU by the luck of its order and 1.8e-4 in ours
    (run 85); perturbed by an ulp, eager's own moves by as much on the CPU. On the GPU eager's layer
    norm backward gave 0.0 under every perturbation (run 87), so the spread is taken on the CPU too:
    it measures how much float32 rounding the program amplifies, which is the program's, not one
    device's summation order."""
    spread = _rounding_spread(program, leaves, draws)
    if any(t.device.type != "cpu" for t in leaves):
        on_cpu = [t.detach().cpu().requires_grad_(t.requires_grad) for t in leaves]
        spread = [max(a, b) for a, b in zip(spread, _rounding_spread(program, on_cpu, draws), strict=True)]
    return spread


def _rounding_spread(program: Program, leaves: list[torch.Tensor], draws: int) -> list[float]:
    base = [g for g in grads_in(program, leaves, torch.float32) if g is not None]
    gen = torch.Generator().manual_seed(program.seed)
    spread = [0.0] * len(base)
    for _ in range(draws):
        moved = []
        for t in leaves:
            if t.dtype == torch.float32:
                sign = torch.randint(-1, 2, t.shape, generator=gen).to(t.device, torch.float32)
                t = (t.detach() * (1 + sign * 2 ** -23)).requires_grad_(t.requires_grad)
            moved.append(t)
        again = [g for g in grads_in(program, moved, torch.float32) if g is not None]
        for i, (a, b) in enumerate(zip(again, base, strict=True)):
            finite = a.isfinite() & b.isfinite()
            if finite.any():
                spread[i] = max(spread[i], float((a.double() - b.double())[finite].abs().max()))
    return spread


def within_eager_error(got: list[torch.Tensor], want: list[torch.Tensor], exact: list[torch.Tensor],
                       spread: list[float] | None = None) -> bool:
    """Each of `got` is at most twice as far from `exact` (float64) as eager float32's `want` is (or as
    eager's own gradients move under one-ulp changes of the inputs, `spread`: rounding_spread), plus
    float32's rounding of the values themselves."""
    if len(got) != len(want) or len(want) != len(exact) or (spread is not None and len(spread) != len(want)):
        return False
    for k, (g, w, e) in enumerate(zip(got, want, exact, strict=True)):
        g64, w64 = g.double().cpu(), w.double().cpu()
        e64 = e.double().cpu()
        finite = e64.isfinite() & w64.isfinite()
        if not torch.equal(g64.isfinite(), w64.isfinite()):
            return False
        ours = float((g64 - e64)[finite].abs().max()) if finite.any() else 0.0
        eager = float((w64 - e64)[finite].abs().max()) if finite.any() else 0.0
        rounding = 2 ** -23 * (float(e64[finite].abs().max()) if finite.any() else 0.0)
        if ours > 2 * max(eager, spread[k] if spread is not None else 0.0) + 4 * rounding:
            return False
    return True


def check_replayed_gradients(program: Program, config: Config, device: str | torch.device, calls: int = 8) -> None:
    """Training through the backend, `calls` times two forwards and one backward with fresh leaves of
    the same values (the training graphs record CUDA graphs after a few calls and replay after:
    runtime/replay.py).
    Every later call's results and input gradients must equal the first call's (run step by step,
    before any graph exists; check_gradients holds that one against eager), and the results of
    every call, kept, must survive the calls after it."""
    inputs = program.make_inputs(device)
    leaves = [t.detach().clone().requires_grad_(t.dtype == torch.float32) for t in inputs]
    if not any(t.requires_grad for t in leaves):
        return

    def run(fn: Any) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Two forwards, then one backward through both (the second forward runs while the first's
        saved activations wait for the backward: it must not replay over them)."""
        xs = [t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
        outs = [[o for o in _flat(fn(*xs)) if isinstance(o, torch.Tensor) and o.dtype in FLOATS and o.requires_grad]
                for _ in range(2)]
        if not outs[0]:
            return [], []
        gen = torch.Generator().manual_seed(program.seed)
        directions = [torch.randn(o.shape, generator=gen).to(o.device) for o in outs[0]]
        loss = sum((o.float() * d).sum() * (k + 1) for k, each in enumerate(outs) for o, d in zip(each, directions))
        got = torch.autograd.grad(loss, [x for x in xs if x.requires_grad], allow_unused=True)
        return outs[0] + outs[1], [None if g is None else g.detach() for g in got]  # results kept as returned

    torch._dynamo.reset()
    compiled = torch.compile(program.function(), backend=streamfuse.make_backend(config))
    first_out, first = run(compiled)
    if not first_out:
        return
    want_out = [o.detach().clone() for o in first_out]
    kept = [first_out]
    for call in range(1, calls):
        outs, got = run(compiled)
        kept.append(outs)
        assert [g is None for g in got] == [g is None for g in first], f"call {call}: other inputs have gradients"
        for i, (g, w) in enumerate(zip(got, first, strict=True)):
            if g is not None and w is not None:
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, equal_nan=True,
                                           msg=lambda m, i=i, call=call: f"call {call}, gradient {i} vs call 0: {m}")
    for call, outs in enumerate(kept):  # no later replay overwrote a result the caller still holds
        for i, (o, w) in enumerate(zip(outs, want_out, strict=True)):
            torch.testing.assert_close(o.detach(), w, rtol=1e-6, atol=1e-6, equal_nan=True,
                                       msg=lambda m, i=i, call=call: f"result {i} of call {call}, kept: {m}")


FUZZ_SETTINGS = dict(deadline=None, derandomize=True, print_blob=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                            HealthCheck.filter_too_much, HealthCheck.large_base_example],
                     # on the GPU each example compiles real kernels: shrinking a failure took the whole
                     # of a device call's time (runs 82-84 ended before naming one); the failing example
                     # is printed as found
                     phases=[p for p in Phase if p is not Phase.shrink] if torch.cuda.is_available() else list(Phase))


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


LONG_ROW_FAMILIES = {"reductions": 60, "mixed": 40}


@pytest.mark.parametrize("family", sorted(LONG_ROW_FAMILIES))
def test_fuzz_long_rows(family: str, config: Config, device: torch.device, request: pytest.FixtureRequest) -> None:
    """Every row past 8 elements "long" (Config.max_persistent_reduction=8): reductions take the looped
    template where one pass can run them (split, sibling merges, a max and a sum of exponentials in
    two kernels) and ATen where not (a variance), through both entry points and the backward."""
    _run(family, _examples(request, LONG_ROW_FAMILIES[family]), config.replace(max_persistent_reduction=8), device)


REPLAY_FAMILIES = {"views": 25, "indexing": 20, "mixed": 25, "reductions": 20}


@pytest.mark.parametrize("family", sorted(REPLAY_FAMILIES))
def test_fuzz_replayed_training(family: str, config: Config, device: torch.device, request: pytest.FixtureRequest,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Float32 programs trained through the backend over eight calls, so their forward and backward
    graphs record and replay (emulated on the CPU: tests/replay_emulation.py, with the reference
    executor, as the replay logic is under test, not the kernels; test_fuzz checks the first call's
    gradients against eager's)."""
    if device.type == "cpu":
        emulate_replay(monkeypatch)
        config = config.replace(executor="reference")

    kept: list[Any] = []  # the registry holds graphs weakly: each program's go with it, so keep them here
    register = backend_module.compiled_graphs.append
    monkeypatch.setattr(backend_module.compiled_graphs, "append", lambda graph: (kept.append(graph), register(graph)))

    @settings(max_examples=_examples(request, REPLAY_FAMILIES[family]), **FUZZ_SETTINGS)
    @given(program=programs(family, sizes=TINY))
    def fuzz(program: Program) -> None:
        if program.precision != torch.float32:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("error", StreamfuseFallbackWarning)
            check_replayed_gradients(program, config.replace(**program.config), device)

    fuzz()
    replayed = [g for g in kept if isinstance(g, ReplayGraph) and g.replay_stats.replays > 0]
    assert len(replayed) >= 4, "too few programs' training graphs replayed: the test would not test replays"


def test_constant_beside_a_reduction_broadcasts(config: Config, device: torch.device) -> None:
    """Found by the long CPU fuzz (session 17): where(x1 > 0.3, x1, x0).sum(-1) with a 0-d x1. Its
    backward computes where(cond, g, 0) and sums it in one reduction kernel, and the constant 0 was
    a [1] block, which Triton cannot broadcast_to the kernel's [BLOCK_M, BLOCK_R]."""
    program = Program(inputs=[InputSpec("x0", (3,), torch.float32, "contiguous"), InputSpec("x1", (), torch.float32, "contiguous")],
                      lines=["v0 = torch.where((x1 > 0.3), x1, x0)", "v1 = v0.sum(-1, keepdim=False)"],
                      outputs=["v1"], seed=0, scales=[(1.9475927352905273, 4.490197658538818)],
                      config={"matmul_strategy": "auto"})
    check_program(program, config, device)


def test_layer_norm_over_equal_values_is_judged_against_float64(config: Config, device: torch.device) -> None:
    """Found by a long CPU fuzz (session 17): a layer norm over two values equal in exact arithmetic
    (a softmax expanded and transposed) has a backward whose rounding rsqrt(eps) multiplies; eager
    float32 and streamfuse then differ by more than float32's tolerance, and float64 says whose error
    it is."""
    program = Program(
        inputs=[InputSpec("x0", (3,), torch.float32, "contiguous"), InputSpec("x1", (), torch.float32, "contiguous"),
                InputSpec("x2", (2,), torch.float32, "contiguous")],
        lines=["v0 = x0.sum(-1, keepdim=False)", "v1 = torch.softmax(x0, 0)", "v2 = v1.expand(2, 3)",
               "v3 = v2.permute(1, 0)", "v4 = (v3 + 0.5)", "v5 = (v4 + x1)", "v6 = F.layer_norm(v5, [2], x2)",
               "v7 = v6.sum([1], keepdim=True)", "v8 = (v6 + v7)"],
        outputs=["v8", "v0"], seed=15111,
        scales=[(1.9835985898971558, 0.0), (1.3710129261016846, 3.0901841819286346)],
        config={"matmul_strategy": "triton"})
    check_program(program, config, device)


def test_the_rounding_spread_is_large_only_where_rounding_is_amplified() -> None:
    """rounding_spread, the arbiter's allowance for a gradient that is zero in exact arithmetic: large
    for the layer norm over equal values (run 85's GPU failure: 1.8e-4 against eager's 0.0), at
    float32's rounding for a well-conditioned program."""
    ln = Program(
        inputs=[InputSpec("x0", (3,), torch.float32, "contiguous"), InputSpec("x1", (), torch.float32, "contiguous"),
                InputSpec("x2", (2,), torch.float32, "contiguous")],
        lines=["v1 = torch.softmax(x0, 0)", "v2 = v1.expand(2, 3)", "v3 = v2.permute(1, 0)", "v5 = (v3 + x1)",
               "v6 = F.layer_norm(v5, [2], x2)"],
        outputs=["v6"], seed=15111, config={})
    plain = Program(inputs=[InputSpec("x0", (3, 4), torch.float32, "contiguous")],
                    lines=["v0 = (x0 * 2.0).exp()"], outputs=["v0"], seed=1, config={})
    for program, low, high in ((ln, 1e-5, float("inf")), (plain, 0.0, 1e-5)):
        leaves = [t.requires_grad_(True) for t in program.make_inputs("cpu")]
        grads = [g for g in grads_in(program, leaves, torch.float32) if g is not None]
        spread = rounding_spread(program, leaves)
        worst = max(spread[k] / max(float(g.abs().max()), 1e-30) for k, g in enumerate(grads))
        assert low < worst < high, (program.lines, spread)


def test_the_float64_arbiter_still_fails_a_wrong_gradient() -> None:
    exact = [torch.tensor([1.0, 2.0], dtype=torch.float64)]
    eager = [torch.tensor([1.0 + 1e-6, 2.0])]
    assert within_eager_error([torch.tensor([1.0 + 2e-6, 2.0])], eager, exact)
    assert not within_eager_error([torch.tensor([1.0 + 1e-4, 2.0])], eager, exact)
    assert not within_eager_error([torch.tensor([float("nan"), 2.0])], eager, exact)
