"""ir/scatter_add.py: add(x, index_put(zeros, idx, v, accumulate=True)) -> index_put(x, idx, v, True),
and runtime/writeback.scatter_into_fresh running that scatter in place on a product's buffer.

A tied weight's gradient (GPT-2's word embedding is its LM head) is the LM head's product plus the
embedding's scatter into zeros: three vocabulary-sized buffers before, one after."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import streamfuse
import streamfuse.capture.backend as backend_module
from streamfuse.ir.scatter_add import fold_scatter_add
from streamfuse.runtime.steps import NodeStep

index_put = torch.ops.aten.index_put.default


def _scatters(exe) -> list[tuple[str, bool]]:  # type: ignore[no-untyped-def]
    """(node name, runs in place) of each ATen index_put step."""
    return [(c.node.name, c.target is torch.ops.aten.index_put_.default) for s in exe.steps
            if isinstance(s, NodeStep) for c in s.calls if c.node.op == "aten.index_put.default"]


def _ops(exe) -> list[str]:  # type: ignore[no-untyped-def]
    return [n.op for n in exe.graph.nodes]


def _inputs(gen: torch.Generator, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    a = torch.randn(6, 40, generator=gen, dtype=dtype)
    b = torch.randn(6, 8, generator=gen, dtype=dtype)
    idx = torch.tensor([3, 0, 3, 39, 7, 3, 12])  # repeated: the accumulation order matters
    v = torch.randn(7, 8, generator=gen, dtype=dtype)
    return a, b, idx, v


def _tied(a: torch.Tensor, b: torch.Tensor, idx: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A product (the LM head's weight gradient, through two transposes) plus a scatter into zeros."""
    head = torch.mm(a.t(), b).t().t()
    return head + index_put(torch.zeros(40, 8, dtype=a.dtype), [idx], v, True)


@pytest.mark.parametrize("swapped", [False, True])
def test_the_sum_becomes_one_scatter_in_place_on_the_product(swapped: bool, config: streamfuse.Config) -> None:
    def f(a: torch.Tensor, b: torch.Tensor, idx: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        head = torch.mm(a.t(), b).t().t()
        scatter = index_put(torch.zeros(40, 8, dtype=a.dtype), [idx], v, True)
        return (scatter + head if swapped else head + scatter) * 3

    args = _inputs(torch.Generator().manual_seed(0))
    compiled = streamfuse.compile(f, args, config.replace(fold_constants=False, max_streams=1))
    torch.testing.assert_close(compiled(*args), f(*args), rtol=1e-12, atol=1e-12)
    exe = compiled.base
    assert "aten.full.default" not in _ops(exe) and "aten.zeros.default" not in _ops(exe), _ops(exe)
    assert "aten.add.Tensor" not in _ops(exe), _ops(exe)
    assert [in_place for _, in_place in _scatters(exe)] == [True], _scatters(exe)
    assert any("folded into the scatter" in note for note in exe.graph.notes), exe.graph.notes


def test_the_fold_off_keeps_the_add(config: streamfuse.Config) -> None:
    args = _inputs(torch.Generator().manual_seed(1))
    compiled = streamfuse.compile(_tied, args, config.replace(fold_constants=False, fold_scatter_add=False))
    torch.testing.assert_close(compiled(*args), _tied(*args), rtol=1e-12, atol=1e-12)
    assert not any("folded into the scatter" in note for note in compiled.base.graph.notes)


def test_a_product_read_elsewhere_is_folded_but_copied(config: streamfuse.Config) -> None:
    """The product is also a result: the scatter must not update it in place (the functional
    index_put copies it), but the zeros and the add still go."""
    def f(a: torch.Tensor, b: torch.Tensor, idx: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        head = torch.mm(a.t(), b)
        return head + index_put(torch.zeros(40, 8, dtype=a.dtype), [idx], v, True), head

    args = _inputs(torch.Generator().manual_seed(2))
    compiled = streamfuse.compile(f, args, config.replace(fold_constants=False, max_streams=1))
    for got, want in zip(compiled(*args), f(*args), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert [in_place for _, in_place in _scatters(compiled.base)] == [False], _scatters(compiled.base)


def test_an_input_addend_is_folded_but_never_updated(config: streamfuse.Config) -> None:
    """x is the caller's tensor: the folded scatter copies it; the caller's tensor stays as it was."""
    def f(x: torch.Tensor, idx: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return x + index_put(torch.zeros(40, 8, dtype=x.dtype), [idx], v, True)

    _, _, idx, v = _inputs(torch.Generator().manual_seed(3))
    x = torch.randn(40, 8, dtype=torch.float64)
    before = x.clone()
    compiled = streamfuse.compile(f, (x, idx, v), config.replace(fold_constants=False, max_streams=1))
    torch.testing.assert_close(compiled(x, idx, v), f(before, idx, v), rtol=1e-12, atol=1e-12)
    assert torch.equal(x, before)
    assert [in_place for _, in_place in _scatters(compiled.base)] == [False]


@pytest.mark.parametrize("case", ["no-accumulate", "fill-one", "broadcast"])
def test_what_is_not_a_sum_into_zeros_stays(case: str, config: streamfuse.Config) -> None:
    """Without accumulate the scatter overwrites (x + it is not a scatter into x); a fill of 1 adds
    1 everywhere; an addend of another shape broadcasts."""
    def f(a: torch.Tensor, b: torch.Tensor, idx: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        head = torch.mm(a.t(), b)
        fill = torch.ones(40, 8, dtype=a.dtype) if case == "fill-one" else torch.zeros(40, 8, dtype=a.dtype)
        scatter = index_put(fill, [idx[:3]] if case == "no-accumulate" else [idx],
                            v[:3] if case == "no-accumulate" else v, case != "no-accumulate")
        return (head[:1] if case == "broadcast" else head) + scatter

    args = _inputs(torch.Generator().manual_seed(4))
    compiled = streamfuse.compile(f, args, config.replace(fold_constants=False))
    torch.testing.assert_close(compiled(*args), f(*args), rtol=1e-12, atol=1e-12)
    assert not any("folded into the scatter" in note for note in compiled.base.graph.notes)


def test_fold_scatter_add_counts_what_it_rewrote() -> None:
    from streamfuse.capture.export import capture
    from streamfuse.ir.from_fx import graph_from_fx

    args = _inputs(torch.Generator().manual_seed(5))
    graph = graph_from_fx(capture(_tied, args).gm)
    assert fold_scatter_add(graph) == 1
    assert fold_scatter_add(graph) == 0  # nothing left to fold
    graph.validate()


def _train_like_eager(make: Callable[[], nn.Module], config: streamfuse.Config, steps: int, outputs: int,
                      seed: int) -> list[Any]:
    """`make()` in float64 trained through the backend beside eager for `steps` SGD steps on random
    ids below 60 ([3, 10]), every gradient checked against eager's each step; returns the compiled
    graphs' executables."""
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model, eager = make().double(), make().double()
    eager.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend=streamfuse.make_backend(config))
    first = len(backend_module.compiled_graphs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        ids = torch.randint(0, 60, (3, 10), generator=gen)
        w = torch.randn(3, 10, outputs, generator=gen, dtype=torch.float64)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        (compiled(ids) * w).sum().backward()
        (eager(ids) * w).sum().backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
        for opt in opts:
            opt.step()
    return [getattr(g, "compiled", g).base for g in backend_module.compiled_graphs[first:]]


class _TiedLM(nn.Module):
    """An embedding whose table is also the output layer's weight (GPT-2's word embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(60, 16)
        self.mix = nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.emb(ids)))
        return h @ self.emb.weight.t()


@pytest.mark.parametrize("graphs", [False, True])
def test_a_tied_embedding_trains_like_eager(graphs: bool, config: streamfuse.Config) -> None:
    """Through the backend, several SGD steps: the tied weight's gradient is the folded scatter's, in
    place on the product's buffer (float64: only the order of additions differs from eager)."""
    exes = _train_like_eager(_TiedLM, config.replace(backend_cuda_graphs=graphs), steps=4, outputs=60, seed=0)
    backward = [e for e in exes if any(n.op == "aten.index_put.default" for n in e.graph.nodes)]
    assert backward and any("folded into the scatter" in note for e in backward for note in e.graph.notes)


class _Untied(nn.Module):
    """Two embeddings used once each (BERT's word and token-type embeddings): their gradients stay
    scatters into zeros, one of them over a single repeated index."""

    def __init__(self) -> None:
        super().__init__()
        self.words = nn.Embedding(60, 16)
        self.types = nn.Embedding(2, 16)
        self.out = nn.Linear(16, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.words(ids) + self.types(torch.zeros_like(ids))))


@pytest.mark.parametrize("kernel", [True, False])
def test_an_embedding_gradient_runs_as_eagers_embedding_backward(kernel: bool, config: streamfuse.Config) -> None:
    """Through the backend, several SGD steps in float64: each embedding's gradient (the token types'
    all at index 0) is eager's, and with Config.embedding_backward the backward graph runs ATen's
    embedding_dense_backward for both instead of the decomposition's index_put into zeros."""
    exes = _train_like_eager(_Untied, config.replace(embedding_backward=kernel), steps=3, outputs=5, seed=2)
    ops = [n.op for e in exes for n in e.graph.nodes]
    assert ops.count("aten.embedding_dense_backward.default") == (2 if kernel else 0), ops
    assert ops.count("aten.index_put.default") == (0 if kernel else 2), ops


@pytest.mark.parametrize("case", ["two-indices", "zeros-read-elsewhere", "no-accumulate", "fill-one", "fill-is-values",
                                  "negative-indices"])
def test_scatters_that_are_not_an_embedding_gradient_stay(case: str, config: streamfuse.Config) -> None:
    """Two index tensors, a zero fill something else reads, a scatter that overwrites, a fill of one,
    the fill scattered into itself, negative indices: each stays index_put, with eager's values (a
    user's scatter is never taken for an embedding's gradient: the backend keeps that op whole where
    autograd made it)."""
    def f(idx: torch.Tensor, v: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        fill = torch.ones(40, 8, dtype=v.dtype) if case == "fill-one" else torch.zeros(40, 8, dtype=v.dtype)
        if case == "two-indices":
            return index_put(fill, [idx, idx % 8], v[:, 0], True)
        if case == "negative-indices":  # legal for index_put, not for embedding_dense_backward
            return index_put(fill, [idx - 40], v, True)
        if case == "fill-is-values":  # the zeros scattered into themselves
            return index_put(fill, [torch.arange(40) % 5], fill, True) + v.sum()
        out = index_put(fill, [idx[:3]] if case == "no-accumulate" else [idx],
                        v[:3] if case == "no-accumulate" else v, case != "no-accumulate")
        return (out, fill * 2) if case == "zeros-read-elsewhere" else out

    gen = torch.Generator().manual_seed(6)
    args = (torch.tensor([3, 0, 3, 39, 7, 3, 12]), torch.randn(7, 8, generator=gen, dtype=torch.float64))
    compiled = streamfuse.compile(f, args, config.replace(fold_constants=False))
    for got, want in zip(torch.utils._pytree.tree_leaves(compiled(*args)), torch.utils._pytree.tree_leaves(f(*args)),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    ops = [n.op for n in compiled.base.graph.nodes]
    assert "aten.embedding_dense_backward.default" not in ops and "aten.index_put.default" in ops, ops


embedding_backward = torch.ops.aten.embedding_dense_backward.default


@pytest.mark.parametrize("case", ["folds", "padding-index", "int32-ids", "float32-into-float64", "bfloat16"])
def test_a_sum_with_an_embedding_gradient_folds_where_index_put_computes_the_same(
        case: str) -> None:
    """add(x, embedding_dense_backward(g, ids, W, -1, False)) -> index_put(x, [ids], g, True): the tied
    weight's fold with the op kept whole. Not with a padding index (the op leaves that row at zero),
    int32 indices, a gradient of another dtype than x, or 16-bit ones (the op sums them in float32,
    index_put into x would sum in x's dtype). The
    values of the fold are checked by training the tied embedding above."""
    gen = torch.Generator().manual_seed(8)
    ids = torch.tensor([[3, 0, 3], [39, 7, 3]], dtype=torch.int32 if case == "int32-ids" else torch.int64)
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float64
    g = torch.randn(2, 3, 8, generator=gen, dtype=torch.float32 if case == "float32-into-float64" else dtype)
    a, b = torch.randn(6, 40, generator=gen, dtype=dtype), torch.randn(6, 8, generator=gen, dtype=dtype)
    padding = 3 if case == "padding-index" else -1

    def f(a: torch.Tensor, b: torch.Tensor, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        grad = embedding_backward(g, ids, 40, padding, False)
        return (torch.mm(a.t(), b) + grad.to(a.dtype)) * 3

    from torch.fx.experimental.proxy_tensor import make_fx

    from streamfuse.ir.from_fx import graph_from_fx

    graph = graph_from_fx(make_fx(f)(a, b, ids, g))  # no decomposition: the op whole, as the backend keeps it
    assert fold_scatter_add(graph) == (1 if case == "folds" else 0)
    graph.validate()
    ops = [n.op for n in graph.nodes]
    assert ("aten.embedding_dense_backward.default" in ops) is (case != "folds"), ops
    if case == "folds":
        (scatter,) = [n for n in graph.nodes if n.op == "aten.index_put.default"]
        assert scatter.args[2].op == "input" and scatter.args[3] is True


def test_the_backends_table_keeps_the_embedding_gradient_whole_only_when_asked() -> None:
    from streamfuse.capture.decomp import decomposition_table

    assert embedding_backward in decomposition_table(False)
    assert embedding_backward not in decomposition_table(True)
    assert torch.ops.aten.index_put.default not in decomposition_table(True)
