"""Reductions over rows longer than Config.max_persistent_reduction (fusion/geometry.looped_launch):
one row per program with the threads along it, split across programs where the rows alone do not
fill the GPU, the prologue fused. A training batch norm's backward sums over N, H and W are the
case that matters (resnet50 at batch 32: 100,352 elements per channel); before, they ran as ATen
sums reading full-size intermediates that a pointwise kernel had written out for them.

On the CPU a small max_persistent_reduction makes short rows "long" (Triton's interpreter runs them)
and a 16-SM device keeps the splits few; on the GPU the default limit and rows past it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import streamfuse
from streamfuse.config import Config
from streamfuse.fusion.geometry import long_rows, looped_split
from streamfuse.fusion.groups import GroupKind
from streamfuse.fusion.legality import reduction_domain
from streamfuse.ir.ops import OpKind


def _setup(config: Config, device: torch.device, monkeypatch: pytest.MonkeyPatch) -> tuple[Config, int, int]:
    """(config, sm count, scale of the spatial sizes) for this device."""
    from streamfuse.runtime import executable

    if device.type == "cpu":
        monkeypatch.setattr(executable, "DEFAULT_SM_COUNT", 16)
        return config.replace(max_persistent_reduction=256), 16, 1
    return config, torch.cuda.get_device_properties(device).multi_processor_count, 5  # rows past 16384


def _fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (x.sum(), (x * x).mean((0, 2, 3)), (x - 0.5).amax((0, 2, 3), keepdim=True),
            x.amin((0, 2, 3)), x.sum((2, 3)), x * 2.0)


def test_long_rows_loop_split_and_match_eager(config: Config, device: torch.device,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A total sum, per-channel means/maxima/minima over N, H and W, and a sum over H and W, all
    past the persistent limit: each runs as a generated looped reduction (no ATen sum), at least one
    of them split across programs; results match eager, and a second call gives the same bits (the
    split's partial sums combine in order; its counters were reset)."""
    config, sm_count, scale = _setup(config, device, monkeypatch)
    x = torch.randn(3, 5, 17 * scale, 19 * scale, device=device)
    compiled = streamfuse.compile(_fn, (x,), config)
    groups = compiled.plan.groups
    assert not [g.name for g in groups if g.kind is GroupKind.ATEN], compiled.explain(source=False)
    long = [g for g in groups if g.kind is GroupKind.REDUCTION and long_rows(g.domain, config)]
    assert len(long) >= 2, compiled.explain(source=False)
    assert any(looped_split(g.domain, config, sm_count, g.rows_contiguous)[0] > 1 for g in long)
    first = compiled(x)
    for got, want in zip(first, _fn(x), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    for a, b in zip(first, compiled(x), strict=True):
        assert torch.equal(a, b)


def test_long_rows_in_half_precision_accumulate_in_float32(config: Config, device: torch.device,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 inputs: the loop accumulates in float32, so a sum over thousands of elements keeps
    float32's accuracy before the one rounding of the result."""
    config, _, scale = _setup(config, device, monkeypatch)
    x = torch.rand(4, 3, 16 * scale, 16 * scale, device=device).to(torch.bfloat16)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return (t * 1.5).sum((0, 2, 3))

    compiled = streamfuse.compile(fn, (x,), config)
    (group,) = compiled.plan.groups
    assert group.kind is GroupKind.REDUCTION and long_rows(group.domain, config)
    want = (x.float() * 1.5).sum((0, 2, 3))
    torch.testing.assert_close(compiled(x).float(), want, rtol=8e-3, atol=0)


def test_long_rows_that_need_two_passes_stay_on_aten_with_a_reason(config: Config, device: torch.device,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A variance over long rows needs its mean first: it runs through ATen, and explain() says why;
    with long_row_reduction=False a sum does too. Results match eager either way."""
    config, _, scale = _setup(config, device, monkeypatch)
    x = torch.randn(3, 5, 17 * scale, 19 * scale, device=device)

    def var(t: torch.Tensor) -> torch.Tensor:
        return torch.var(t, dim=(0, 2, 3)) + 1.0

    compiled = streamfuse.compile(var, (x,), config)
    (red,) = [n for n in compiled.plan.graph.nodes if n.kind is OpKind.REDUCTION]
    assert long_rows(reduction_domain(red), config)
    assert "only a sum, mean, amax or amin loops over longer rows" in compiled.explain(source=False)
    torch.testing.assert_close(compiled(x), var(x), rtol=1e-4, atol=1e-4)
    off = streamfuse.compile(_fn, (x,), config.replace(long_row_reduction=False))
    assert "long_row_reduction=False" in off.explain(source=False)
    assert not [g for g in off.plan.groups if g.kind is GroupKind.REDUCTION and long_rows(g.domain, config)]
    for got, want in zip(off(x), _fn(x), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


class _ConvBn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 6, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return self.bn2(self.conv2(y)) + y[:, :6]


@pytest.mark.parametrize("executor", ["reference", "triton"])
def test_batch_norm_backward_sums_loop_and_train_like_eager(config: Config, device: torch.device, executor: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Training a conv/batch-norm/ReLU net through the backend, the backward's per-channel sums over
    N, H and W are past the persistent limit: they run as generated looped reductions with the
    gradient's prologue fused (no ATen sum in the backward), and loss, every gradient, parameter and
    running statistic match eager over three SGD steps. The limit is lowered on the GPU too: with
    rows past 16384 the summation order alone moves the third step's gradients past the tolerance
    (run 195: 2e-5 absolute through the reference executor, whose sums are torch's)."""
    from test_training import train_and_compare

    from streamfuse.capture.backend import compiled_graphs

    config, _, _ = _setup(config, device, monkeypatch)
    config = config.replace(max_persistent_reduction=256)
    # float32 against eager at 1e-4: cuDNN's TF32 (on by default) rounds the convolutions' inputs to
    # 10 bits, and the compiled step's convolutions may run another algorithm or layout than eager's
    # (run 228: conv1's weight gradient 2.7e-4 apart with TF32, through both executors)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    model = _ConvBn().to(device)
    gen = torch.Generator().manual_seed(5)
    side = 16
    batches = [(torch.randn(4, 3, side, side, generator=gen).to(device),) for _ in range(3)]
    first = len(compiled_graphs)
    train_and_compare(model, batches, lambda m, x: m(x).square().mean(), config.replace(executor=executor))
    plans = [getattr(g, "compiled", g) for g in compiled_graphs[first:] if g is not None]
    groups = [grp for p in plans if hasattr(p, "plan") for grp in p.plan.groups]
    sums = [g for g in groups if g.kind is GroupKind.ATEN and any("sum" in str(n.op) for n in g.nodes)]
    assert not sums, [g.name for g in sums]
    long = [g for g in groups if g.kind is GroupKind.REDUCTION and long_rows(g.domain, config)]
    assert len(long) >= 2 and any(len(g.nodes) > 2 for g in long), [g.name for g in long]
    assert any("cuDNN's batch norm" in p.explain(source=False) for p in plans if hasattr(p, "plan"))


def _bn_sums(g: torch.Tensor, x: torch.Tensor, mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch norm's backward sums with nothing producing the gradient in the graph (the batch norm
    before a residual add): two reductions joined only by reading `g`."""
    return g.sum((0, 2, 3)), (g * (x - mean[None, :, None, None])).sum((0, 2, 3))


@pytest.mark.parametrize("long", [True, False])
def test_sibling_reductions_reading_one_input_share_a_kernel(config: Config, device: torch.device, long: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Two reductions over one domain that read the same input and depend on each other in neither
    direction run as one kernel (Config.sibling_reductions), looped over long rows or persistent over
    short ones; with the option off, two. Results match eager either way."""
    config, _, scale = _setup(config, device, monkeypatch)
    side = 16 * scale if long else 6
    g, x = (torch.randn(4, 6, side, side, device=device) for _ in range(2))
    mean = torch.randn(6, device=device)
    counts = {}
    for sibling in (True, False):
        compiled = streamfuse.compile(_bn_sums, (g, x, mean), config.replace(sibling_reductions=sibling))
        reductions = [grp for grp in compiled.plan.groups if grp.kind is GroupKind.REDUCTION]
        assert all(long_rows(grp.domain, config) is long for grp in reductions)
        counts[sibling] = len(reductions)
        for got, want in zip(compiled(g, x, mean), _bn_sums(g, x, mean), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    assert counts == {True: 1, False: 2}


def test_split_is_capped_and_still_sums_every_slice(config: Config, device: torch.device,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """One row of 51 M elements would take hundreds of programs to fill the GPU; the split stops at
    Config.reduction_max_split (the combine is unrolled over the splits), each program summing a
    longer slice. A small cap on a small row: every slice is still summed once."""
    from streamfuse.fusion.groups import ReductionDomain

    assert looped_split(ReductionDomain((51_463_168,), (0,)), Config(), 132, False)[0] == 64
    config, sm_count, _ = _setup(config, device, monkeypatch)
    config = config.replace(reduction_max_split=3)
    x = torch.randn(4, 5000, device=device)  # rows past the limit on either device, in 10 steps of 2048

    def fn(t: torch.Tensor) -> torch.Tensor:
        return t.sum((0, 1)) * 1.0

    compiled = streamfuse.compile(fn, (x,), config)
    (group,) = [g for g in compiled.plan.groups if g.kind is GroupKind.REDUCTION]
    assert long_rows(group.domain, config) and looped_split(group.domain, config, sm_count, False)[0] == 3
    torch.testing.assert_close(compiled(x), fn(x), rtol=1e-4, atol=1e-3)


def _ln_backward_sums(a: torch.Tensor, b: torch.Tensor, xhat: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A layer norm's backward after a residual add: the row kernel makes the gradient `g` and
    `g * xhat`; the weight's and bias's gradients sum each over the batch and sequence dims."""
    g = a + b
    h = g * xhat
    dx = h - h.mean(2, keepdim=True) - xhat * (h * xhat).mean(2, keepdim=True)
    return dx, h.sum((0, 1)), g.sum((0, 1))


def _ln_backward_input_sum(g: torch.Tensor, xhat: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same with the gradient an input that the row kernel reads (GPT-2's first layer norm)."""
    h = g * xhat
    dx = h - h.mean(2, keepdim=True) - xhat * (h * xhat).mean(2, keepdim=True)
    return dx, h.sum((0, 1)), g.sum((0, 1))


@pytest.mark.parametrize("fn", [_ln_backward_sums, _ln_backward_input_sum], ids=["results", "result-and-input"])
def test_sibling_reductions_beside_one_kernel_share_a_kernel(config: Config, fn: Any) -> None:
    """Two reductions over one domain whose inputs are results (or inputs) of one generated kernel (a
    layer norm's weight and bias gradients) run as one kernel; with Config.sibling_reductions off,
    two. Results match eager either way."""
    inputs = tuple(torch.randn(2, 24, 40) for _ in range(3 if fn is _ln_backward_sums else 2))
    counts = {}
    for sibling in (True, False):
        compiled = streamfuse.compile(fn, inputs, config.replace(sibling_reductions=sibling))
        columns = [grp for grp in compiled.plan.groups
                   if grp.kind is GroupKind.REDUCTION and grp.domain is not None and grp.domain.dims == (0, 1)]
        counts[sibling] = len(columns)
        for got, want in zip(compiled(*inputs), fn(*inputs), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert counts == {True: 1, False: 2}
