"""runtime/writeback.scatter_into_fresh: a scatter into a buffer the same call fills runs in place.

The embedding backward decomposes to full + index_put(accumulate=True); the functional index_put
copies the zeros into a second buffer first (GPT-2's word-embedding gradient: 147 MiB twice).
An embedding gradient that nothing folds runs as ATen's embedding_dense_backward by default
(Config.embedding_backward, tests/test_scatter_add.py): these tests turn that off to keep the scatter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import streamfuse
import streamfuse.capture.backend as backend_module
from streamfuse.runtime.steps import NodeStep


def _in_place_scatters(exe) -> list[str]:  # type: ignore[no-untyped-def]
    return [c.node.name for s in exe.steps if isinstance(s, NodeStep) for c in s.calls
            if c.target is torch.ops.aten.index_put_.default and c.node.op == "aten.index_put.default"]


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(50, 16), nn.Linear(16, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)))


def test_the_embedding_gradient_accumulates_in_place_and_matches_eager(config: streamfuse.Config) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, eager = _Embed(), _Embed()
    eager.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend=streamfuse.make_backend(config.replace(embedding_backward=False, backend_cuda_graphs=False)))
    first = len(backend_module.compiled_graphs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = torch.randint(0, 50, (4, 12), generator=gen)  # repeated ids: the accumulation matters
        w = torch.randn(4, 12, 8, generator=gen)
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
        (compiled(ids) * w).sum().backward()
        (eager(ids) * w).sum().backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    exes = [getattr(g, "compiled", g).base for g in backend_module.compiled_graphs[first:]]
    backward = [e for e in exes if any(n.op == "aten.index_put.default" for n in e.graph.nodes)]
    assert backward, [n.op for e in exes for n in e.graph.nodes]
    assert _in_place_scatters(backward[0]), [(c.node.op, c.target) for s in backward[0].steps
                                             if isinstance(s, NodeStep) for c in s.calls]
    assert any("scatter(s)" in note for note in backward[0].graph.notes)


@pytest.mark.parametrize("other_reader", [False, True])
def test_a_buffer_read_elsewhere_keeps_its_copy(other_reader: bool, config: streamfuse.Config) -> None:
    """The zeros are also read by another op: updating them in place would change what it reads."""
    def f(idx: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        z = torch.zeros(8, 4, device=v.device)
        y = torch.ops.aten.index_put.default(z, [idx], v, True)
        return y * 2 + (z * s).sum() if other_reader else y * 2

    idx, v, s = torch.tensor([1, 3, 1, 7]), torch.randn(4, 4), torch.randn(8, 4)
    compiled = streamfuse.compile(f, (idx, v, s), config.replace(embedding_backward=False, fold_constants=False))
    torch.testing.assert_close(compiled(idx, v, s), f(idx, v, s), rtol=1e-6, atol=1e-6)
    assert bool(_in_place_scatters(compiled.base)) is not other_reader


def test_a_buffer_that_is_also_the_scatters_source_keeps_its_copy(config: streamfuse.Config) -> None:
    """index_put(z, [idx], z) reads z as its values too: in place, the update would read itself."""
    def f(idx: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        z = torch.zeros(4, 4, device=s.device)
        return torch.ops.aten.index_put.default(z, [idx], z, True) + s

    idx, s = torch.tensor([0, 1, 2, 3]), torch.randn(4, 4)
    compiled = streamfuse.compile(f, (idx, s), config.replace(embedding_backward=False, fold_constants=False))
    torch.testing.assert_close(compiled(idx, s), f(idx, s))
    assert not _in_place_scatters(compiled.base)


def test_a_buffer_made_on_another_stream_keeps_its_copy(config: streamfuse.Config) -> None:
    """On several streams the buffer must be made on the scatter's (the allocator ties its memory to
    that stream); on one stream, where the executable passes no stream map, it always is."""
    from streamfuse.ir.scatter_add import FILLS
    from streamfuse.runtime.writeback import scatter_into_fresh

    def f(idx: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        z = torch.zeros(8, 4, device=v.device)
        return torch.ops.aten.index_put.default(z, [idx], v, True) * 2

    idx, v = torch.tensor([1, 3, 1, 7]), torch.randn(4, 4)
    compiled = streamfuse.compile(f, (idx, v), config.replace(embedding_backward=False, fold_constants=False, store_in_place=False))
    exe = compiled.base
    assert not _in_place_scatters(exe)  # store_in_place off: the pass did not run at build
    owner = {n: i for i, g in enumerate(exe.plan.groups) for n in g.nodes}
    fill = next(n for n in exe.graph.nodes if n.op in FILLS)
    scatter = next(n for n in exe.graph.nodes if n.op == "aten.index_put.default")
    assert scatter_into_fresh(exe.plan, exe.steps, exe.graph, {owner[fill]: 1, owner[scatter]: 0}) == 0
    assert not _in_place_scatters(exe)
    assert scatter_into_fresh(exe.plan, exe.steps, exe.graph, {}) == 1
    assert _in_place_scatters(exe) == [scatter.name]
    torch.testing.assert_close(compiled(idx, v), f(idx, v))
