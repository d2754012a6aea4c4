"""A Linear layer traced as mm + bias add becomes addmm (ir/mm_bias.py): the bias goes to cuBLAS's
epilogue, as AOTAutograd's trace has it, and the answers stay eager's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import streamfuse


class Block(nn.Module):
    """convnext's MLP in small: Linear over a 4-D activation, GELU, Linear, a residual."""

    def __init__(self, c: int = 6) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, H, W, C]
        return x + self.fc2(F.gelu(self.fc1(x)))


def _ops(compiled) -> list[str]:  # type: ignore[no-untyped-def]
    return [n.op for n in compiled.base.graph.nodes]


def test_linear_bias_goes_into_addmm(config, device) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = Block().to(device).eval()
    x = torch.randn(2, 5, 3, 6, device=device)
    with torch.no_grad():
        on = streamfuse.compile(model, (x,), config)
        off = streamfuse.compile(model, (x,), config.replace(linear_bias_addmm=False))
        for compiled in (on, off):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
        x2 = torch.randn(3, 5, 3, 6, device=device)
        torch.testing.assert_close(on(x2), model(x2), rtol=1e-4, atol=1e-5)
    assert _ops(on).count("aten.addmm.default") == 2 and "aten.mm.default" not in _ops(on)
    assert _ops(off).count("aten.mm.default") == 2
    assert "bias add(s) folded into addmm" in on.explain()


@pytest.mark.parametrize("case", ["bias first", "bias [1, 1, N]", "alpha", "mm returned", "other dtype"])
def test_what_is_rewritten(config, device, case) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(1)
    w = torch.randn(6, 4, device=device)
    b = torch.randn(6, device=device)

    def fn(x: torch.Tensor):  # type: ignore[no-untyped-def]
        y = (x.reshape(-1, 4) @ w.t()).view(x.shape[0], x.shape[1], 6)
        if case == "bias first":
            return b + y
        if case == "bias [1, 1, N]":
            return y + b.view(1, 1, 6)
        if case == "alpha":
            return torch.add(y, b, alpha=2.0)
        if case == "mm returned":
            return y + b, y
        return y + b.double()  # promotes: addmm would need one dtype

    x = torch.randn(3, 5, 4, device=device)
    compiled = streamfuse.compile(fn, (x,), config)
    got, want = compiled(x), fn(x)
    for g, e in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
                    strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
    rewritten = "aten.addmm.default" in _ops(compiled)
    assert rewritten is (case in ("bias first", "bias [1, 1, N]"))


def test_backend_training_with_the_rewrite(config, device) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(2)
    model = Block().to(device)
    x = torch.randn(2, 5, 3, 6, device=device)
    opt = torch.compile(model, backend=streamfuse.make_backend(config), dynamic=False)
    try:
        opt(x).square().sum().backward()
        got = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        model.zero_grad()
        model(x).square().sum().backward()
        for g, p in zip(got, model.parameters(), strict=True):
            torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)
    finally:
        torch._dynamo.reset()
