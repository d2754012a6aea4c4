"""Reductions over H and W of a channels_last tensor (Group.rows_contiguous): the looped template
puts its threads along the channels, which lie next to each other in memory, stores its results of
the full shape channels_last, and matches eager; what it cannot run in one pass keeps the
persistent template."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import streamfuse
from streamfuse.capture.export import capture
from streamfuse.config import Config
from streamfuse.fusion.geometry import fills_rows_contiguous, loopable, rows_contiguous_launch
from streamfuse.fusion.groups import Group, GroupKind, ReductionDomain
from streamfuse.fusion.planner import plan_fusion
from streamfuse.ir.from_fx import graph_from_fx
from streamfuse.ir.indexing import channels_last_strides


class SqueezeExcite(nn.Module):
    """An MBConv block's middle (EfficientNet): a depthwise convolution, BN + SiLU, a squeeze-and-
    excitation pool (mean, or max/sum by `pool`) through two 1x1 convolutions, the scale, the
    projection. Odd channel and spatial sizes, so a wrong stride, mask or walk shows."""

    def __init__(self, c: int = 12, pool: str = "mean") -> None:
        super().__init__()
        self.pool = pool
        self.stem = nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(c)
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.fc1 = nn.Conv2d(c, 4, 1)
        self.fc2 = nn.Conv2d(4, c, 1)
        self.proj = nn.Conv2d(c, 6, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.silu(self.bn0(self.stem(x)))
        b = F.silu(self.bn1(self.dw(a)))
        if self.pool == "mean":
            s = F.adaptive_avg_pool2d(b, 1)
        elif self.pool == "amax":
            s = b.amax((2, 3), keepdim=True)
        else:
            s = b.sum((2, 3), keepdim=True) * 0.01
        s = torch.sigmoid(self.fc2(F.silu(self.fc1(s))))
        return self.bn2(self.proj(b * s))


def randomized(pool: str, device: torch.device, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = SqueezeExcite(pool=pool).eval()
    with torch.no_grad():
        for bn in (model.bn0, model.bn1, model.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    return model.to(device=device, dtype=dtype)


def looped_config(config):  # type: ignore[no-untyped-def]
    # every reduction "fills" the GPU: the small test shapes take the looped template
    return config.replace(conv_layout="channels_last", grid_min_waves=0)


def tol(device: torch.device, dtype: torch.dtype = torch.float32) -> float:
    if dtype != torch.float32:
        return 2e-2
    return 5e-3 if device.type == "cuda" else 1e-4  # cuDNN's float32 convolutions run in TF32


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("pool", ["mean", "amax", "sum"])
def test_squeeze_excite_pool_runs_looped_along_the_channels(config, device, pool) -> None:  # type: ignore[no-untyped-def]
    model = randomized(pool, device)
    x = torch.randn(3, 3, 7, 9, device=device)
    compiled = streamfuse.compile(model, (x,), looped_config(config))
    marked = [g for g in compiled.plan.groups if g.rows_contiguous]
    assert len(marked) == 1
    g = marked[0]
    assert g.kind is GroupKind.REDUCTION and g.domain is not None and g.domain.dims == (2, 3)
    src = compiled.base.sources[g.id]
    assert "for r0 in range(0, 63, BLOCK_R):" in src.source
    # the activation (the domain's shape, read by the scale kernel) is stored channels_last as well
    full = [(o, st) for o, st in zip(src.outputs, src.output_strides, strict=True) if o.shape == g.domain.shape]
    assert full and all(st == channels_last_strides(o.shape) for o, st in full)
    assert "looped, threads along the rows" in compiled.explain()
    with torch.no_grad():
        assert rel(compiled(x), model(x)) < tol(device)
        x2 = torch.randn(5, 3, 7, 9, device=device)  # another batch
        assert rel(compiled(x2), model(x2)) < tol(device)


def test_switched_off_or_too_few_rows_keeps_the_persistent_reduction(config, device) -> None:  # type: ignore[no-untyped-def]
    model = randomized("mean", device)
    x = torch.randn(3, 3, 7, 9, device=device)
    with torch.no_grad():
        want = model(x)
    for cfg in (looped_config(config).replace(reduction_rows_contiguous=False),
                config.replace(conv_layout="channels_last")):  # 36 rows cannot fill 132 SMs twice
        compiled = streamfuse.compile(model, (x,), cfg)
        assert not any(g.rows_contiguous for g in compiled.plan.groups)
        assert not any("for r0" in s.source for s in compiled.base.sources.values())
        with torch.no_grad():
            assert rel(compiled(x), want) < tol(device)


def test_the_backend_runs_the_looped_reduction(config, device) -> None:  # type: ignore[no-untyped-def]
    model = randomized("mean", device)
    x = torch.randn(2, 3, 5, 11, device=device)
    opt = torch.compile(model, backend=streamfuse.make_backend(looped_config(config)), dynamic=False)
    with torch.no_grad():
        assert rel(opt(x), model(x)) < tol(device)
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_looped_reduction_matches_eager(config, device, dtype) -> None:  # type: ignore[no-untyped-def]
    if device.type == "cpu" and dtype is torch.float16:
        pytest.skip("eager float16 convolutions need a GPU")
    model = randomized("mean", device, dtype)
    x = torch.randn(4, 3, 6, 6, device=device, dtype=dtype)
    compiled = streamfuse.compile(model, (x,), looped_config(config))
    assert any(g.rows_contiguous for g in compiled.plan.groups)
    with torch.no_grad():
        want = randomized("mean", device)(x.float())  # float32 reference
        assert rel(compiled(x), want) < tol(device, dtype)


def _group_of(fn, *shapes: tuple[int, ...]) -> Group:  # type: ignore[no-untyped-def]
    """The one reduction group of `fn`'s plan (CPU)."""
    with torch.no_grad():
        cap = capture(fn, tuple(torch.randn(s) for s in shapes))
    plan = plan_fusion(graph_from_fx(cap.gm, cap.bound), Config())
    groups = [g for g in plan.groups if g.kind is GroupKind.REDUCTION]
    assert len(groups) == 1
    return groups[0]


class _Fn(nn.Module):
    def __init__(self, fn) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


@pytest.mark.parametrize(("fn", "expected"), [
    (lambda x: (x * 2).mean((2, 3)), True),
    (lambda x: torch.relu(x).amax((2, 3)) + 1, True),
    (lambda x: x.var((2, 3)), False),  # two passes
    (lambda x: x - x.mean((2, 3), keepdim=True), False),  # a full-shape result needs the mean
    (lambda x: (x - x.amax((2, 3), keepdim=True)).exp().sum((2, 3)), False),  # a reduction of a reduction
])
def test_what_one_pass_over_each_row_can_run(fn, expected) -> None:  # type: ignore[no-untyped-def]
    assert loopable(_group_of(_Fn(fn), (2, 3, 4, 5))) is expected


def test_launch_fills_the_gpu_with_at_least_a_sector_per_program() -> None:
    cfg = Config()
    big = ReductionDomain((32, 96, 56, 56), (2, 3))  # 3,072 rows: 384 programs of 8 at the least
    block_m, block_r, warps = rows_contiguous_launch(big, cfg, 132)
    assert block_m == 8 and block_m * block_r == 2048 and warps == 8
    assert fills_rows_contiguous(big, cfg, 132)
    assert not fills_rows_contiguous(ReductionDomain((1, 96, 56, 56), (2, 3)), cfg, 132)  # batch 1: 96 rows
    wide = ReductionDomain((32, 1152, 7, 7), (2, 3))  # 36,864 rows: 32 per program, the row in one step
    assert rows_contiguous_launch(wide, cfg, 132) == (32, 64, 8)


@pytest.mark.parametrize("shape, dims", [((40, 2112), (0,)), ((3, 5, 2200), (0, 1))])
def test_column_sums_run_looped_along_the_dense_dim(config, device, shape, dims) -> None:  # type: ignore[no-untyped-def]
    """The same holds for any reduction whose innermost kept dim is dense: a bias gradient's column
    sum over a [tokens, features] tensor (enough columns to fill the GPU's SMs twice at 8 a program)."""
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x * 1.5).sum(dims), x.amax(dims, keepdim=True)

    x = torch.randn(shape, device=device)
    compiled = streamfuse.compile(fn, (x,), config)
    marks = [g.rows_contiguous for g in compiled.plan.groups if g.kind is GroupKind.REDUCTION]
    assert marks and all(marks)
    for got, want in zip(compiled(x), fn(x), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape, dims", [((300, 128), (0,)), ((3, 100, 128), (0, 1))])
def test_few_columns_split_each_row_and_combine_in_order(config, device, shape, dims,  # type: ignore[no-untyped-def]
                                                         monkeypatch) -> None:
    """Few columns fill the GPU only with each row split (a layer-norm or bias gradient of a
    768-wide model: fusion/geometry.rows_contiguous_split): the programs of one row tile sum their
    slices, the last combines them in split order. Results match eager, a result of the full shape
    stored on the way too; every call gives the same bits (no atomics on data), and the counters
    are reset for the next launch (the second call). On the CPU a 16-SM device keeps the
    interpreter's programs few; on the GPU, 6x the columns (768) and 4x the rows."""
    from streamfuse.fusion.geometry import looped_split
    from streamfuse.runtime import executable

    if device.type == "cpu":
        monkeypatch.setattr(executable, "DEFAULT_SM_COUNT", 16)
    else:
        shape = (*shape[:-2], shape[-2] * 4, shape[-1] * 6)
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x * 1.5).sum(dims), x.amax(dims, keepdim=True), x.mean(dims), x * 2.0

    x = torch.randn(shape, device=device)
    compiled = streamfuse.compile(fn, (x,), config)
    groups = [g for g in compiled.plan.groups if g.kind is GroupKind.REDUCTION]
    assert groups and all(g.rows_contiguous for g in groups)
    assert all(looped_split(g.domain, config, sm_count, True)[0] > 1 for g in groups)
    first = compiled(x)
    for got, want in zip(first, fn(x), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for a, b in zip(first, compiled(x), strict=True):
        assert torch.equal(a, b)
    off = streamfuse.compile(fn, (x,), config.replace(reduction_row_split=False))
    assert not any(g.rows_contiguous for g in off.plan.groups if g.kind is GroupKind.REDUCTION)


def test_layer_norm_and_bias_gradients_through_split_column_sums(config, device, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A transformer MLP's training step through the backend: the layer-norm weight and bias
    gradients and the Linear bias gradients are column sums over the tokens, which a 16-SM device
    (on the CPU; on the GPU its own SMs, with GPT-2's 768 features and 8x the tokens) runs split.
    Loss, gradients and parameters match eager over three SGD steps."""
    from test_training import train_and_compare

    from streamfuse.capture.backend import compiled_graphs
    from streamfuse.fusion.geometry import looped_split
    from streamfuse.runtime import executable

    tokens, width = 300, 128
    if device.type == "cpu":
        monkeypatch.setattr(executable, "DEFAULT_SM_COUNT", 16)
    else:
        tokens, width = tokens * 8, 768
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU(), nn.Linear(width, width)).to(device)
    gen = torch.Generator().manual_seed(4)
    batches = [(torch.randn(tokens, width, generator=gen).to(device),) for _ in range(3)]
    first = len(compiled_graphs)
    train_and_compare(model, batches, lambda m, x: m(x).square().mean(), config)
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16
    plans = [getattr(g, "compiled", g) for g in compiled_graphs[first:] if g is not None]
    split = [grp for p in plans if hasattr(p, "plan") for grp in p.plan.groups
             if grp.rows_contiguous and looped_split(grp.domain, config, sm_count, True)[0] > 1]
    assert len(split) >= 2, [type(p).__name__ for p in plans]  # the layer norm's and the biases' gradients
