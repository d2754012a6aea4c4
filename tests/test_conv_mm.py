"""A convolution over a 1x1 image with a 1x1 filter run as a product (ir/conv_mm.py,
Config.pointwise_conv_mm): squeeze-and-excitation blocks against eager, through both entry points,
with the plans checked for which convolutions became products and which stayed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from helpers import randn

import streamfuse
from streamfuse import Config
from streamfuse.bench.runner import exact_fp32

nn = torch.nn
CONV = "aten.convolution.default"
PRODUCTS = ("aten.addmm.default", "aten.mm.default")


@pytest.fixture(autouse=True)
def ieee() -> Iterator[None]:
    """Products and convolutions in full float32 (TF32 would round the two differently)."""
    with exact_fp32():
        yield


class SE(nn.Module):
    """EfficientNet's block tail: depthwise conv, SiLU, squeeze-and-excitation, projection."""

    def __init__(self, c: int = 24, s: int = 6, fc_bias: bool = True) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.fc1 = nn.Conv2d(c, s, 1, bias=fc_bias)
        self.fc2 = nn.Conv2d(s, c, 1, bias=fc_bias)
        self.project = nn.Conv2d(c, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.silu(self.dw(x))
        scale = torch.sigmoid(self.fc2(torch.nn.functional.silu(self.fc1(h.mean((2, 3), keepdim=True)))))
        return self.project(h * scale)


def ops(compiled: streamfuse.CompiledGraph) -> list[str]:
    return [n.op for n in compiled.graph.nodes]


@pytest.mark.parametrize("fc_bias", [True, False])
@pytest.mark.parametrize("batch", [1, 3])
def test_the_squeeze_and_excitation_fcs_become_products(config: Config, device: torch.device, batch: int,
                                                        fc_bias: bool) -> None:
    torch.manual_seed(batch)
    model = SE(fc_bias=fc_bias).to(device).eval()
    x = randn(batch, 24, 7, 7, device=device)
    with torch.no_grad():
        on = streamfuse.compile(model, (x,), config.replace(pointwise_conv_mm=True))
        off = streamfuse.compile(model, (x,), config.replace(pointwise_conv_mm=False))
        want = model(x)
        torch.testing.assert_close(on(x), want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(off(x), want, rtol=1e-4, atol=1e-5)
        y = randn(batch, 24, 7, 7, device=device)
        torch.testing.assert_close(on(y), model(y), rtol=1e-4, atol=1e-5)
    on.graph.validate()
    # the depthwise and the projection (7x7 images) stay convolutions; the two FCs are products
    assert ops(on).count(CONV) == 2 and ops(off).count(CONV) == 4
    assert sum(ops(on).count(p) for p in PRODUCTS) == 2
    assert "run as products" in on.explain(source=False)
    if device.type == "cpu" and batch == 1:  # the built-in cost model's choice there (cuBLAS at batch 3)
        # the first FC's SiLU runs in the product's epilogue, through the view back to [N, S, 1, 1]
        fused = [[n.op for n in g.nodes] for g in on.plan.groups if g.kind.name == "MATMUL"]
        assert any("aten.sigmoid.default" in ops for ops in fused), fused


def test_the_backend_trains_through_the_products_with_eager_gradients(config: Config, device: torch.device) -> None:
    """The forward graph's rewrite changes no gradient: AOTAutograd derived the backward from the
    convolutions, and the products compute the same forward values."""
    torch.manual_seed(5)
    model = SE().to(device)
    ref = SE().to(device)
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend=streamfuse.make_backend(config.replace(pointwise_conv_mm=True)))
    for step in range(2):
        x = randn(2, 24, 6, 6, device=device)
        torch.testing.assert_close(compiled(x).square().mean(), ref(x).square().mean(), rtol=1e-4, atol=1e-6)
        compiled(x).square().mean().backward()
        ref(x).square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name, s=step: f"{n} step {s}: {m}")
        model.zero_grad()
        ref.zero_grad()


def test_convolutions_that_are_not_fcs_stay(config: Config, device: torch.device) -> None:
    """A 1x1 filter over a larger image, a grouped or padded one over a 1x1 image, and one whose
    result the caller reads: each stays a convolution, and every result matches eager."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wide = nn.Conv2d(8, 8, 1)  # 1x1 filter, 5x5 image
            self.grouped = nn.Conv2d(8, 8, 1, groups=2)  # 1x1 image, two groups
            self.padded = nn.Conv2d(8, 4, 1, padding=1)  # 1x1 image, padded to 3x3
            self.last = nn.Conv2d(8, 8, 1)  # 1x1 image, the graph's output

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            p = self.wide(x).mean((2, 3), keepdim=True)
            return self.padded(torch.relu(self.grouped(p))), self.last(p)

    torch.manual_seed(7)
    model = Mixed().to(device).eval()
    x = randn(2, 8, 5, 5, device=device)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config.replace(pointwise_conv_mm=True))
        for got, want in zip(compiled(x), model(x), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert ops(compiled).count(CONV) == 4
    assert "run as products" not in compiled.explain(source=False)


@pytest.mark.parametrize("addmm_bias", ["addmm", "split"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_split_bias_in_the_template_follows_the_view_back_to_four_dims(config: Config, device: torch.device,
                                                                         batch: int, addmm_bias: str) -> None:
    """The FC's product in the Triton template with its bias added by the epilogue (addmm_bias="split",
    what "auto" chooses on a GPU where the plain product timed faster), then viewed back to
    [N, S, 1, 1]: the bias is read at the tile's column, not its row. Run 224 (regnet_y_400mf at batch
    1, H100) got a wrong result; run 227's kernel sources showed every column given the bias of
    column 0 (the index of the trailing ones)."""
    torch.manual_seed(11 + batch)
    model = SE().to(device).eval()
    x = randn(batch, 24, 7, 7, device=device)
    cfg = config.replace(pointwise_conv_mm=True, matmul_strategy="triton", addmm_bias=addmm_bias)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), cfg)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    fused = [[n.op for n in g.nodes] for g in compiled.plan.groups if g.kind.name == "MATMUL"]
    assert len(fused) == 2, fused
    if addmm_bias == "split":  # the bias add and the view to [N, S, 1, 1] are in the first FC's kernel
        assert any("aten.add.Tensor" in g and "aten.view.default" in g for g in fused), fused
