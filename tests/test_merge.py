"""Sibling convolutions merged into one (ir/merge.py): which merge, and the results against eager
(CPU: ATen's convolutions and the generated epilogues in Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers import assert_close_to_reference

import streamfuse
from streamfuse.ir.fold import SnapshotCache
from streamfuse.ir.merge import merge_sibling_convolutions, stacked


def conv_bn(cin: int, cout: int, k: int, **kw: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, bias=False, **kw), nn.BatchNorm2d(cout), nn.ReLU())


class Inception(nn.Module):
    """GoogLeNet's block: three 1x1 convolutions read the input (two of them reduce before a 3x3),
    the fourth branch pools first; a 3x3 beside them reads the input too but has another geometry."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.b1 = conv_bn(c, 8, 1)
        self.b2 = nn.Sequential(conv_bn(c, 6, 1), conv_bn(6, 8, 3, padding=1))
        self.b3 = nn.Sequential(conv_bn(c, 4, 1), conv_bn(4, 4, 3, padding=1))
        self.b4 = nn.Sequential(nn.MaxPool2d(3, 1, 1), conv_bn(c, 4, 1))
        self.side = conv_bn(c, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x), self.side(x)], 1)


def inception() -> nn.Module:
    torch.manual_seed(0)
    model = Inception().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
    return model


def convolutions(compiled: streamfuse.CompiledGraph) -> list[tuple[int, ...]]:
    return sorted(tuple(n.shape) for n in compiled.graph.nodes if n.op == "aten.convolution.default")


@pytest.mark.parametrize("batch", [1, 3])
def test_three_sibling_1x1_convolutions_run_as_one_and_match_eager(config, batch: int) -> None:  # type: ignore[no-untyped-def]
    model = inception()
    x = torch.randn(batch, 16, 10, 10)
    with torch.no_grad():
        merged = streamfuse.compile(model, (x,), config.replace(merge_sibling_convolutions=True))
        plain = streamfuse.compile(model, (x,), config)
        assert len(convolutions(plain)) == 7
        # b1, b2's and b3's 1x1 reductions: one convolution of 8 + 6 + 4 channels; the pooled
        # branch's 1x1 reads another input and the side 3x3 has another geometry
        assert convolutions(merged) == sorted([(batch, 18, 10, 10), (batch, 8, 10, 10), (batch, 4, 10, 10),
                                              (batch, 4, 10, 10), (batch, 4, 10, 10)])
        assert any("3 convolutions reading" in note for note in merged.graph.notes)
        for seed in range(3):
            x = torch.randn(batch, 16, 10, 10, generator=torch.Generator().manual_seed(seed))
            assert_close_to_reference(merged(x), model, [x])
        assert "merged into" in merged.explain(source=False)
        other = torch.randn(batch + 1, 16, 10, 10)  # another batch: padded to its bucket, captured and merged again
        assert_close_to_reference(merged(other), model, [other])


def test_convolutions_with_live_weights_or_a_graph_output_stay_alone(config) -> None:  # type: ignore[no-untyped-def]
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(8, 4, 1), nn.Conv2d(8, 4, 1)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.relu(self.a(x)), torch.relu(self.b(x))

    x = torch.randn(2, 8, 5, 5)
    model = Two().eval()
    with torch.no_grad():
        # no batch-norm: the weights are the module's live parameters, not snapshots
        compiled = streamfuse.compile(model, (x,), config.replace(merge_sibling_convolutions=True))
        assert len(convolutions(compiled)) == 2
        assert_close_to_reference(compiled(x), model, [x])

        class Out(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a, self.b = nn.Conv2d(8, 4, 1), nn.Conv2d(8, 4, 1)

            def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return self.a(x), self.b(x)

        out = Out().eval()
        graph = streamfuse.compile(out, (x,), config).graph
        for n in graph.nodes:  # pretend the weights were folded: only the graph outputs keep them alone
            if n.op == "aten.convolution.default":
                graph.snapshots.update(a for a in n.args[1:3] if a is not None)
        assert merge_sibling_convolutions(graph, SnapshotCache()) == 0


def test_merge_cache_stacks_once_per_set_of_weights() -> None:
    cache = SnapshotCache()
    a, b = torch.randn(4, 3, 1, 1), torch.randn(2, 3, 1, 1)
    first = stacked(cache, (a, b))
    assert stacked(cache, (a, b)) is first and torch.equal(first, torch.cat([a, b]))
    assert stacked(cache, (b, a)) is not first
    cl = torch.randn(4, 3, 3, 3).contiguous(memory_format=torch.channels_last)
    assert stacked(cache, (cl, cl)).is_contiguous(memory_format=torch.channels_last)
