"""Max pooling generated as a WINDOW op (ir/lowerings.py lowers max_pool2d_with_indices when its
indices are unread): each tap is a shifted load masked at the borders, padding counts as -inf, NaN
propagates as in ATen, and pointwise producers and consumers may fuse with it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_to_reference, randn

import streamfuse
from streamfuse.ir.ops import OpKind


def windows(compiled) -> list:  # type: ignore[no-untyped-def]
    return [n for g in compiled.plan.groups for n in g.nodes if n.kind is OpKind.WINDOW]


@pytest.mark.parametrize(("kernel", "stride", "padding", "dilation", "ceil_mode", "shape"), [
    (3, 1, 1, 1, False, (1, 4, 9, 9)),  # the inception branch's pooling
    (3, 2, 1, 1, False, (2, 3, 11, 10)),  # the ResNet stem's
    (2, 2, 0, 1, False, (1, 2, 8, 8)),
    ((3, 2), (2, 1), (1, 0), (2, 1), True, (1, 2, 13, 12)),
    (3, 2, 0, 1, True, (2, 10, 10)),  # 3-D input, windows running past the edge
])
def test_max_pool_is_generated_and_equals_eager(config, device, kernel, stride, padding, dilation, ceil_mode,
                                                shape) -> None:  # type: ignore[no-untyped-def]
    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(torch.relu(x + 0.5), kernel, stride, padding, dilation, ceil_mode=ceil_mode) * 2

    x = randn(*shape, device=device, seed=sum(shape))
    x.view(-1)[3] = float("nan")  # NaN propagates through the window's max
    compiled = streamfuse.compile(fn, (x,), config)
    assert len(windows(compiled)) == 1 and compiled.stats["aten_kernels"] == 0
    torch.testing.assert_close(compiled(x), fn(x), equal_nan=True)
    fresh = torch.randn_like(x)
    torch.testing.assert_close(compiled(fresh), fn(fresh))


def test_max_pool_with_its_indices_read_stays_in_aten(config, device) -> None:  # type: ignore[no-untyped-def]
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = F.max_pool2d(x, 3, 2, 1, return_indices=True)
        return values + 1, indices

    x = randn(1, 3, 8, 8, device=device, seed=1)
    compiled = streamfuse.compile(fn, (x,), config)
    assert not windows(compiled) and "max_pool2d_with_indices" in compiled.explain()
    values, indices = compiled(x)
    ref_values, ref_indices = fn(x)
    torch.testing.assert_close(values, ref_values)
    assert torch.equal(indices, ref_indices)


def test_the_conv_blocks_pooling_branch_is_generated(config, device) -> None:  # type: ignore[no-untyped-def]
    from streamfuse.demo_models import conv_block

    block, inputs = conv_block(device)
    compiled = streamfuse.compile(block, inputs, config.replace(conv_layout="native"))
    (pool,) = windows(compiled)
    assert pool.op == "streamfuse.max_pool2d.default"
    with torch.no_grad():
        x = torch.randn_like(inputs[0])
        tol = 5e-3 if device.type == "cuda" else 1e-4  # cuDNN's TF32 convolutions
        torch.testing.assert_close(compiled(x), block(x), rtol=tol, atol=tol)


def test_batch_buckets_pad_through_a_generated_pool(config, device) -> None:  # type: ignore[no-untyped-def]
    """Pooling keeps rows independent along dim 0: a smaller batch pads up to its bucket."""
    fn = lambda x: F.max_pool2d(x, 2) + 1
    compiled = streamfuse.compile(fn, (randn(4, 2, 6, 6, device=device, seed=2),), config.replace(batch_buckets=(4,)))
    assert compiled.batch_reason is None  # rows proven independent
    x = randn(3, 2, 6, 6, device=device, seed=3)
    torch.testing.assert_close(compiled(x), fn(x))


def test_chained_pools_over_a_cat_are_not_fused_into_one_kernel(config) -> None:  # type: ignore[no-untyped-def]
    """GoogLeNet's pattern: a max pool over a 4-way cat, and a second pool over that one. One kernel
    for all of it recomputes each branch at 9 x 9 taps (its kernel took 496 µs on the H200): the
    planner refuses the fusion for its recomputation (Config.max_recomputed_evaluations), and the
    kernels it keeps stay within the limit."""
    from streamfuse.fusion.geometry import evaluations_per_element

    def f(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        y = torch.cat([torch.relu(a + 1), torch.relu(b * 2), torch.relu(c - 1), torch.relu(d)], dim=1)
        y = F.max_pool2d(y, 3, 2, ceil_mode=True)
        return F.max_pool2d(y, 3, 1, 1)

    xs = [randn(1, 4, 13, 13, seed=i) for i in range(4)]
    compiled = streamfuse.compile(f, xs, config)
    assert_close_to_reference(compiled(*xs), f, xs)
    kernels = [g for g in compiled.plan.groups if g.kind.generated]
    for g in kernels:
        evaluations, distinct = evaluations_per_element(g.nodes)
        assert evaluations - distinct <= config.max_recomputed_evaluations, g.name
    pools = [g for g in kernels if sum(n.op == "aten.max_pool2d.default" for n in g.nodes) == 2]
    assert not pools, "both pools in one kernel"
    assert any("recomputation" in r.reason for r in compiled.plan.refusals)


@pytest.mark.parametrize(("kernel", "stride", "padding", "ceil_mode", "count_include_pad", "divisor", "shape",
                          "generated"), [
    (2, 2, 0, False, True, None, (2, 6, 8, 8), True),  # DenseNet's transitions
    (3, 1, 1, False, True, None, (1, 5, 9, 9), True),  # Inception's branch pooling
    ((3, 2), (2, 1), (1, 0), False, True, None, (1, 3, 11, 10), True),
    (2, 2, 0, True, True, None, (1, 2, 8, 8), True),  # ceil_mode adds no window here
    (3, 2, 1, False, False, 5, (2, 7, 9), True),  # 3-D input, divisor_override
    (3, 2, 1, False, False, None, (1, 3, 9, 9), False),  # border windows divide by their in-bounds count
    (3, 2, 0, True, True, None, (1, 2, 10, 10), False),  # ceil_mode: a window past the edge
])
def test_avg_pool_is_generated_where_every_window_has_one_divisor(config, device, kernel, stride, padding, ceil_mode,
                                                                  count_include_pad, divisor, shape,
                                                                  generated) -> None:  # type: ignore[no-untyped-def]
    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(torch.relu(x + 0.5), kernel, stride, padding, ceil_mode, count_include_pad, divisor) * 2

    x = randn(*shape, device=device, seed=sum(shape))
    compiled = streamfuse.compile(fn, (x,), config)
    pools = [n for n in windows(compiled) if n.op == "streamfuse.avg_pool2d.default"]
    assert len(pools) == int(generated)
    assert (compiled.stats["aten_kernels"] == 0) == generated
    torch.testing.assert_close(compiled(x), fn(x), rtol=1e-5, atol=1e-6)
    fresh = torch.randn_like(x)
    torch.testing.assert_close(compiled(fresh), fn(fresh), rtol=1e-5, atol=1e-6)


def test_avg_pool_of_a_channels_last_input_in_reduced_precision(config, device) -> None:  # type: ignore[no-untyped-def]
    """A channels_last input (DenseNet's transition convolution hands its result on so) pooled in
    bfloat16: the window sums in float32, as ATen does."""
    fn = lambda x: F.avg_pool2d(x * 1.5, 2, 2) + 1
    x = randn(2, 8, 6, 6, device=device, dtype=torch.bfloat16, seed=4).to(memory_format=torch.channels_last)
    compiled = streamfuse.compile(fn, (x,), config)
    assert [n.op for n in windows(compiled)] == ["streamfuse.avg_pool2d.default"]
    torch.testing.assert_close(compiled(x), fn(x), rtol=2e-2, atol=2e-2)


def test_a_branch_pool_reads_its_blocks_stored_cat(config) -> None:  # type: ignore[no-untyped-def]
    """Inception's pattern: a block's 4-way cat of bias + ReLU epilogues, read by other branches and
    by a 3x3 average pool. The pool does not recompute the cat and its epilogues at its 9 taps (56-64
    evaluations per element, over Config.max_recomputed_evaluations): it reads the stored cat."""
    from streamfuse.fusion.geometry import evaluations_per_element

    def f(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.cat([torch.relu(a + 1), torch.relu(b * 2), torch.relu(c - 1), torch.relu(d)], dim=1)
        return y * 3, F.avg_pool2d(y, 3, 1, 1)

    xs = [randn(2, 3, 9, 9, seed=i) for i in range(4)]
    compiled = streamfuse.compile(f, xs, config)
    assert_close_to_reference(compiled(*xs), f, xs)
    kernels = [g for g in compiled.plan.groups if g.kind.generated]
    assert all(evaluations_per_element(g.nodes)[0] - evaluations_per_element(g.nodes)[1]
               <= config.max_recomputed_evaluations for g in kernels)
    (pool,) = [g for g in kernels if any(n.op == "streamfuse.avg_pool2d.default" for n in g.nodes)]
    assert not any(n.op == "aten.cat.default" for n in pool.nodes)
