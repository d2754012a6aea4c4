"""Products with unaligned result rows computed over their weight padded to 16-byte rows (ir/pad_mm.py,
Config.product_row_alignment): which products are rewritten, that the pads are folded into
snapshots (nothing more per call), that the plan matches eager through what reads the sliced result
(views, a generated softmax, a graph output), and on a GPU that both entry points take it."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import randn

import streamfuse
from streamfuse import Config, StreamfuseFallbackWarning
from streamfuse.capture import backend as backend_module
from streamfuse.ir.pad_mm import padded_columns

nn = torch.nn
PAD = "aten.constant_pad_nd.default"

pytestmark = pytest.mark.usefixtures("ieee_products")


def test_padded_columns() -> None:
    assert padded_columns(50257, 2) == 50264 and padded_columns(50257, 4) == 50260 and padded_columns(768, 2) == 768
    assert padded_columns(3, 8) == 4 and padded_columns(30522, 2) == 30528 and padded_columns(30522, 4) == 30524


class Head(nn.Module):
    """A language model's head: LayerNorm, a Linear to an odd vocabulary (the padded product), then
    what reads the logits: a scaled softmax (a generated kernel) and the logits themselves."""

    def __init__(self, vocab: int = 37, bias: bool = False) -> None:
        super().__init__()
        self.norm, self.head = nn.LayerNorm(24), nn.Linear(24, vocab, bias=bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.norm(x))
        return logits, F.softmax(logits * 0.5, dim=-1).sum(-1)


def _ops(compiled) -> list[str]:  # type: ignore[no-untyped-def]
    return [n.op for n in compiled.graph.nodes]


@pytest.mark.parametrize("bias", [False, True])
def test_the_product_runs_over_the_padded_weight_folded(config: Config, on_cpu: None, bias: bool) -> None:
    torch.manual_seed(0)
    model, x = Head(bias=bias).eval(), randn(2, 20, 24)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config)
        off = streamfuse.compile(model, (x,), config.replace(product_row_alignment=False))
        assert any("padded to 16-byte rows" in note for note in compiled.graph.notes)
        assert PAD not in _ops(compiled)  # folded: the padded weight (and bias) are snapshots
        assert _ops(compiled).count("aten.slice.Tensor") == 1 and "aten.slice.Tensor" not in _ops(off)
        product = next(n for n in compiled.graph.nodes if n.op in ("aten.mm.default", "aten.addmm.default"))
        assert product.shape == (40, padded_columns(37, 4))
        want = model(x)
        for _ in range(2):
            got = compiled(x)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert got[0].stride() == (20 * 37, 37, 1)  # the logits returned with eager's strides (a copy)
        assert "aten.clone.default" in _ops(compiled)
        model.head.weight.mul_(-0.5)  # a weight changed in place (an optimizer step): the padded snapshot follows
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)


def test_aligned_rows_stay_as_traced(config: Config, on_cpu: None) -> None:
    torch.manual_seed(0)
    model, x = Head(vocab=40).eval(), randn(2, 20, 24)  # 160-byte rows
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config)
        assert "aten.slice.Tensor" not in _ops(compiled)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)


def test_the_rewrite_does_not_depend_on_the_batch(config: Config, on_cpu: None) -> None:
    """One row or many, the plan pads: graphs captured at two batch sizes must be the same function
    of the batch for the batch to be padded to a bucket (runtime/buckets.py)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(24), nn.Linear(24, 37)).eval()
    with torch.no_grad():
        for rows in (1, 3, 64):
            compiled = streamfuse.compile(model, (randn(rows, 24),), config)
            assert "aten.slice.Tensor" in _ops(compiled)
            x = randn(rows, 24)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
        compiled = streamfuse.compile(model, (randn(8, 24),), config)
        assert compiled.batch_check is not None
        compiled.batch_check(3)  # traced again at 3 and 9 rows: the same function of the batch (else raises)


@pytest.mark.parametrize("budget", [1, 1000])
def test_a_pad_past_the_fold_budget_is_undone(config: Config, on_cpu: None, budget: int) -> None:
    """A pad the fold does not take would run on every call: the product stays as traced. With 1000
    bytes the bias's pad (160 bytes) is folded and the weight's (3840) is not: the bias, which the
    fold dropped as unread, is put back."""
    torch.manual_seed(0)
    model, x = Head(bias=True).eval(), randn(2, 20, 24)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config.replace(fold_weights_max_bytes=budget))
        assert "aten.slice.Tensor" not in _ops(compiled) and PAD not in _ops(compiled)
        assert not any("padded to 16-byte rows" in note for note in compiled.graph.notes)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
    linear, x = nn.Linear(24, 37).eval(), randn(20, 24)  # undone where the product itself is the output
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", StreamfuseFallbackWarning)
        compiled = streamfuse.compile(linear, (x,), config.replace(fold_weights_max_bytes=budget))
        assert "aten.slice.Tensor" not in _ops(compiled) and "aten.clone.default" not in _ops(compiled)
        torch.testing.assert_close(compiled(x), linear(x), rtol=1e-5, atol=1e-6)


def test_a_product_returned_as_it_is_comes_back_contiguous(config: Config, on_cpu: None) -> None:
    """A Linear over a 2-D input: the product is the graph's output. The plan pads it and returns a
    contiguous copy of the slice, with the values and strides eager gives."""
    torch.manual_seed(0)
    model, x = nn.Linear(24, 37).eval(), randn(20, 24)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config)
        assert "aten.slice.Tensor" in _ops(compiled) and "aten.clone.default" in _ops(compiled)
        got, want = compiled(x), model(x)
        assert got.stride() == want.stride() == (37, 1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_under_autocast_the_cast_weight_is_padded(config: Config, on_cpu: None) -> None:
    """Under autocast the product reads `t(_to_copy(weight))`: the cast and the pad are folded into
    one snapshot, and the product runs in bfloat16 over it."""
    torch.manual_seed(0)
    model, x = Head(bias=True).eval(), randn(2, 20, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled = streamfuse.compile(model, (x,), config)
    assert "aten.slice.Tensor" in _ops(compiled) and PAD not in _ops(compiled)
    product = next(n for n in compiled.graph.nodes if n.op == "aten.addmm.default")
    assert product.dtype == torch.bfloat16 and product.shape == (40, padded_columns(37, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        want = model(x)
        got = compiled(x)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.stride() == w.stride()
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)


def test_cpu_weights_are_not_padded(config: Config) -> None:
    torch.manual_seed(0)
    model, x = Head().eval(), randn(2, 20, 24)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config)
    assert "aten.slice.Tensor" not in _ops(compiled)


class Transposed(nn.Module):
    """The product's result read through a transpose: an alias whose strides the rewrite does not
    recompute, so the product stays as traced."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(24, 37, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x).transpose(0, 1) * 2.0


def test_a_product_read_through_another_alias_stays(config: Config, on_cpu: None) -> None:
    torch.manual_seed(0)
    model, x = Transposed().eval(), randn(20, 24)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config)
        assert "aten.slice.Tensor" not in _ops(compiled)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_gpu_an_odd_vocabulary_is_padded(config: Config, dtype: torch.dtype) -> None:
    """GPT-2's vocabulary (50257) at 256 tokens: the plan pads its product's weight, and matches eager
    (float64 reference) through both entry points."""
    torch.manual_seed(0)
    model = Head(vocab=50257).cuda().to(dtype).eval()
    x = randn(2, 128, 24, dtype=dtype, device="cuda")
    tol = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2e-2)}[dtype]
    with torch.no_grad():
        want = [t.to(dtype) for t in copy.deepcopy(model).double()(x.double())]
        compiled = streamfuse.compile(model, (x,), config)
        assert "aten.slice.Tensor" in _ops(compiled) and PAD not in _ops(compiled)
        for got in (compiled(x), torch.compile(model, backend=streamfuse.make_backend(config))(x)):
            for g, w in zip(got, want, strict=True):
                assert g.stride() == w.stride()  # eager's strides, not the padded rows
                torch.testing.assert_close(g, w, rtol=tol[0], atol=tol[1])


def test_the_backend_infers_and_trains_with_it(config: Config, on_cpu: None) -> None:
    """Inference through the backend folds the pad as streamfuse.compile does; training (the weights
    are the graph's inputs there, not folded) keeps the product as traced, with eager's gradients."""
    torch.manual_seed(0)
    model, x = Head(bias=True), randn(2, 20, 24)
    with torch.no_grad():
        eval_model = copy.deepcopy(model).eval()
        backend = torch.compile(eval_model, backend=streamfuse.make_backend(config))
        torch.testing.assert_close(backend(x), eval_model(x), rtol=1e-5, atol=1e-6)
        bound = [g for g in list(backend_module.compiled_graphs) if isinstance(g, backend_module.StaticParamsGraph)]
        assert any("padded to 16-byte rows" in note for note in bound[-1].compiled.graph.notes)
    reference = copy.deepcopy(model)
    trained = torch.compile(model, backend=streamfuse.make_backend(config))
    for m in (trained, reference):
        logits, s = m(x)
        (logits.square().mean() + s.mean()).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
