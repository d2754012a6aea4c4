"""Sibling products over weights merged in inference graphs (ir/merge_mm.py, Config.merge_sibling_linears):
which products merge, that the concatenated weights are folded into snapshots (nothing more per
call) and follow an in-place change, that the plan matches eager through what reads the slices
(views, permutes, attention, generated kernels), at two batch sizes, and what stays alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import randn

import streamfuse
from streamfuse import Config

nn = torch.nn
PRODUCTS = ("aten.mm.default", "aten.addmm.default")

pytestmark = pytest.mark.usefixtures("ieee_products")


class Attention(nn.Module):
    """Separate query, key and value Linears over one input (BERT-style; `kv` narrower: grouped-query
    attention's keys and values), attention, an output Linear and a SwiGLU MLP whose gate and up
    Linears read one input too."""

    def __init__(self, width: int = 32, heads: int = 4, kv: int = 32, bias: bool = True) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv // (width // heads), width // heads
        self.q = nn.Linear(width, width, bias=bias)
        self.k, self.v = nn.Linear(width, kv, bias=bias), nn.Linear(width, kv, bias=bias)
        self.o = nn.Linear(width, width, bias=bias)
        self.gate, self.up = nn.Linear(width, 48, bias=False), nn.Linear(width, 48, bias=False)
        self.down = nn.Linear(48, width, bias=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm(x)
        q = self.q(h).view(b, s, self.heads, self.d).transpose(1, 2)
        k = self.k(h).view(b, s, self.kv_heads, self.d).transpose(1, 2)
        v = self.v(h).view(b, s, self.kv_heads, self.d).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1)
        x = x + self.o(a)
        return x + self.down(F.silu(self.gate(x)) * self.up(x))


def _products(compiled) -> list:  # type: ignore[no-untyped-def]
    return [n for n in compiled.graph.nodes if n.op in PRODUCTS]


def _note(compiled) -> str:  # type: ignore[no-untyped-def]
    return next((n for n in compiled.graph.notes if "sibling products over weights merged" in n), "")


@pytest.mark.parametrize(("kv", "bias"), [(32, True), (16, False)])
def test_siblings_run_as_one_product_over_folded_weights(config: Config, on_cpu: None, kv: int, bias: bool) -> None:
    torch.manual_seed(0)
    model, x = Attention(kv=kv, bias=bias).eval(), randn(2, 8, 32)
    with torch.no_grad():
        off = streamfuse.compile(model, (x,), config)
        on = streamfuse.compile(model, (x,), config.replace(merge_sibling_linears=True))
        assert len(_products(off)) == 7 and len(_products(on)) == 4  # q/k/v -> 1, gate/up -> 1, o, down
        assert "5 sibling products over weights merged into 2" in _note(on)
        assert not _note(off)
        ops = [n.op for n in on.graph.nodes]
        assert "aten.cat.default" not in ops  # folded: the concatenated weights are snapshots
        widths = sorted(p.shape[1] for p in _products(on))
        assert widths == sorted([32 + 2 * kv, 96, 32, 32])
        assert on.stats["kernels"] < off.stats["kernels"] and on.stats["events"] <= off.stats["events"]
        for batch in (2, 3):  # the second a new batch size: captured again, merged again
            xb = randn(batch, 8, 32, seed=batch)
            torch.testing.assert_close(on(xb), model(xb), rtol=1e-5, atol=1e-5)
        model.k.weight.mul_(-0.5)  # a weight changed in place: the concatenated snapshot follows
        model.up.weight.add_(0.25)
        torch.testing.assert_close(on(x), model(x), rtol=1e-5, atol=1e-5)


def test_autocast_casts_of_one_input_merge_too(config: Config, on_cpu: None) -> None:
    """Under autocast each Linear casts its input itself: equal casts of one node count as one input."""
    torch.manual_seed(0)
    model, x = Attention().eval(), randn(2, 8, 32)
    def casts(compiled) -> int:  # type: ignore[no-untyped-def]
        return sum(n.op == "aten._to_copy.default" for n in compiled.graph.nodes if n not in compiled.graph.constants)

    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        off = streamfuse.compile(model, (x,), config)
        on = streamfuse.compile(model, (x,), config.replace(merge_sibling_linears=True))
        assert "5 sibling products over weights merged into 2" in _note(on)
        assert casts(on) == casts(off) - 3  # q, k, v read one cast of their input, gate and up one of theirs
        torch.testing.assert_close(on(x), model(x), rtol=2e-2, atol=2e-2)


def test_off_by_default_and_left_alone_where_the_caller_could_tell(config: Config, on_cpu: None) -> None:
    """A product that is a graph output, products over different inputs, and a result viewed in a way
    its column slice cannot be (flattened across its columns) all stay as traced."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c, self.d = (nn.Linear(16, 16) for _ in range(4))
            self.e, self.f = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
            returned = self.a(x)  # a graph output: eager's dense tensor, not a slice
            other = self.b(x) * 2
            apart = self.c(y) + self.d(x[:, :16] * 3)  # different rows
            flat = self.e(x).flatten() + self.f(x).flatten()  # a view across the columns
            return returned, other, apart, flat

    torch.manual_seed(0)
    model, x, y = Mixed().eval(), randn(6, 16), randn(6, 16, seed=5)
    with torch.no_grad():
        assert not _note(streamfuse.compile(model, (x, y), config))  # off by default
        on = streamfuse.compile(model, (x, y), config.replace(merge_sibling_linears=True))
        assert len(_products(on)) == 6 and not _note(on)
        for got, want in zip(on(x, y), model(x, y), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_merge_past_the_fold_budget_is_undone(config: Config, on_cpu: None) -> None:
    """Concatenated weights the fold does not keep would be copied on every call: the products stay
    as traced, and nothing of the merge is left in the graph."""
    torch.manual_seed(0)
    model, x = Attention().eval(), randn(2, 8, 32)
    with torch.no_grad():
        on = streamfuse.compile(model, (x,), config.replace(merge_sibling_linears=True, fold_weights_max_bytes=1))
        assert len(_products(on)) == 7 and not _note(on)
        ops = [n.op for n in on.graph.nodes]
        assert "aten.cat.default" not in ops and "aten.slice.Tensor" not in ops
        torch.testing.assert_close(on(x), model(x), rtol=1e-5, atol=1e-5)


def test_the_backend_merges_its_bound_graphs_and_unbinds_on_a_change(config: Config, on_cpu: None) -> None:
    """Through torch.compile(backend="streamfuse") the bound inference graph merges as streamfuse.compile
    does; a weight changed in place makes the backend bind the graph again unfolded (and so unmerged)."""
    from streamfuse.capture import backend as backend_module

    torch.manual_seed(0)
    model, x = Attention().eval(), randn(2, 8, 32)
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(model, backend=streamfuse.make_backend(config.replace(merge_sibling_linears=True)))
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        bound = [g for g in list(backend_module.compiled_graphs) if isinstance(g, backend_module.StaticParamsGraph)]
        assert "5 sibling products over weights merged into 2" in _note(bound[-1].compiled)
        model.q.weight.add_(0.5)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        assert bound[-1].live and not _note(bound[-1].compiled)
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_gpu_the_merged_plan_matches_eager(config: Config, dtype: torch.dtype) -> None:
    """CUDA weights (what the rewrite takes without the CPU fixture), replayed from the plans' CUDA
    graphs through both entry points, slices starting at 16-byte multiples; a weight changed in place."""
    torch.manual_seed(0)
    model = Attention(width=128, heads=4, kv=64).cuda().to(dtype).eval()
    x = randn(2, 16, 128, dtype=dtype, device="cuda")
    tol = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2)}[dtype]
    with torch.no_grad():
        merged = config.replace(merge_sibling_linears=True)
        on = streamfuse.compile(model, (x,), merged)
        assert "5 sibling products over weights merged into 2" in _note(on)
        torch._dynamo.reset()
        backend = torch.compile(model, backend=streamfuse.make_backend(merged))
        for _ in range(3):
            torch.testing.assert_close(on(x), model(x), rtol=tol[0], atol=tol[1])
            torch.testing.assert_close(backend(x), model(x), rtol=tol[0], atol=tol[1])
        model.v.weight.mul_(0.5)
        torch.testing.assert_close(on(x), model(x), rtol=tol[0], atol=tol[1])
        torch.testing.assert_close(backend(x), model(x), rtol=tol[0], atol=tol[1])
    torch._dynamo.reset()
