"""The matmul template with fused epilogues (GroupKind.MATMUL), against float64 references.

On CPU the generated kernels run in Triton's interpreter; on the device machine the same tests
run compiled on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers import TOLERANCE, compile_and_check, randn

from streamfuse import Config
from streamfuse.fusion.groups import GroupKind
from streamfuse.fusion.strategy import decide

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

EPILOGUES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "none": lambda y: y,
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "scale": lambda y: y * 0.125,
}


def _triton(config: Config) -> Config:
    return config.replace(matmul_strategy="triton")


def _kinds(compiled) -> list[GroupKind]:  # type: ignore[no-untyped-def]
    return [g.kind for g in compiled.plan.groups if g.kind is not GroupKind.ALIAS]


def _matmul_source(compiled) -> str:  # type: ignore[no-untyped-def]
    (group,) = [g for g in compiled.plan.groups if g.kind is GroupKind.MATMUL]
    return compiled.sources[group.id].source


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", list(EPILOGUES))
def test_linear_bias_activation_is_one_kernel(act: str, dtype: torch.dtype, config, device) -> None:  # type: ignore[no-untyped-def]
    lin = torch.nn.Linear(40, 48).to(device=device, dtype=dtype)
    fn = lambda x: EPILOGUES[act](lin(x))
    compiled = compile_and_check(fn, [randn(37, 40, dtype=dtype, device=device)], _triton(config))
    assert _kinds(compiled) == [GroupKind.MATMUL]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_three_dim_linear_with_residual_and_cast(dtype: torch.dtype, config, device) -> None:  # type: ignore[no-untyped-def]
    lin = torch.nn.Linear(32, 24).to(device=device, dtype=dtype)
    fn = lambda x, r: (F.gelu(lin(x)) + r).float()
    inputs = [randn(3, 5, 32, dtype=dtype, device=device), randn(3, 5, 24, dtype=dtype, device=device, seed=2)]
    # the result is float32 but computed in `dtype`: compare at `dtype`'s tolerance
    scale = TOLERANCE[dtype][0] / TOLERANCE[torch.float32][0]
    compiled = compile_and_check(fn, inputs, _triton(config), scale=scale)
    assert _kinds(compiled) == [GroupKind.MATMUL]


def test_mm_without_bias_and_addmm_with_alpha_beta(config, device) -> None:  # type: ignore[no-untyped-def]
    w = randn(24, 16, device=device, seed=3)
    b = randn(16, device=device, seed=4)
    fn = lambda x: (torch.relu(x @ w), torch.addmm(b, x, w, beta=0.5, alpha=2.0).sigmoid())
    compiled = compile_and_check(fn, [randn(9, 24, device=device)], _triton(config))
    assert _kinds(compiled) == [GroupKind.MATMUL, GroupKind.MATMUL]


def test_product_needed_outside_is_stored_too(config, device) -> None:  # type: ignore[no-untyped-def]
    w = randn(16, 20, device=device, seed=5)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x @ w
        return y, torch.tanh(y) * 3.0

    compiled = compile_and_check(fn, [randn(18, 16, device=device)], _triton(config))
    assert _kinds(compiled) == [GroupKind.MATMUL]
    assert len(compiled.plan.groups[-1].outputs) == 2


def test_strided_operands_are_read_in_place(config, device) -> None:  # type: ignore[no-untyped-def]
    w = randn(20, 16, device=device, seed=6)
    fn = lambda x: F.silu(x.t() @ w.t())  # both operands transposed views
    compiled = compile_and_check(fn, [randn(16, 12, device=device)], _triton(config))
    assert _kinds(compiled) == [GroupKind.MATMUL]


@pytest.mark.parametrize("m,n,k", [(1, 40, 40), (16, 16, 16), (65, 33, 130), (128, 64, 96)])
def test_edge_shapes(m: int, n: int, k: int, config, device) -> None:  # type: ignore[no-untyped-def]
    w = randn(k, n, device=device, seed=7)
    fn = lambda x: torch.relu(x @ w) + 1.0
    compile_and_check(fn, [randn(m, k, device=device)], _triton(config))


def test_cublas_strategy_is_cublas_plus_one_epilogue_kernel(config, device) -> None:  # type: ignore[no-untyped-def]
    lin = torch.nn.Linear(40, 48).to(device)
    fn = lambda x: F.gelu(lin(x))
    compiled = compile_and_check(fn, [randn(8, 40, device=device)], config.replace(matmul_strategy="cublas"))
    assert _kinds(compiled) == [GroupKind.ATEN, GroupKind.POINTWISE]
    assert compiled.stats["kernels"] <= 2


def test_auto_strategy_records_its_reason(config, device) -> None:  # type: ignore[no-untyped-def]
    lin = torch.nn.Linear(40, 48).to(device)
    compiled = compile_and_check(lambda x: F.gelu(lin(x)), [randn(8, 40, device=device)], config)
    (choice,) = compiled.plan.matmul_choices.values()
    assert choice.strategy in ("triton", "cublas")
    assert "us" in choice.reason and choice.strategy in choice.reason
    assert compiled.stats["kernels"] <= 2
    assert "Triton template" in compiled.explain()


def test_no_epilogue_means_cublas_alone(config, device) -> None:  # type: ignore[no-untyped-def]
    w = randn(16, 20, device=device, seed=8)
    compiled = compile_and_check(lambda x: x @ w, [randn(8, 16, device=device)], config)
    assert _kinds(compiled) == [GroupKind.ATEN]


def test_tf32x3_float32_products_may_run_in_the_template_without_an_epilogue(config, device) -> None:  # type: ignore[no-untyped-def]
    """Config.float32_matmul="tf32x3": a float32 product (TF32 off) runs on the tensor cores at float32's
    accuracy in the template, so one without an epilogue is planned there where the model predicts it
    faster than cuBLAS's float32 kernels; the kernel asks tl.dot for "tf32x3". One-row products keep
    their matrix-vector loop, and with "ieee" nothing changes."""
    w = randn(256, 512, device=device, seed=8)
    x = randn(384, 256, device=device)
    emulated = config.replace(float32_matmul="tf32x3", check_templates=False)
    # K = 256 (the model predicts the template only for a product this large): float32's rounding in
    # sums of 256 products of N(0, 1) values (~16) exceeds the default 1e-5 absolute tolerance
    compiled = compile_and_check(lambda a: a @ w, [x], emulated, scale=8.0)
    (choice,) = compiled.plan.matmul_choices.values()
    assert choice.strategy == "triton" and not choice.rule, choice.reason
    assert _kinds(compiled) == [GroupKind.MATMUL]
    assert 'input_precision="tf32x3"' in _matmul_source(compiled)
    plain = compile_and_check(lambda a: a @ w, [x], config.replace(check_templates=False), scale=8.0)
    (choice,) = plain.plan.matmul_choices.values()
    assert choice.strategy == "cublas" and "no pointwise epilogue" in choice.rule
    # the same product in bfloat16 is not affected: nothing to emulate
    w16 = w.to(torch.bfloat16)
    half = compile_and_check(lambda a: a @ w16, [x.to(torch.bfloat16)], emulated, scale=8.0)
    assert _kinds(half) == [GroupKind.ATEN]


def test_tf32x3_is_only_asked_for_while_tf32_is_off(config, device, tf32_flags) -> None:  # type: ignore[no-untyped-def]
    """With TF32 allowed the template multiplies in TF32 whatever Config.float32_matmul says (TF32 is
    what the user asked for, and cuBLAS uses it too), and "tf32x3" does not move products without an
    epilogue off cuBLAS then."""
    tf32_flags(True, torch.backends.cudnn.allow_tf32)
    lin = torch.nn.Linear(40, 48).to(device)
    fn = lambda x: torch.relu(lin(x))
    emulated = _triton(config).replace(float32_matmul="tf32x3")
    # on CUDA the product is TF32's (10-bit mantissa, ~5e-4 relative per operand) against a float64
    # reference: run 239 (H100) saw 2e-3 absolute at K = 40; the interpreter multiplies in float32
    tf32 = 1000.0 if device.type == "cuda" else 1.0
    compiled = compile_and_check(fn, [randn(37, 40, device=device)], emulated, scale=tf32)
    source = _matmul_source(compiled)
    assert 'input_precision="tf32"' in source and "tf32x3" not in source
    w = randn(256, 512, device=device, seed=8)
    alone = compile_and_check(lambda a: a @ w, [randn(384, 256, device=device)],
                              config.replace(float32_matmul="tf32x3", check_templates=False), scale=8.0)
    assert _kinds(alone) == [GroupKind.ATEN]


def test_float32_matmul_is_checked() -> None:
    with pytest.raises(ValueError, match="float32_matmul.*'ieee' or 'tf32x3'.*'tf32'"):
        Config(float32_matmul="tf32")  # type: ignore[arg-type]


def test_prologue_and_reduction_epilogue_are_refused_with_reasons(config, device) -> None:  # type: ignore[no-untyped-def]
    w = randn(16, 20, device=device, seed=9)
    fn = lambda x: (torch.relu(x) @ w).sum(dim=1)
    compiled = compile_and_check(fn, [randn(8, 16, device=device)], _triton(config))
    reasons = " | ".join(r.reason for r in compiled.plan.refusals)
    assert "prologue" in reasons
    assert "reduction in a matmul epilogue" in reasons


def test_broadcasting_the_product_is_refused(config, device) -> None:  # type: ignore[no-untyped-def]
    w = randn(16, 1, device=device, seed=10)
    fn = lambda x, y: torch.relu(x @ w) * y  # [8, 1] product broadcast over [8, 12]
    compiled = compile_and_check(fn, [randn(8, 16, device=device), randn(8, 12, device=device, seed=11)],
                                 _triton(config))
    assert any("matmul" in r.reason for r in compiled.plan.refusals)


def _gelu_linear_group(config, rows: int):  # type: ignore[no-untyped-def]
    """The planned matmul group of gelu(Linear 4096->4096, bf16) at `rows` rows (planned, not run)."""
    lin = torch.nn.Linear(4096, 4096).to(torch.bfloat16)
    compiled = __import__("streamfuse").compile(lambda x: F.gelu(lin(x)), (randn(rows, 4096, dtype=torch.bfloat16),),
                                                _triton(config).replace(executor="reference"))
    return next(g for g in compiled.plan.groups if g.kind is GroupKind.MATMUL)


def test_template_tiles_and_candidates_respect_shared_memory(config) -> None:  # type: ignore[no-untyped-def]
    from streamfuse.codegen.matmul import candidate_tiles, heuristic_tile

    group = _gelu_linear_group(config, rows=512)
    tiles = candidate_tiles(group, config)
    assert len(tiles) >= 8 and len(set(tiles)) == len(tiles)
    assert all(t.shared_bytes(2) <= config.matmul_max_shared_bytes for t in tiles)
    small = candidate_tiles(group, config.replace(matmul_max_shared_bytes=64 * 1024))
    assert 0 < len(small) < len(tiles)
    assert heuristic_tile(group, config).block_m == 128


def test_few_rows_tune_without_the_largest_tiles(config) -> None:  # type: ignore[no-untyped-def]
    """A product of 197 rows (ViT's tokens at batch 1) leaves out the 128x128-class tiles, which
    never came within 11% of the best at M <= 256 on the H200 (run 93): fewer compiles, same winner.
    512 rows keep them."""
    from streamfuse.codegen.matmul import candidate_tiles

    def large(t) -> bool:  # type: ignore[no-untyped-def]
        return t.block_m * t.block_n >= 128 * 128

    few, many = (candidate_tiles(_gelu_linear_group(config, rows=r), config) for r in (197, 512))
    assert few and not any(large(t) for t in few)
    assert any(large(t) for t in many) and len(few) < len(many)
    assert any(t.block_m == 64 and t.block_n == 64 and t.split_k == 1 for t in few)


def test_many_rows_tune_without_the_skinny_tiles(config) -> None:  # type: ignore[no-untyped-def]
    """Tiles of at most 32 x 32 never won a product of more than 64 rows on the H200 (run 93): such
    products leave them out; a few rows keep them."""
    from streamfuse.codegen.matmul import candidate_tiles

    def skinny(t) -> bool:  # type: ignore[no-untyped-def]
        return t.block_m <= 32 and t.block_n <= 32

    few, many = (candidate_tiles(_gelu_linear_group(config, rows=r), config) for r in (16, 197))
    assert any(skinny(t) for t in few)
    assert many and not any(skinny(t) for t in many)


@pytest.mark.gpu
def test_autotuning_picks_a_correct_tile_and_caches_it(config) -> None:  # type: ignore[no-untyped-def]
    import math

    from streamfuse.tune import autotune

    lin = torch.nn.Linear(256, 384).to(device="cuda", dtype=torch.bfloat16)
    x = randn(96, 256, dtype=torch.bfloat16, device="cuda")
    config = config.replace(autotune=True)
    compiled = compile_and_check(lambda t: F.gelu(lin(t)), [x], _triton(config))
    group = next(g for g in compiled.plan.groups if g.kind is GroupKind.MATMUL)
    kernel = compiled.steps[compiled.plan.groups.index(group)].kernel
    source, us = autotune.tune_matmul(group, compiled.sources[group.id], kernel, config, torch.device("cuda"))
    assert math.isfinite(us) and source.constexprs == compiled.sources[group.id].constexprs  # from the cache
    key = next(k for k in autotune.load_cache(config.cache_dir) if source.fn_name in k)
    tried = autotune.load_cache(config.cache_dir)[key]["tried"]
    assert len(tried) >= 8 and min(v for v in tried.values() if v is not None) == pytest.approx(us)
    # give_up_us below the heuristic tile's time: that tile back, untuned and not cached
    fresh = config.replace(cache_dir=config.cache_dir / "fresh")
    quick, quick_us = autotune.tune_matmul(group, compiled.sources[group.id], kernel, fresh, torch.device("cuda"),
                                           give_up_us=0.0)
    heuristic = autotune.heuristic_tile(group, fresh)
    tuned_anyway = autotune.load_cache(fresh.cache_dir)  # names why the heuristic tile failed, if it did
    assert math.isfinite(quick_us) and quick.constexprs == autotune.with_tile(source, group, heuristic).constexprs, \
        tuned_anyway
    assert not tuned_anyway
    # a tile whose results disagree with the expected ones scores as infinitely slow
    args = autotune.kernel_args(source, torch.device("cuda"))
    wrong = [torch.full_like(t, 7.0) for t in autotune._outputs(source, args)]
    assert math.isinf(autotune.time_tile(kernel, source, args, wrong))


@pytest.mark.gpu
def test_several_kernels_tuned_in_one_pool(config) -> None:  # type: ignore[no-untyped-def]
    """tune_matmuls: three template kernels, two of them the same (a repeated layer), tuned together:
    one cache entry per distinct kernel, the same tile for both copies, each result within the
    tolerance of eager (compile_and_check), and a give-up that leaves its kernel untuned."""
    import math

    from streamfuse.tune import autotune

    bf16 = torch.bfloat16
    a, b = (torch.nn.Linear(256, 256).to(device="cuda", dtype=bf16) for _ in range(2))
    c = torch.nn.Linear(256, 128).to(device="cuda", dtype=bf16)
    x = randn(64, 256, dtype=bf16, device="cuda")
    compiled = compile_and_check(lambda t: c(F.gelu(b(F.gelu(a(t))))), [x], _triton(config))
    groups = [g for g in compiled.plan.groups if g.kind is GroupKind.MATMUL]
    if len(groups) < 3:
        pytest.skip(f"the plan has {len(groups)} template kernels on this GPU")
    fresh = config.replace(cache_dir=config.cache_dir / "pool")
    jobs = [autotune.TuneJob(g, compiled.sources[g.id], compiled.steps[compiled.plan.groups.index(g)].kernel)
            for g in groups]
    got = autotune.tune_matmuls(jobs, fresh, torch.device("cuda"))
    assert len(got) == len(jobs) and all(math.isfinite(us) for _, us in got)
    names = [j.source.fn_name for j in jobs]
    entries = [k for k, v in autotune.load_cache(fresh.cache_dir).items() if "tile" in v]
    assert len(entries) == len(set(names))
    for i, j in ((i, j) for i in range(len(jobs)) for j in range(i) if names[i] == names[j]):
        assert got[i][0].constexprs == got[j][0].constexprs and got[i][1] == got[j][1]
    quick = config.replace(cache_dir=config.cache_dir / "quick")
    untuned = autotune.tune_matmuls([autotune.TuneJob(j.group, j.source, j.kernel, give_up_us=0.0) for j in jobs],
                                    quick, torch.device("cuda"))
    assert all(math.isfinite(us) for _, us in untuned)
    assert not autotune.load_cache(quick.cache_dir), [v.get("heuristic_failed") for v in autotune.load_cache(
        quick.cache_dir).values()]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bmm_with_epilogue(dtype: torch.dtype, config, device) -> None:  # type: ignore[no-untyped-def]
    fn = lambda a, b, r: torch.relu(torch.bmm(a, b) * 0.5 + r)
    inputs = [randn(3, 20, 24, dtype=dtype, device=device), randn(3, 24, 18, dtype=dtype, device=device, seed=1),
              randn(3, 20, 18, dtype=dtype, device=device, seed=2)]
    compiled = compile_and_check(fn, inputs, _triton(config))
    assert _kinds(compiled) == [GroupKind.MATMUL]


def test_attention_scores_fuse_their_scale(config, device) -> None:  # type: ignore[no-untyped-def]
    """q @ k^T over [batch, heads, T, D] becomes a bmm of stacked heads read in place (k transposed by
    strides); the scale and the additive mask fuse into the softmax's prologue, so the whole thing is
    two launches, and the refusal says why the softmax is not in the matmul's epilogue."""
    fn = lambda q, k, m: torch.softmax(q @ k.transpose(-1, -2) * 0.125 + m, dim=-1)
    inputs = [randn(2, 3, 10, 16, device=device), randn(2, 3, 10, 16, device=device, seed=1),
              randn(10, 10, device=device, seed=2)]
    compiled = compile_and_check(fn, inputs, _triton(config))
    assert _kinds(compiled) == [GroupKind.MATMUL, GroupKind.REDUCTION]
    softmax = compiled.plan.groups[-1]
    assert {"aten.mul.Tensor", "aten.add.Tensor"} <= {n.op for n in softmax.nodes}
    assert any("reduction in a matmul epilogue" in r.reason for r in compiled.plan.refusals)


@pytest.mark.gpu
def test_profile_guided_measures_both_strategies(config) -> None:  # type: ignore[no-untyped-def]
    lin = torch.nn.Linear(512, 768).to(device="cuda", dtype=torch.bfloat16)
    guided = config.replace(profile_guided=True)
    compiled = compile_and_check(lambda t: F.gelu(lin(t)), [randn(64, 512, dtype=torch.bfloat16, device="cuda")],
                                 guided)
    (choice,) = compiled.plan.matmul_choices.values()
    assert choice.measured and choice.reason.startswith("measured")
    assert choice.cublas_us > 0 and choice.triton_us > 0
    expected = GroupKind.MATMUL if choice.strategy == "triton" else GroupKind.ATEN
    assert _kinds(compiled)[0] is expected


@pytest.mark.parametrize("template_us,cublas_us,expected", [(5.0, 40.0, "triton"), (58.0, 26.0, "cublas")])
def test_checked_templates_go_to_cublas_where_it_measured_faster(template_us: float, cublas_us: float, expected: str,
                                                                monkeypatch, config) -> None:  # type: ignore[no-untyped-def]
    """Config.check_templates: a product the cost model gave the template is tuned as planned and
    cuBLAS is timed alone; the measured decision replaces the prediction, and the plan made again
    from it runs the product through cuBLAS and the epilogue in a kernel of its own where cuBLAS
    won (the GPU timings stubbed here with GPT-2's run-93 numbers; the GPU test times them)."""
    from streamfuse.fusion.planner import plan_fusion
    from streamfuse.tune import autotune

    bf16 = torch.bfloat16
    lin = torch.nn.Linear(64, 96).to(dtype=bf16)
    compiled = compile_and_check(lambda x: F.gelu(lin(x)), [randn(32, 64, dtype=bf16)], config.replace(
        triton_matmul_efficiency=2.0))  # the model predicts the template
    (node, predicted), = compiled.plan.matmul_choices.items()
    assert predicted.strategy == "triton" and not predicted.measured
    timed: list[str] = []
    monkeypatch.setattr(autotune, "tune_matmuls",
                        lambda jobs, *a, **k: [(timed.append(j.group.name), (j.source, template_us))[1] for j in jobs])
    monkeypatch.setattr(autotune, "aten_us", lambda n, *a: cublas_us)
    choices, changed = autotune.check_templates(compiled.plan, compiled.plan.matmul_choices, config,
                                                compiled.base.ceilings, torch.device("cpu"), lambda src: None)
    assert len(timed) == 1 and changed == (expected == "cublas")
    assert choices[node].measured and choices[node].strategy == expected
    assert (choices[node].triton_us, choices[node].cublas_us) == (template_us, cublas_us)
    plan = plan_fusion(compiled.plan.graph, config, choices)
    kinds = [g.kind for g in plan.groups if g.kind is not GroupKind.ALIAS]
    assert kinds == ([GroupKind.MATMUL] if expected == "triton" else [GroupKind.ATEN, GroupKind.POINTWISE])
    # nothing predicted for the template, or a strategy forced: nothing is timed
    timed.clear()
    forced = config.replace(matmul_strategy="triton")
    assert autotune.check_templates(compiled.plan, compiled.plan.matmul_choices, forced, compiled.base.ceilings,
                                    torch.device("cpu"), lambda src: None) == (compiled.plan.matmul_choices, False)
    assert not timed


@pytest.mark.parametrize("template_us,cublas_us,epilogue_us,expected", [
    (29.6, 20.9, 9.7, "cublas"),   # run 171: bert-base 8x128's 768 -> 3072 + GELU, TF32
    (11.2, 10.6, 1.5, "triton"),   # run 171: bert-base 1x128's 3072 -> 768 + residual, TF32
    (40.0, 20.0, 30.0, "triton"),  # a large template clearly ahead keeps it
])
def test_a_large_measured_template_must_win_by_the_margin(template_us: float, cublas_us: float, epilogue_us: float,
                                                          expected: str) -> None:
    """Config.matmul_template_margin: a measured template of at least matmul_template_margin_from_us
    is kept only where it beats cuBLAS plus the epilogue kernel by the margin (tuned alone on a hot
    L2 it ran slower inside the plan: run 171, bert-base, distilbert and roberta at 8x128 4.9-5.8%
    faster with their FFN products on cuBLAS); a small one, where the template's chained launches
    gain inside a plan, only has to be faster (bert-base at 1x128: 3.4% slower on cuBLAS)."""
    config = Config()
    choice = decide(cublas_us, epilogue_us, template_us, measured=True, has_epilogue=True, config=config)
    assert choice.strategy == expected
    assert ("matmul_template_margin" in choice.reason) == (expected == "cublas")
    # the margin is for measurements only, and 1.0 restores the plain comparison
    assert decide(cublas_us, epilogue_us, template_us, measured=False, has_epilogue=True,
                  config=config).strategy == "triton"
    assert decide(cublas_us, epilogue_us, template_us, measured=True, has_epilogue=True,
                  config=config.replace(matmul_template_margin=1.0)).strategy == "triton"


@pytest.mark.gpu
def test_checked_templates_are_measured_on_the_gpu(config) -> None:  # type: ignore[no-untyped-def]
    """The default config on the GPU: a predicted template for a bf16 Linear + GELU is timed against
    cuBLAS (the model made to predict the template), and whichever runs matches eager."""
    lin = torch.nn.Linear(512, 768).to(device="cuda", dtype=torch.bfloat16)
    compiled = compile_and_check(lambda t: F.gelu(lin(t)), [randn(64, 512, dtype=torch.bfloat16, device="cuda")],
                                 config.replace(autotune=True, check_templates=True, triton_matmul_efficiency=2.0))
    (choice,) = compiled.plan.matmul_choices.values()
    assert choice.measured and choice.reason.startswith("measured") and choice.cublas_us > 0 and choice.triton_us > 0
    assert _kinds(compiled)[0] is (GroupKind.MATMUL if choice.strategy == "triton" else GroupKind.ATEN)
    assert "template check" in compiled.stats["compile_stages_s"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,k", [(1, 700), (5, 1024), (8, 333)])
def test_skinny_products_split_k_with_the_epilogue_in_the_last_program(m: int, k: int, dtype: torch.dtype,
                                                                        config, device) -> None:  # type: ignore[no-untyped-def]
    """A batch-size M with a deep K: the heuristic tile splits K (few output tiles leave SMs idle);
    the last program of each tile sums the partials and applies bias + GELU."""
    lin = torch.nn.Linear(k, 40).to(device=device, dtype=dtype)
    fn = lambda x: F.gelu(lin(x)) * 2.0
    compiled = compile_and_check(fn, [randn(m, k, dtype=dtype, device=device)], _triton(config))
    (group,) = [g for g in compiled.plan.groups if g.kind is GroupKind.MATMUL]
    assert compiled.sources[group.id].constexprs["SPLIT_K"] > 1


def test_split_k_results_do_not_depend_on_the_split_and_counters_reset(config, device) -> None:  # type: ignore[no-untyped-def]
    """Every split computes the same function; launching twice with the same scratch gives identical
    results (the last program reset its tile counters), and the sum is in split order (deterministic)."""
    import dataclasses

    from streamfuse.codegen.matmul import heuristic_tile, with_tile

    k = 520
    w = randn(k, 24, device=device, seed=12)
    b = randn(24, device=device, seed=13)
    fn = lambda x: torch.relu(torch.addmm(b, x, w))
    x = randn(3, k, device=device)
    compiled = compile_and_check(fn, [x], _triton(config))
    (group,) = [g for g in compiled.plan.groups if g.kind is GroupKind.MATMUL]
    step = compiled.steps[compiled.plan.groups.index(group)]
    expected = torch.relu(torch.addmm(b.double(), x.double(), w.double())).float()
    base = heuristic_tile(group, config, sm_count=132)
    for split in (1, 2, 4, 8, 16):
        source = with_tile(compiled.sources[group.id], group, dataclasses.replace(base, split_k=split, num_stages=1))
        scratch = source.scratch_tensors(device)
        results = []
        for _ in range(2):
            out = torch.full((3, 24), float("nan"), device=device)
            args = []
            for node, dims in zip(source.inputs, source.input_stride_dims, strict=True):
                t = {(3, k): x, (k, 24): w, (24,): b}[node.shape]  # the three shapes differ
                args += [t, *[t.stride(d) for d in dims]]
            step.kernel[source.grid](*args, out, *scratch, num_warps=source.num_warps,
                                     num_stages=source.num_stages, **source.constexprs)
            results.append(out.clone())
        assert torch.equal(results[0], results[1]), f"split {split}: second launch differs"
        if split > 1:
            assert int(scratch[1].abs().sum()) == 0, f"split {split}: tile counters not reset"
        torch.testing.assert_close(results[0], expected, rtol=1e-4, atol=1e-4)


def test_candidates_include_split_k_for_skinny_products(config) -> None:  # type: ignore[no-untyped-def]
    from streamfuse.codegen.matmul import candidate_tiles, heuristic_tile
    from streamfuse.fusion.geometry import fill_split

    group = _gelu_linear_group(config, rows=8)
    tiles = candidate_tiles(group, config, sm_count=132)
    assert {t.split_k for t in tiles} >= {1, 2, 4}
    for t in tiles:  # no split leaves a slice without K steps
        assert t.split_k <= -(-4096 // t.block_k)
    h = heuristic_tile(group, config, sm_count=132)
    assert (h.block_m, h.block_n, h.split_k) == (16, 64, 8)  # 64 tiles x 8 = 512 programs >= 2 per SM
    assert fill_split(64, 64, 1000, 32) == 32  # capped at Config.matmul_max_split_k
    assert fill_split(64, 1, 1000, 32) == 1  # one K step: nothing to split
    assert fill_split(64, 6, 132, 32) == 4  # no more slices than K steps
    assert fill_split(16384, 64, 132, 32) == 1  # the output tiles fill the GPU
    off = config.replace(matmul_max_split_k=1)  # split-K off: no candidate splits K
    assert {t.split_k for t in candidate_tiles(group, off, sm_count=132)} == {1}
    assert heuristic_tile(group, off, sm_count=132).split_k == 1
    with pytest.raises(ValueError, match="matmul_max_split_k"):
        config.replace(matmul_max_split_k=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [64, 600])
def test_one_row_products_use_the_matrix_vector_loop(k: int, dtype: torch.dtype, config, device) -> None:  # type: ignore[no-untyped-def]
    """Batch-1 Linear layers: no tl.dot (BLOCK_M = 1), split over K where the row has few tiles,
    bias + ReLU fused; also through a transposed weight and a residual."""
    lin = torch.nn.Linear(k, 96).to(device=device, dtype=dtype)
    fn = lambda x, r: torch.relu(lin(x)) + r
    inputs = [randn(1, k, dtype=dtype, device=device), randn(1, 96, dtype=dtype, device=device, seed=3)]
    compiled = compile_and_check(fn, inputs, _triton(config))
    (group,) = [g for g in compiled.plan.groups if g.kind is GroupKind.MATMUL]
    source = compiled.sources[group.id]
    assert source.constexprs["BLOCK_M"] == 1 and "tl.dot" not in source.source
    assert source.constexprs["SPLIT_K"] > 1 or k == 64


def test_one_row_bmm(config, device) -> None:  # type: ignore[no-untyped-def]
    fn = lambda a, b: torch.sigmoid(torch.bmm(a, b))
    compile_and_check(fn, [randn(3, 1, 70, device=device), randn(3, 70, 20, device=device, seed=1)], _triton(config))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
def test_split_k_graph_replays_match_eager_on_fresh_inputs(m: int, config) -> None:  # type: ignore[no-untyped-def]
    """The split-K counters and workspace are reused by every replay of the CUDA graph: results must
    match eager on fresh random inputs every time (a missed reset or a race shows up as a moving error)."""
    lin1 = torch.nn.Linear(2048, 512).to("cuda")
    lin2 = torch.nn.Linear(512, 256).to("cuda")
    model = lambda x: torch.relu(lin2(torch.relu(lin1(x))))
    compiled = compile_and_check(model, [randn(m, 2048, device="cuda")], _triton(config))
    splits = [compiled.sources[g.id].constexprs["SPLIT_K"] for g in compiled.plan.groups if g.kind is GroupKind.MATMUL]
    assert max(splits) > 1
    with torch.no_grad():
        for i in range(30):
            x = randn(m, 2048, device="cuda", seed=100 + i)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    assert compiled.stats["graphs"] == 1  # the calls above replayed one recorded graph


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("weight", ["linear", "row_major"])
def test_tensor_descriptor_loads(weight: str, dtype: torch.dtype, config, device) -> None:  # type: ignore[no-untyped-def]
    """Config.matmul_tma: A and B arrive through tensor descriptors ("nk": a Linear weight read
    transposed; "kn": a row-major [K, N] matrix); uneven M, N and K are zero-filled by the loads,
    split-K included."""
    from streamfuse.codegen.matmul import tma_layout

    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("tensor descriptors need compute capability 9.0+")
    tma = _triton(config).replace(matmul_tma=True)
    if weight == "linear":
        lin = torch.nn.Linear(600, 48).to(device=device, dtype=dtype)
        fn = lambda x: F.gelu(lin(x)) + 1.0
    else:
        w = randn(600, 48, dtype=dtype, device=device, seed=4)
        fn = lambda x: torch.relu(x @ w)
    for m in (37, 8):
        compiled = compile_and_check(fn, [randn(m, 600, dtype=dtype, device=device)], tma)
        (group,) = [g for g in compiled.plan.groups if g.kind is GroupKind.MATMUL]
        source = compiled.sources[group.id]
        assert tma_layout(group.contraction) == ("nk" if weight == "linear" else "kn")
        assert source.descriptors and "tl.make_tensor_descriptor" in source.source
        assert source.constexprs["SPLIT_K"] > 1 or m == 37


def test_tensor_descriptors_only_where_they_apply(config, device) -> None:  # type: ignore[no-untyped-def]
    """float32, one-row products and operands without a unit inner stride keep the pointer loops."""
    tma = _triton(config).replace(matmul_tma=True)
    w = randn(40, 24, device=device, seed=5)
    for fn, x in ((lambda t: torch.relu(t @ w), randn(9, 40, device=device)),  # float32
                  (lambda t: torch.relu(t @ w.half()), randn(1, 40, dtype=torch.float16, device=device)),  # one row
                  (lambda t: torch.relu(t.t() @ w.half()), randn(40, 9, dtype=torch.float16, device=device))):  # A^T
        compiled = compile_and_check(fn, [x], tma)
        (group,) = [g for g in compiled.plan.groups if g.kind is GroupKind.MATMUL]
        assert not compiled.sources[group.id].descriptors


@pytest.mark.parametrize("m, n", [(1, 8), (3, 8), (4, 1)])
def test_epilogue_over_the_product_viewed_with_trailing_ones(m: int, n: int, config, device) -> None:  # type: ignore[no-untyped-def]
    """An epilogue operand read at [M, N, 1, 1] (the product viewed back to a 1x1 image) gets the tile's
    column for N's dim and 0 for the trailing ones (N = 1 included, where is_tile_shape keeps them)."""
    w = randn(16, n, device=device, seed=21)
    c = randn(1, n, 1, 1, device=device, seed=22)
    fn = lambda x: torch.relu(torch.mm(x, w).view(m, n, 1, 1) + c)
    compiled = compile_and_check(fn, [randn(m, 16, device=device)], _triton(config))
    assert GroupKind.MATMUL in _kinds(compiled)
    assert len([k for k in _kinds(compiled) if k is not GroupKind.MATMUL]) == 0, compiled.explain(source=False)
