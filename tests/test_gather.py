"""Embedding lookups generated as GATHER ops (codegen/gather.py): the table row at a loaded index,
fused with the adds and the layer norm that follow it, as every transformer's input block has them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_to_reference, randn

import streamfuse
from streamfuse.fusion.groups import GroupKind, read_bytes
from streamfuse.ir.ops import OpKind
from streamfuse.schedule.cost import group_bytes


def gathers(compiled) -> list:  # type: ignore[no-untyped-def]
    return [g for g in compiled.plan.groups for n in g.nodes if n.kind is OpKind.GATHER]


def _ids(*shape: int, high: int, seed: int, dtype: torch.dtype = torch.int64, device: torch.device) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_token_and_position_embeddings_fuse_into_the_layer_norm(config, device, dtype, id_dtype) -> None:  # type: ignore[no-untyped-def]
    """BERT's input block: word + position + token-type lookups, summed and normalized, in one
    kernel with no ATen launch, equal to eager at the example ids and at other ids."""
    vocab, dim, batch, seq = 97, 48, 3, 7
    words, positions, types = (randn(n, dim, dtype=dtype, device=device, seed=s)
                               for n, s in ((vocab, 1), (16, 2), (2, 3)))
    weight, bias = randn(dim, dtype=dtype, device=device, seed=4), randn(dim, dtype=dtype, device=device, seed=5)

    def block(ids: torch.Tensor, kinds: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = F.embedding(ids, words) + F.embedding(pos, positions)[None] + F.embedding(kinds, types)
        return F.layer_norm(x, (dim,), weight, bias)

    ids = _ids(batch, seq, high=vocab, seed=6, dtype=id_dtype, device=device)
    kinds = _ids(batch, seq, high=2, seed=7, dtype=id_dtype, device=device)
    compiled = streamfuse.compile(block, (ids, kinds), config)
    assert compiled.stats["aten_kernels"] == 0, compiled.explain(source=False)
    fused = gathers(compiled)
    assert len({g.id for g in fused}) == 1 and fused[0].kind is GroupKind.REDUCTION
    assert_close_to_reference(compiled(ids, kinds), block, (ids, kinds))
    other = (_ids(batch, seq, high=vocab, seed=8, dtype=id_dtype, device=device), kinds.flip(0))
    assert_close_to_reference(compiled(*other), block, other)


def test_a_lookup_alone_is_a_generated_kernel(config, device) -> None:  # type: ignore[no-untyped-def]
    """Ids of any rank (here [2, 3, 5]), a table read through a transposed view's strides."""
    table = randn(40, 12, device=device, seed=9).t().contiguous().t()  # column-major storage
    fn = lambda ids: F.embedding(ids, table) * 2.0
    ids = _ids(2, 3, 5, high=40, seed=10, device=device)
    compiled = streamfuse.compile(fn, (ids,), config)
    assert gathers(compiled) and compiled.stats["aten_kernels"] == 0
    torch.testing.assert_close(compiled(ids), fn(ids))


def test_a_table_of_one_element(config, device) -> None:  # type: ignore[no-untyped-def]
    """A [1, 1] table: the kernel read its one element through the bare pointer with a block mask,
    which Triton rejects, and the plan fell back to eager (found by the CPU fuzz, session 39)."""
    table = randn(1, 1, device=device, seed=13)
    fn = lambda t, ids: F.embedding(ids, t) * 3.0
    ids = torch.zeros(5, dtype=torch.int64, device=device)
    compiled = streamfuse.compile(fn, (table, ids), config)
    assert gathers(compiled)
    torch.testing.assert_close(compiled(table, ids), fn(table, ids))
    bad = ids.clone()
    bad[1] = 1
    assert torch.isnan(compiled(table, bad)[1]).all()


def test_an_index_outside_the_table_gives_nan_not_a_stray_read(config, device) -> None:  # type: ignore[no-untyped-def]
    """Eager raises on such an index; the generated kernel reads nothing for it and writes NaN, so
    the error shows in the result instead of whatever lies past the table."""
    table = randn(10, 8, device=device, seed=11)
    fn = lambda ids: F.embedding(ids, table) + 1.0
    ids = _ids(6, high=10, seed=12, device=device)
    compiled = streamfuse.compile(fn, (ids,), config)
    assert gathers(compiled)
    bad = ids.clone()
    bad[2], bad[4] = 10, -1
    out = compiled(bad)
    assert torch.isnan(out[2]).all() and torch.isnan(out[4]).all()
    keep = torch.tensor([0, 1, 3, 5], device=device)
    torch.testing.assert_close(out[keep], fn(ids[keep]))


def test_a_computed_table_is_not_fused_into_its_lookup(config, device) -> None:  # type: ignore[no-untyped-def]
    table = randn(10, 8, device=device, seed=13)
    fn = lambda ids, t: F.embedding(ids, t * 0.5) + 1.0
    ids = _ids(4, high=10, seed=14, device=device)
    compiled = streamfuse.compile(fn, (ids, table), config)
    assert "reads its table from memory" in compiled.explain(source=False)
    torch.testing.assert_close(compiled(ids, table), fn(ids, table))


def test_a_table_counts_the_rows_looked_up_not_its_size(config, device) -> None:  # type: ignore[no-untyped-def]
    """The cost model and the fusion rules weigh a kernel by the bytes it moves: a decode step reads
    one row of a 50k-row table, not the table."""
    table = randn(5000, 64, device=device, seed=15)
    fn = lambda ids: F.embedding(ids, table).sum(-1)
    ids = _ids(1, 1, high=5000, seed=16, device=device)
    compiled = streamfuse.compile(fn, (ids,), config)
    (group,) = gathers(compiled)
    (tab,) = [n for n in group.inputs if tuple(n.shape) == (5000, 64)]
    assert read_bytes(tab, group.nodes) == 64 * 4
    assert group_bytes(group) < 1024  # one row in, one value out, the id
    torch.testing.assert_close(compiled(ids), fn(ids))
    # read whole as well (its first row scales every lookup): the kernel is charged the whole table
    both = lambda ids, t: F.embedding(ids, t) * t[0]
    compiled = streamfuse.compile(both, (ids, table), config)
    (group,) = gathers(compiled)
    (tab,) = [n for n in group.inputs if tuple(n.shape) == (5000, 64)]
    assert read_bytes(tab, group.nodes) == 5000 * 64 * 4
    torch.testing.assert_close(compiled(ids, table), both(ids, table))
