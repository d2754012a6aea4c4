"""Sibling Linears merged in training graphs (capture/sibling_linear.py, Config.merge_sibling_linears).

The rewrite runs on the graph Dynamo hands the backend: the pass tests below run it on such graphs
directly (what merges and what must not), and the training tests compare loss, every gradient and
every parameter after SGD steps with eager, through both executors.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_training import train_and_compare
from torch import nn

import streamfuse
from streamfuse.capture.sibling_linear import merge_sibling_linears


class Attention(nn.Module):
    """Query, key and value projections of one input, as Hugging Face's BERT writes them."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_dim: int | None = None, bias: bool = True) -> None:
        super().__init__()
        kv_dim = kv_dim or dim
        self.heads, self.kv_heads = heads, heads * kv_dim // dim
        self.query = nn.Linear(dim, dim, bias=bias)
        self.key = nn.Linear(dim, kv_dim, bias=bias)
        self.value = nn.Linear(dim, kv_dim, bias=bias)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.query(x).view(b, s, self.heads, -1).transpose(1, 2)
        k = self.key(x).view(b, s, self.kv_heads, -1).transpose(1, 2)
        v = self.value(x).view(b, s, self.kv_heads, -1).transpose(1, 2)
        a = nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=self.kv_heads != self.heads)
        return self.out(a.transpose(1, 2).reshape(b, s, -1)) + x


def _dynamo_graph(fn: Any, *inputs: torch.Tensor) -> tuple[torch.fx.GraphModule, list[Any]]:
    seen: list[tuple[torch.fx.GraphModule, list[Any]]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        seen.append((gm, example_inputs))
        return gm

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*inputs)
    torch._dynamo.reset()
    assert len(seen) == 1
    return seen[0]


def _linears(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is torch._C._nn.linear)


@pytest.mark.parametrize(("kv_dim", "bias"), [(None, True), (16, True), (None, False)])
def test_query_key_value_merge_into_one_linear_with_eager_results(kv_dim: int | None, bias: bool) -> None:
    torch.manual_seed(0)
    model = Attention(kv_dim=kv_dim, bias=bias)
    x = torch.randn(2, 6, 32)
    gm, inputs = _dynamo_graph(model, x)
    assert _linears(gm) == 4
    assert merge_sibling_linears(gm, inputs) == 2
    assert _linears(gm) == 2  # q/k/v as one, and the output projection
    torch.testing.assert_close(gm(*inputs)[0], model(x), rtol=1e-5, atol=1e-6)


def test_graphs_that_train_nothing_are_left_alone() -> None:
    model = Attention()
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        gm, inputs = _dynamo_graph(model, x)
        assert merge_sibling_linears(gm, inputs) == 0
    assert _linears(gm) == 4


def test_a_linear_whose_result_is_a_graph_output_is_not_merged() -> None:
    """It would come back as a column slice where eager gives a dense tensor; the other two merge."""
    torch.manual_seed(0)
    a, b, c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a(x), b(x) * c(x)

    x = torch.randn(4, 8)
    gm, inputs = _dynamo_graph(fn, x)
    assert merge_sibling_linears(gm, inputs) == 1
    out = gm(*inputs)
    assert out[0].is_contiguous()
    torch.testing.assert_close(out[0], a(x))
    torch.testing.assert_close(out[1], b(x) * c(x))


def test_a_view_the_slice_cannot_take_keeps_its_linear_apart() -> None:
    """`.view(-1)` of a column slice is invalid: that Linear stays alone, the others still merge."""
    torch.manual_seed(0)
    a, b, c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return a(x).view(-1).sum() + (b(x) * c(x)).sum()

    x = torch.randn(4, 8)
    gm, inputs = _dynamo_graph(fn, x)
    assert merge_sibling_linears(gm, inputs) == 1
    torch.testing.assert_close(gm(*inputs)[0], fn(x))


def test_linears_of_other_inputs_or_widths_do_not_merge() -> None:
    torch.manual_seed(0)
    a, b, c = nn.Linear(8, 8), nn.Linear(6, 8), nn.Linear(8, 8)

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (a(x) + b(y) + c(x.sin())).sum()  # in_features differ; c reads another node

    x, y = torch.randn(4, 8), torch.randn(4, 6)
    gm, inputs = _dynamo_graph(fn, x, y)
    assert merge_sibling_linears(gm, inputs) == 0


@pytest.mark.parametrize("kv_dim", [None, 16])
def test_training_with_merged_projections_matches_eager(kv_dim: int | None, train_config: streamfuse.Config) -> None:
    """Three SGD steps: loss, every gradient (each weight's rows of the merged weight gradient) and
    every parameter after each update against eager."""
    torch.manual_seed(1)
    model = nn.Sequential(Attention(kv_dim=kv_dim), Attention(kv_dim=kv_dim))
    batches = [(torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(i)),) for i in range(3)]
    train_and_compare(model, batches, lambda m, x: m(x).pow(2).mean(), train_config.replace(merge_sibling_linears=True))


def test_a_text_model_trains_like_eager_with_merged_projections(config: streamfuse.Config,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Hugging Face's BERT (two layers, padding mask): its query/key/value merge in every layer."""
    transformers = pytest.importorskip("transformers")
    from streamfuse.capture import backend

    torch.manual_seed(5)
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    model = transformers.BertForMaskedLM(cfg).train()
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    ids = [torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(60 + i)) for i in range(2)]
    merged: list[int] = []

    def spy(gm: torch.fx.GraphModule, inputs: list[Any]) -> int:
        merged.append(merge_sibling_linears(gm, inputs))
        return merged[-1]

    monkeypatch.setattr(backend, "merge_sibling_linears", spy)
    train_and_compare(model, [(x,) for x in ids], lambda m, x: m(input_ids=x, attention_mask=mask, labels=x).loss,
                      config.replace(executor="reference", merge_sibling_linears=True))
    assert merged == [4]  # two per layer: key and value into query's


@pytest.mark.gpu
def test_merged_projections_train_like_eager_with_cuda_graphs(config: streamfuse.Config) -> None:
    """On CUDA the training graphs replay (runtime/replay.py): the three weights' gradients are row
    blocks of one buffer, handed out as views, which autograd adopts as `.grad`; five SGD steps against
    eager, so replays follow the recordings."""
    torch.manual_seed(2)
    model = nn.Sequential(Attention(dim=64, heads=4, kv_dim=32), Attention(dim=64, heads=4)).cuda()
    batches = [(torch.randn(4, 16, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(i)),)
               for i in range(5)]
    train_and_compare(model, batches, lambda m, x: m(x).pow(2).mean(), config.replace(merge_sibling_linears=True))
