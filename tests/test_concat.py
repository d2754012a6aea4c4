"""torch.cat generated inside fused kernels (OpKind.CONCAT): each output element is read from one
input at its offset along the cat dim, under a guard that masks the other inputs' loads. Producers
of the inputs and consumers of the result (pointwise, reductions) fuse through it."""

from __future__ import annotations

import pytest
import torch
from helpers import compile_and_check, randn

from streamfuse.fusion.groups import GroupKind
from streamfuse.fusion.legality import check_group
from streamfuse.ir.ops import OpKind, kind_of


def cat_groups(compiled) -> list:  # type: ignore[no-untyped-def]
    return [g for g in compiled.plan.groups if any(n.kind is OpKind.CONCAT for n in g.nodes)]


def test_cat_is_its_own_op_kind() -> None:
    assert kind_of("aten.cat.default") is OpKind.CONCAT and OpKind.CONCAT.fusible


def test_epilogues_cat_and_a_reduction_tail_are_one_kernel(config, device) -> None:  # type: ignore[no-untyped-def]
    """The inception tail: per-branch pointwise, cat on channels, residual, per-channel mean."""

    def tail(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([torch.relu(a + 1), b * 2, torch.sigmoid(c)], dim=1)
        return torch.relu(y + x) * torch.sigmoid(y.mean(dim=(2, 3), keepdim=True))

    inputs = [randn(2, 3, 5, 7, device=device, seed=1), randn(2, 4, 5, 7, device=device, seed=2),
              randn(2, 1, 5, 7, device=device, seed=3), randn(2, 8, 5, 7, device=device, seed=4)]
    compiled = compile_and_check(tail, inputs, config)
    assert compiled.stats["kernels"] == 1 and compiled.stats["aten_kernels"] == 0
    (group,) = compiled.plan.groups
    assert group.kind is GroupKind.REDUCTION and "aten.cat.default" in {n.op for n in group.nodes}
    # fresh random inputs: every branch's lanes are read from the right input
    fresh = [torch.randn_like(t) for t in inputs]
    torch.testing.assert_close(compiled(*fresh), tail(*fresh), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cat_alone_is_a_generated_kernel_along_any_dim(config, device, dim: int) -> None:  # type: ignore[no-untyped-def]
    shapes = {0: [(2, 6, 5), (3, 6, 5)], 1: [(2, 1, 5), (2, 4, 5), (2, 2, 5)], -1: [(2, 6, 3), (2, 6, 9)]}[dim]
    inputs = [randn(*s, device=device, seed=i) for i, s in enumerate(shapes)]
    fn = lambda *ts: torch.cat(ts, dim=dim)
    compiled = compile_and_check(fn, inputs, config)
    assert compiled.stats["aten_kernels"] == 0 and len(cat_groups(compiled)) == 1


def test_cat_reads_non_contiguous_inputs_and_promotes_dtypes(config, device) -> None:  # type: ignore[no-untyped-def]
    a = randn(5, 4, device=device, seed=5).t()  # [4, 5], strides (1, 4)
    b = randn(3, 5, dtype=torch.float16, device=device, seed=6)
    compiled = compile_and_check(lambda a, b: torch.cat([a, b]) * 3, [a, b], config)
    assert compiled.stats["kernels"] == 1
    assert compiled(a, b).dtype == torch.float32


def test_a_fixed_position_along_the_cat_dim_reads_one_input(config, device) -> None:  # type: ignore[no-untyped-def]
    a, b = randn(3, 4, device=device, seed=7), randn(3, 6, device=device, seed=8)
    compiled = compile_and_check(lambda a, b: torch.cat([a, b], 1)[:, 5] + 1, [a, b], config)
    source = next(iter(compiled.base.sources.values())).source
    assert "tl.where" not in source  # column 5 is b's column 1: no select, no guard
    assert compiled.stats["aten_kernels"] == 0


def test_cat_of_reduced_values_is_refused_and_correct(config, device) -> None:  # type: ignore[no-untyped-def]
    fn = lambda x: torch.cat([x.mean(1, keepdim=True), x.amax(1, keepdim=True)], dim=0) + 1
    compiled = compile_and_check(fn, [randn(6, 10, device=device, seed=9)], config)
    reasons = [r.reason for r in compiled.plan.refusals]
    assert any("derived from a reduction at other positions" in r for r in reasons), reasons


def test_cat_with_an_empty_input_runs_through_aten(config, device) -> None:  # type: ignore[no-untyped-def]
    a, empty = randn(4, 3, device=device, seed=10), torch.empty(0, 3, device=device)
    compiled = compile_and_check(lambda a, e: torch.cat([a, e]) * 2, [a, empty], config)
    (group,) = cat_groups(compiled)
    assert group.kind is GroupKind.ATEN and "empty" in group.note


def test_cat_in_a_matmul_epilogue_is_refused(config, device) -> None:  # type: ignore[no-untyped-def]
    cfg = config.replace(matmul_strategy="triton")
    a, w, r1, r2 = (randn(8, 16, device=device, seed=11), randn(16, 12, device=device, seed=12),
                    randn(8, 5, device=device, seed=13), randn(8, 7, device=device, seed=14))
    compiled = compile_and_check(lambda a, w, r1, r2: a @ w + torch.cat([r1, r2], 1), [a, w, r1, r2], cfg)
    mm = next(g for g in compiled.plan.groups if g.kind is GroupKind.MATMUL)
    assert not any(n.kind is OpKind.CONCAT for n in mm.nodes)
    union = _with_cat(compiled)
    assert "cat in a matmul epilogue" in str(check_group(union, set(compiled.plan.graph.output_nodes), cfg))


def _with_cat(compiled) -> list:  # type: ignore[no-untyped-def]
    """The matmul group's nodes plus the cat group's, in graph order."""
    order = {n: i for i, n in enumerate(compiled.plan.graph.nodes)}
    mm = next(g for g in compiled.plan.groups if g.kind is GroupKind.MATMUL)
    return sorted(mm.nodes + cat_groups(compiled)[0].nodes, key=order.__getitem__)
