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


def test_addmm_split_hands_the_bias_to_the_readers(config, device) -> None:  # type: ignore[no-untyped-def]
    """Config.addmm_bias="split": an addmm read only by pointwise ops (fc1 -> GELU; fc2 -> the residual
    add) runs as mm, the bias added in the readers' kernel: as many launches, eager's answers."""
    torch.manual_seed(0)
    model = Block().to(device).eval()
    x = torch.randn(2, 5, 3, 6, device=device)
    with torch.no_grad():
        split = streamfuse.compile(model, (x,), config.replace(addmm_bias="split"))
        kept = streamfuse.compile(model, (x,), config.replace(addmm_bias="addmm"))
        for fresh in (x, torch.randn(3, 5, 3, 6, device=device)):
            torch.testing.assert_close(split(fresh), model(fresh), rtol=1e-4, atol=1e-5)
    assert "aten.addmm.default" not in _ops(split) and _ops(split).count("aten.mm.default") == 2
    assert _ops(kept).count("aten.addmm.default") == 2
    assert split.stats["kernels"] == kept.stats["kernels"]
    # through the backend too (AOTAutograd traces the Linear layers as addmm)
    backend = torch.compile(model, backend=streamfuse.make_backend(config.replace(addmm_bias="split")))
    with torch.no_grad():
        torch.testing.assert_close(backend(x), model(x), rtol=1e-4, atol=1e-5)


def test_addmm_split_leaves_products_that_no_pointwise_kernel_reads(config) -> None:  # type: ignore[no-untyped-def]
    """A product that is an output, or read by a reduction, keeps its addmm: nothing would add the
    bias for free."""
    from streamfuse.ir.mm_bias import split_candidates

    lin = nn.Linear(6, 8)

    def cases(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = lin(x)  # the graph's output
        summed = lin(x * 2).sum(dim=1)  # read by a reduction
        act = torch.relu(lin(x + 1))  # read by a pointwise op: the one candidate
        return out, summed, act

    x = torch.randn(4, 6)
    with torch.no_grad():
        compiled = streamfuse.compile(cases, (x,), config.replace(addmm_bias="addmm", executor="reference"))
        (node,) = split_candidates(compiled.base.graph)
        assert node.users[0].op == "aten.relu.default"
        split = streamfuse.compile(cases, (x,), config.replace(addmm_bias="split", executor="reference"))
        assert _ops(split).count("aten.addmm.default") == 2 and _ops(split).count("aten.mm.default") == 1
        for got, want in zip(split(x), cases(x), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_addmm_bias_auto_keeps_addmm_without_a_measurement(config) -> None:  # type: ignore[no-untyped-def]
    model = Block().eval()
    x = torch.randn(2, 5, 3, 6)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config.replace(addmm_bias="auto"))
    assert _ops(compiled).count("aten.addmm.default") == 2
    with pytest.raises(ValueError, match="addmm_bias"):
        config.replace(addmm_bias="sometimes")


@pytest.mark.gpu
def test_addmm_bias_auto_times_both_products_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """On the GPU, "auto" times addmm and mm per shape, caches both times, and follows them."""
    from streamfuse.tune.autotune import load_cache

    torch.manual_seed(0)
    model = Block(64).cuda().eval()
    x = torch.randn(8, 16, 16, 64, device="cuda")
    config = streamfuse.Config(cache_dir=tmp_path, addmm_bias="auto")
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    timed = {k: v for k, v in load_cache(tmp_path).items() if "|addmm-split|" in k}
    assert len(timed) == 2 and all(v["addmm_us"] > 0 and v["mm_us"] > 0 for v in timed.values())
    split = [n for n in compiled.base.graph.nodes if n.op == "aten.mm.default"]
    decided = sum(v["mm_us"] < v["addmm_us"] * (1 - config.addmm_split_margin) for v in timed.values())
    assert len(split) == decided
