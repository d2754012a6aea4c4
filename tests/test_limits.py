"""Resource limits in fusion decisions (fusion/geometry.py) and the matmul strategy's cost model
(fusion/strategy.py): refusals carry their numbers, the split remedy keeps results right."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import compile_and_check, randn

import streamfuse
from streamfuse.fusion.geometry import Resources, estimate, pointwise_launch, reduction_launch, resource_refusal
from streamfuse.fusion.groups import GroupKind, ReductionDomain
from streamfuse.fusion.strategy import decide, predict
from streamfuse.tune.ceilings import builtin_for


def chain(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x * y + z) * x - torch.tanh(z)


def test_hard_limits_refuse_with_their_numbers(config) -> None:  # type: ignore[no-untyped-def]
    fused = Resources(threads=128, registers=300, shared_bytes=0)
    reason = resource_refusal(fused, [], config)
    assert reason is not None and "300 registers" in reason and "255" in reason
    big = Resources(threads=128, registers=40, shared_bytes=64 * 1024)
    reason = resource_refusal(big, [], config)
    assert reason is not None and "64.0 KB" in reason and "48 KB" in reason
    assert resource_refusal(Resources(threads=128, registers=40, shared_bytes=0), [], config) is None


def test_occupancy_rule_compares_with_the_replaced_kernels(config) -> None:  # type: ignore[no-untyped-def]
    light = Resources(threads=128, registers=32, shared_bytes=0)  # 100% occupancy on sm_90
    heavy = Resources(threads=128, registers=128, shared_bytes=0)  # 25%
    reason = resource_refusal(heavy, [(light, 1.0)], config)
    assert reason is not None and "25%" in reason and "100%" in reason
    assert resource_refusal(heavy, [(light, 1.0)], config.replace(max_occupancy_drop=0.8)) is None
    assert resource_refusal(light, [(heavy, 1.0)], config) is None  # fusion raising occupancy is fine


def test_planner_refuses_over_the_register_cap(config, device) -> None:  # type: ignore[no-untyped-def]
    xs = [randn(64, 96, device=device, seed=i) for i in range(3)]
    tight = config.replace(max_registers_per_thread=30)
    compiled = compile_and_check(chain, xs, tight)
    reasons = [r.reason for r in compiled.plan.refusals]
    assert any(r.startswith("resources: needs ~") and "max_registers_per_thread=30" in r for r in reasons)
    assert compiled.stats["kernels"] > 1
    assert compile_and_check(chain, xs, config).stats["kernels"] == 1


def test_split_keeps_the_fusion_and_the_results(config, device) -> None:  # type: ignore[no-untyped-def]
    xs = [randn(64, 96, device=device, seed=i) for i in range(3)]
    strict = config.replace(max_occupancy_drop=0.0)  # any estimated loss triggers the remedy
    compiled = compile_and_check(chain, xs, strict)
    groups = [g for g in compiled.plan.groups if g.kind is GroupKind.POINTWISE]
    assert len(groups) == 1 and groups[0].split > 1  # still one kernel, with less work per thread
    for g in groups:  # the launch geometry codegen used is the one the planner checked
        block, warps = pointwise_launch(64 * 96, strict, g.split)
        assert compiled.sources[g.id].constexprs["BLOCK"] == block and compiled.sources[g.id].num_warps == warps


def test_split_divides_work_per_thread(config) -> None:  # type: ignore[no-untyped-def]
    b1, w1 = pointwise_launch(1 << 20, config, 1)
    b2, w2 = pointwise_launch(1 << 20, config, 2)
    assert w1 == w2 and b2 == b1 // 2
    dom = ReductionDomain(shape=(4096, 4096), dims=(1,))
    _, _, warps1 = reduction_launch(dom, config, 132, 1)
    _, _, warps2 = reduction_launch(dom, config, 132, 2)
    assert warps2 == min(config.reduction_max_warps, 2 * warps1)


def test_a_reduction_grid_smaller_than_the_gpu_gives_each_row_more_warps(config) -> None:  # type: ignore[no-untyped-def]
    """A layer norm at batch 1 (one row, or 128 rows of 768, on 132 SMs) is latency-bound: at most
    Config.reduction_small_grid_elems_per_thread elements per thread. A grid that fills the GPU keeps
    the register budget (reduction_elems_per_thread)."""
    for rows in (1, 128):
        block_m, block_r, warps = reduction_launch(ReductionDomain(shape=(rows, 768), dims=(1,)), config, 132)
        assert math.ceil(rows / block_m) < 132 and block_r == 1024
        assert block_m * block_r // (32 * warps) == config.reduction_small_grid_elems_per_thread
        _, _, fewer = reduction_launch(ReductionDomain(shape=(rows, 768), dims=(1,)),
                                       config.replace(reduction_small_grid_elems_per_thread=16,
                                                      reduction_elems_per_thread=16), 132)
        assert fewer == warps // 4
    block_m, block_r, warps = reduction_launch(ReductionDomain(shape=(301056, 49), dims=(1,)), config, 132)
    assert block_m * block_r // (32 * warps) == config.reduction_short_row_elems_per_thread


def test_estimates_grow_with_live_tiles(config) -> None:  # type: ignore[no-untyped-def]
    x = streamfuse.compile(chain, tuple(randn(8, 8, seed=i) for i in range(3)), config.replace(executor="reference"))
    g = next(g for g in x.plan.groups if g.kind is GroupKind.POINTWISE)
    small = estimate(GroupKind.POINTWISE, g.inputs[:1], g.outputs, g.shape, None, 0, config, 132)
    large = estimate(GroupKind.POINTWISE, g.inputs, g.outputs, g.shape, None, 0, config, 132)
    assert large.registers > small.registers and large.occupancy().occupancy <= small.occupancy().occupancy
    mm = estimate(GroupKind.MATMUL, g.inputs, g.outputs, (128, 128), None, 0, config, 132,
                  matmul_tile=(128, 128, 64, 8, 3), itemsize=2)
    assert mm.shared_bytes == 3 * (128 * 64 + 64 * 128) * 2


@pytest.mark.parametrize("m", [8, 512, 4096])
def test_cost_model_matches_the_h200_measurements(m: int, config) -> None:  # type: ignore[no-untyped-def]
    """The priors were fitted to benchmarks/epilogue.py on the H200 (docs/PERF.md, runs 16 and 18):
    the predictions stay within 12% of what was measured, and pick the faster strategy each time
    (split-K makes the template the faster one at batch 8)."""
    # cuBLAS alone, template with its epilogue, cuBLAS + epilogue kernel (run 18, graph replay)
    measured = {8: (9.3, 8.9, 10.8), 512: (24.2, 31.2, 28.8), 4096: (172.9, 264.7, 217.2)}
    lin = torch.nn.Linear(4096, 4096).to(torch.bfloat16)
    compiled = streamfuse.compile(lambda x: F.gelu(lin(x)), (randn(m, 4096, dtype=torch.bfloat16),),
                                  config.replace(executor="reference"))
    (node,) = compiled.plan.matmul_choices
    choice = predict(node, builtin_for("NVIDIA H200"), config)
    cublas, template, cublas_epilogue = measured[m]
    assert choice.cublas_us == pytest.approx(cublas, rel=0.12)
    assert choice.triton_us == pytest.approx(template, rel=0.12)
    assert choice.strategy == ("triton" if template < cublas_epilogue else "cublas")


def test_decide_rules(config) -> None:  # type: ignore[no-untyped-def]
    assert decide(10, 5, 12, False, True, config).strategy == "triton"
    assert decide(10, 1, 12, False, True, config).strategy == "cublas"
    no_epilogue = decide(10, 0, 1, False, False, config)
    assert no_epilogue.strategy == "cublas" and "no pointwise epilogue" in no_epilogue.reason
    fp32 = decide(10, 5, 1, False, True, config, tensor_cores=False)
    assert fp32.strategy == "cublas" and "float32" in fp32.reason
    assert decide(10, 5, 1, True, True, config, tensor_cores=False).strategy == "triton"  # measured wins
    forced = decide(1, 1, 100, False, True, config.replace(matmul_strategy="triton"))
    assert forced.strategy == "triton" and "forced" in forced.reason


def test_float32_one_row_products_may_use_the_template(config) -> None:  # type: ignore[no-untyped-def]
    """The float32 rule keeps cuBLAS for products on the IEEE tl.dot path; a batch-1 Linear uses the
    matrix-vector loop instead, so the cost model decides it (and picks the fused kernel: no
    epilogue round trip, one launch less)."""
    lin = torch.nn.Linear(1024, 1024)
    for m, strategy in ((1, "triton"), (8, "cublas")):
        compiled = streamfuse.compile(lambda x: torch.relu(lin(x)), (randn(m, 1024),), config.replace(executor="reference"))
        (node,) = compiled.plan.matmul_choices
        choice = predict(node, builtin_for("NVIDIA H200"), config)
        assert choice.strategy == strategy, choice.reason
        assert ("float32" in choice.reason) == (m != 1)


def test_short_rows_share_a_tile_of_reduction_tile_elems(config) -> None:  # type: ignore[no-untyped-def]
    """Rows shorter than Config.reduction_tile_elems share one program's tile at
    reduction_short_row_elems_per_thread, one warp per 64 columns (run 163: swin_t's window softmax
    over 49, ViT-B's over 197); longer rows keep the rule of reduction_elems_per_thread, which gives
    a layer norm over 4096 16 warps (run 163: 12.5 µs against 13.3 at 8)."""
    for shape, want in (((301056, 49), (8, 64, 1)), ((75648, 197), (4, 256, 2)), ((12288, 128), (8, 128, 2)),
                        ((6304, 768), (2, 1024, 8)), ((1024, 4096), (1, 4096, 16)), ((4096, 16384), (1, 16384, 16))):
        assert reduction_launch(ReductionDomain(shape=shape, dims=(1,)), config, 132) == want, shape
    # the planner's split divides each thread's elements: fewer rows per program on one warp
    assert reduction_launch(ReductionDomain(shape=(301056, 49), dims=(1,)), config, 132, 2) == (4, 64, 1)
    # too few rows to fill the GPU: fewer per program, never an idle warp
    assert reduction_launch(ReductionDomain(shape=(100, 49), dims=(1,)), config, 132) == (1, 64, 1)
    every_row_long = config.replace(reduction_tile_elems=1)  # the rule before run 163
    assert reduction_launch(ReductionDomain(shape=(75648, 197), dims=(1,)), every_row_long, 132) == (8, 256, 8)
    with pytest.raises(ValueError, match="reduction_tile_elems"):
        config.replace(reduction_tile_elems=0)
