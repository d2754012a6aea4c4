"""Training-mode dropout: counter-based random numbers fused into the kernels around them (ir/rng.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import randn

import streamfuse
from streamfuse.fusion.groups import GroupKind


def _model(p: float) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Dropout(p)).train()


@pytest.mark.parametrize("strategy", ["triton", "cublas"])
def test_dropout_fuses_and_keeps_the_rate(strategy: str, config, device) -> None:  # type: ignore[no-untyped-def]
    p = 0.3
    model = _model(p).to(device)
    x = randn(128, 64, device=device)
    compiled = streamfuse.compile(model, (x,), config.replace(matmul_strategy=strategy, seed=11))
    kinds = [g.kind for g in compiled.plan.groups if g.kind is not GroupKind.ALIAS]
    # GEMM + bias + GELU + dropout: one template kernel, or cuBLAS and one epilogue kernel
    assert kinds == ([GroupKind.MATMUL] if strategy == "triton" else [GroupKind.ATEN, GroupKind.POINTWISE])
    assert "random numbers" not in (compiled.graph_skip or "")  # generated kernels draw inside CUDA graphs too
    y = F.gelu(model[0](x))
    out = compiled(x)
    keep = out != 0
    n = keep.numel()
    rate = keep.float().mean().item()
    assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)  # 5 sigma of a binomial
    torch.testing.assert_close(out[keep], (y / (1 - p))[keep], rtol=1e-5, atol=1e-5)


def test_same_seed_same_masks_and_fresh_mask_per_call(config, device) -> None:  # type: ignore[no-untyped-def]
    model = _model(0.5).to(device)
    x = randn(32, 64, device=device)
    a = streamfuse.compile(model, (x,), config.replace(seed=5))
    b = streamfuse.compile(model, (x,), config.replace(seed=5))
    c = streamfuse.compile(model, (x,), config.replace(seed=6))
    first, second = a(x), a(x)
    assert not torch.equal(first != 0, second != 0)  # each call draws a fresh mask
    assert torch.equal(b(x), first) and torch.equal(b(x), second)  # the seed reproduces the sequence
    assert not torch.equal(c(x) != 0, first != 0)


def test_seed_defaults_to_torch_generator(config, device) -> None:  # type: ignore[no-untyped-def]
    model = _model(0.5).to(device)
    x = randn(32, 64, device=device)
    torch.manual_seed(123)
    a = streamfuse.compile(model, (x,), config)(x)
    torch.manual_seed(123)
    b = streamfuse.compile(model, (x,), config)(x)
    assert torch.equal(a, b)


def test_dropout_follows_torch_manual_seed_at_every_call(config, device) -> None:  # type: ignore[no-untyped-def]
    """With the default Config.seed, torch.manual_seed(s) before a call reproduces that call's masks
    (as in eager, aot_eager and Inductor; they ignored it: each call advanced a counter), through
    both entry points; without it, each call draws a fresh mask."""
    model = _model(0.5).to(device)
    x = randn(32, 64, device=device)
    torch._dynamo.reset()
    for fn in (streamfuse.compile(model, (x,), config), torch.compile(model, backend=streamfuse.make_backend(config))):
        with torch.no_grad():
            fn(x)
            torch.manual_seed(7)
            first = fn(x)
            again = fn(x)
            torch.manual_seed(7)
            repeated = fn(x)
        assert not torch.equal(first != 0, again != 0)  # a fresh mask per call
        assert torch.equal(first, repeated)  # the seed reproduces it
    torch._dynamo.reset()


def test_zero_p_and_eval_mode_are_the_identity(config, device) -> None:  # type: ignore[no-untyped-def]
    x = randn(16, 64, device=device)
    for model in (_model(0.0).to(device), _model(0.4).to(device).eval()):
        compiled = streamfuse.compile(model, (x,), config)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def test_backward_uses_the_same_mask(config, device) -> None:  # type: ignore[no-untyped-def]
    """Through torch.compile, the mask native_dropout returns feeds the backward: the gradient of
    sum(dropout(x)) is exactly mask / (1 - p)."""
    p = 0.25
    backend = streamfuse.make_backend(config.replace(seed=3))
    fn = torch.compile(lambda t: F.dropout(t, p, training=True), backend=backend)
    x = randn(64, 48, device=device).requires_grad_(True)
    out = fn(x)
    out.sum().backward()
    keep = out.detach() != 0
    assert 0.6 < keep.float().mean().item() < 0.9
    torch.testing.assert_close(x.grad, keep.float() / (1 - p))


def test_reference_executor_is_deterministic_too(config) -> None:  # type: ignore[no-untyped-def]
    model = _model(0.5)
    x = randn(32, 64)
    ref = config.replace(executor="reference", seed=9)
    a, b = streamfuse.compile(model, (x,), ref), streamfuse.compile(model, (x,), ref)
    assert torch.equal(a(x), b(x))
    assert 0.35 < (a(x) != 0).float().mean().item() < 0.65


def test_reference_executor_draws_a_fresh_mask_per_call_with_the_default_seed(config) -> None:  # type: ignore[no-untyped-def]
    """The default seed puts each call's counter base in the high 32 bits; a CPU generator keeps only
    the low 32 bits of its seed, so the reference executor drew the same mask at every call (CPU
    training through the backend with dropout got one fixed mask). Both entry points, and
    torch.manual_seed still reproduces a call."""
    model = _model(0.5)
    x = randn(32, 64)
    ref = config.replace(executor="reference")
    torch._dynamo.reset()
    for fn in (streamfuse.compile(model, (x,), ref), torch.compile(model, backend=streamfuse.make_backend(ref))):
        with torch.no_grad():
            fn(x)  # the backend builds its plan at the first call, drawing from torch's generator
            torch.manual_seed(3)
            masks = [fn(x) != 0 for _ in range(4)]
            torch.manual_seed(3)
            again = fn(x) != 0
        assert all(not torch.equal(masks[i], masks[j]) for i in range(4) for j in range(i))
        assert torch.equal(again, masks[0])
        assert all(0.35 < m.float().mean().item() < 0.65 for m in masks)
    torch._dynamo.reset()


@pytest.mark.gpu
def test_a_replayed_cuda_graph_draws_a_fresh_mask_every_call(config, device) -> None:  # type: ignore[no-untyped-def]
    """The kernels read the counter offset from device memory and each call (a replay too) advances
    it on the device: the same input gives a new mask on every replay, at the rate p."""
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Dropout(0.3)]
    model = torch.nn.Sequential(*layers).to(device).train()
    x = randn(8, 256, device=device)
    compiled = streamfuse.compile(model, (x,), config.replace(seed=2))
    outs = [compiled(x) for _ in range(4)]
    assert compiled.stats["graphs"] == 1, compiled.explain(source=False)
    masks = [o != 0 for o in outs]
    assert all(not torch.equal(a, b) for a, b in zip(masks, masks[1:], strict=False)), "a replay repeated its mask"
    for m in masks:
        assert 0.55 < m.float().mean().item() < 0.85


def test_stochastic_depth_through_the_backend_draws_fresh_per_sample_masks(config, device) -> None:  # type: ignore[no-untyped-def]
    """timm's drop_path (`x.new_empty((B, 1, ...)).bernoulli_(keep).div_(keep)`, then `x * mask`) in a
    training step through torch.compile: each call (on CUDA, graph replays after the first) draws a new
    per-sample mask at the rate `keep`, and the backward uses the forward's mask (x.grad is exactly the
    mask, so out == x * x.grad)."""
    keep = 0.6

    def drop_path(t: torch.Tensor) -> torch.Tensor:
        mask = t.new_empty((t.shape[0],) + (1,) * (t.ndim - 1)).bernoulli_(keep).div_(keep)
        return t * mask

    torch._dynamo.reset()
    fn = torch.compile(drop_path, backend=streamfuse.make_backend(config))
    x = randn(256, 8, 16, device=device)
    rows = []
    for _ in range(5):
        xi = x.detach().clone().requires_grad_(True)
        out = fn(xi)
        out.sum().backward()
        grad = xi.grad
        assert grad is not None
        # per sample: all of a row dropped (0) or all kept (1 / keep)
        first = grad[:, :1, :1]
        assert torch.equal(grad, first.expand_as(grad))
        assert bool(((first == 0) | (first == 1 / keep)).all())
        torch.testing.assert_close(out.detach(), x * grad, rtol=0, atol=0)
        rows.append(first.flatten() != 0)
    assert all(not torch.equal(a, b) for i, a in enumerate(rows) for b in rows[:i]), "a call repeated its mask"
    for r in rows:
        assert 0.45 < r.float().mean().item() < 0.75
    torch._dynamo.reset()
