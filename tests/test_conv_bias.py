"""A convolution's bias added by the kernel after it (ir/conv_bias.py), not by ATen after cuDNN.

Results are compared with eager on random inputs and weights; the plans are checked for where the
bias went (the convolution loses it, the next generated kernel adds it) and where it must stay.
"""

from __future__ import annotations

import pytest
import torch
from helpers import randn

import streamfuse
from streamfuse import Config
from streamfuse.capture.export import capture
from streamfuse.ir.conv_bias import bias_to_epilogue
from streamfuse.ir.from_fx import graph_from_fx

nn = torch.nn
CONV = "aten.convolution.default"


@pytest.fixture(autouse=True)
def ieee_convs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


def convs(compiled: streamfuse.CompiledGraph) -> list:  # type: ignore[type-arg]
    return [n for n in compiled.graph.nodes if n.op == CONV]


def generated_ops(compiled: streamfuse.CompiledGraph) -> list[list[str]]:
    return [[n.op for n in g.nodes] for g in compiled.plan.groups if g.kind.generated]


def run(model: nn.Module, x: torch.Tensor, config: Config, on: bool = True) -> streamfuse.CompiledGraph:
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config.replace(conv_bias_epilogue=on))
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    compiled.graph.validate()
    return compiled


def test_the_bias_joins_the_activation_kernel(config, device) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1), nn.Hardsigmoid()).to(device)
    on = run(model, randn(2, 3, 9, 9, device=device), config)
    assert [c.args[2] for c in convs(on)] == [None, None]
    kernels = generated_ops(on)
    assert len(kernels) == 2 and all("aten.add.Tensor" in ops for ops in kernels)
    assert "added in the kernel after it" in on.explain(source=False)
    off = run(model, randn(2, 3, 9, 9, device=device), config, on=False)
    assert all(c.args[2] is not None for c in convs(off))
    assert on.stats["kernels"] == off.stats["kernels"]  # the adds ATen would launch are not counted there


@pytest.mark.parametrize("groups", [1, 4])
def test_grouped_and_strided_convs_and_a_fire_module(config, device, groups: int) -> None:  # type: ignore[no-untyped-def]
    """SqueezeNet's fire module: a squeeze conv, two expand convs concatenated, every one biased."""
    class Fire(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.squeeze = nn.Conv2d(8, 4, 1, stride=2)
            self.e1 = nn.Conv2d(4, 8, 1, groups=groups)
            self.e3 = nn.Conv2d(4, 8, 3, padding=1, groups=groups)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            s = torch.relu(self.squeeze(x))
            return torch.cat([torch.relu(self.e1(s)), torch.relu(self.e3(s))], 1)

    torch.manual_seed(1)
    on = run(Fire().to(device), randn(2, 8, 11, 11, device=device), config)
    assert all(c.args[2] is None for c in convs(on))


def test_a_bias_stays_where_the_convolution_is_an_output_or_feeds_no_pointwise(device) -> None:  # type: ignore[no-untyped-def]
    """An output convolution, or one read by another convolution, keeps its bias (no epilogue to join)."""
    torch.manual_seed(2)

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 1)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = self.a(x)
            return y, self.b(y)

    model = Two().to(device)
    cap = capture(model, (randn(1, 3, 8, 8, device=device),))
    graph = graph_from_fx(cap.gm, cap.bound, cap.literals)
    assert bias_to_epilogue(graph) == 0
    assert all(n.args[2] is not None for n in graph.nodes if n.op == CONV)


def test_the_backend_and_training_gradients(config, device) -> None:  # type: ignore[no-untyped-def]
    """Through torch.compile(backend="streamfuse"): inference, and a training step whose gradients
    (the bias's included) equal eager's."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.GELU(), nn.Conv2d(6, 2, 3), nn.Tanh()).to(device)
    ref = nn.Sequential(*[m for m in model])  # same parameters
    x = randn(2, 3, 8, 8, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=streamfuse.make_backend(config))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=streamfuse.make_backend(config))
    out = compiled(x)
    (out * randn(*out.shape, device=device, seed=5)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want = ref(x)
    (want * randn(*want.shape, device=device, seed=5)).sum().backward()
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    for got, p in zip(grads, ref.parameters(), strict=True):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-5)


def test_a_view_before_a_normalization_still_takes_the_bias(config, device) -> None:  # type: ignore[no-untyped-def]
    """ConvNeXt's block: a depthwise convolution, permuted to channels-last, then LayerNorm (a
    reduction): the add joins the normalization's kernel through the view."""
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dw = nn.Conv2d(8, 8, 7, padding=3, groups=8)
            self.norm = nn.LayerNorm(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.dw(x).permute(0, 2, 3, 1))

    torch.manual_seed(4)
    on = run(Block().to(device), randn(2, 8, 9, 9, device=device), config)
    assert all(c.args[2] is None for c in convs(on))
    off = run(Block().to(device), randn(2, 8, 9, 9, device=device), config, on=False)
    assert on.stats["kernels"] == off.stats["kernels"]
