"""Merge sibling products over weights (attention's query, key and value projections) in inference
graphs: one product over the weights concatenated, each result a column slice of it.

    addmm(bq, x, t(Wq)), addmm(bk, x, t(Wk)), addmm(bv, x, t(Wv))
        ->  y = addmm(cat([bq, bk, bv]), x, t(cat([Wq, Wk, Wv])));  q, k, v = column slices of y

BERT, RoBERTa, DistilBERT, T5 and Llama project one input three times per layer: three products of a
size that fills the GPU poorly at batch 1 (128 x 768 x 768 for BERT-base), which the stream
scheduler runs on three streams joined by four waits. Merged, they are one launch and no waits.

The concatenations are computed from the weights alone, so ir/weight_fold evaluates them once into
watched snapshots (computed again when a weight changes in place): nothing is copied per call, and
the concatenated weights take their size in memory again for the compiled model's life. A merge
whose concatenation the fold did not keep (past Config.fold_weights_max_bytes) is undone
(`unmerge_unfolded`): a copy of the weights per call would cost more than the launches saved.

Merged only where the caller cannot tell: the products are all `mm` or all `addmm` (biases all
there, of the products' dtype), read the same rows (one node, or views of one node to one shape),
their right operands are computed from parameters and buffers alone, no result is a graph output,
and every alias reading a result (views, permutes, expands, directly or through each other) is
valid on the column slice it becomes: its strides are recomputed by the alias itself on a meta
tensor, and a set with one that fails stays as it was. Generated kernels read the slices at their
strides; ATen's ops (attention) take strided operands.

Both entry points' inference graphs (the backend's bound ones: a weight changed in place makes it
bind the graph again unfolded, so unmerged). `Config.merge_sibling_linears` (off by default; it also
merges them in training graphs through the backend, capture/sibling_linear.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch

from streamfuse.ir.fold import drop_unread, drop_unread_constants, fresh_name
from streamfuse.ir.graph import Graph, Node
from streamfuse.ir.lowerings import Builder
from streamfuse.ir.merge import sibling_sets
from streamfuse.ir.ops import OpKind
from streamfuse.ir.pad_mm import VIEW_OPS, from_weights, padded_columns, restrided_aliases

_MM, _ADDMM, _CAST = "aten.mm.default", "aten.addmm.default", "aten._to_copy.default"
_ALIASES = (OpKind.VIEW, OpKind.BROADCAST)


@dataclass
class Merged:
    """One rewrite, kept so that it can be undone (unmerge_unfolded)."""

    products: list[Node]
    traced: list[tuple[str, OpKind, Any, tuple[Any, ...], dict[str, Any], tuple[int, ...]]]
    """Each product's (op, kind, target, args, kwargs, strides) as traced."""
    added: list[Node]
    """The new nodes: the concatenations (and the views they read), the merged product."""
    concats: list[Node]
    aliases: list[tuple[Node, tuple[int, ...]]]
    """The aliases reading the products, with their strides as traced."""


def merge_sibling_products(graph: Graph) -> list[Merged]:
    """Merge every set of sibling products in place (module docstring); returns the rewrites."""
    graph.link_users()  # the aliases reading each product are followed through `users`
    names = {n.name for n in graph.nodes}
    done = [m for products in sibling_sets(graph, _sibling_key) for m in [_merge(graph, products, names)]
            if m is not None]
    if done:
        _topological(graph)
        graph.link_users()
    return done


def unmerge_unfolded(graph: Graph, merged: list[Merged]) -> int:
    """Undo each rewrite whose concatenations the fold did not evaluate into snapshots; drop the
    aliases the kept ones left unread. Notes what stays; returns how many stay."""
    present = set(graph.nodes)
    undone = [m for m in merged if any(c in present for c in m.concats)]
    for m in undone:
        for node, (op, kind, target, args, kwargs, strides) in zip(m.products, m.traced, strict=True):
            node.op, node.kind, node.target, node.args = op, kind, target, args
            node.kwargs, node.strides = kwargs, strides
        for alias, strides in m.aliases:
            alias.strides = strides
        gone = set(m.added)
        graph.nodes = [n for n in graph.nodes if n not in gone]
    graph.link_users()
    if undone:
        drop_unread_constants(graph, list(graph.snapshots))  # a concatenation folded for an undone merge
    kept = [m for m in merged if m not in undone]
    _drop_former_operands(graph, [a for m in kept for _, _, _, args, _, _ in m.traced for a in args])
    if kept:
        graph.notes.append(f"{sum(len(m.products) for m in kept)} sibling products over weights merged into "
                           f"{len(kept)} (their weights concatenated once; each result a column slice; "
                           "Config.merge_sibling_linears)")
    return len(kept)


def _rows(a: Node) -> tuple[Any, ...]:
    """What a product's left operand reads: the node under its views and casts (autocast casts the
    input once per Linear), with those ops; two operands with equal signatures hold equal values."""
    chain: list[Any] = []
    while a.op in (*VIEW_OPS, _CAST) and a.args and isinstance(a.args[0], Node):
        chain.append((a.op, _frozen(a.args[1:]), _frozen(sorted(a.kwargs.items())), a.shape, a.strides))
        a = a.args[0]
    return a, tuple(chain)


def _frozen(value: Any) -> Any:
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


def _sibling_key(graph: Graph, n: Node, outputs: set[Node]) -> tuple[Any, ...] | None:
    if n.op not in (_MM, _ADDMM) or n.kwargs or n in outputs or n.dtype is None or len(n.shape) != 2:
        return None
    *bias, a, b = n.args
    if not isinstance(a, Node) or not isinstance(b, Node) or b.dtype != n.dtype or len(b.shape) != 2:
        return None
    if padded_columns(n.shape[1], n.itemsize) != n.shape[1]:
        return None  # ir/pad_mm's (its rows padded to aligned ones); the merged product's rows stay aligned
    if bias and not (isinstance(bias[0], Node) and bias[0].shape == (n.shape[1],) and bias[0].dtype == n.dtype
                     and from_weights(graph, bias[0])):
        return None
    if not from_weights(graph, b):
        return None
    return (n.op, _rows(a), n.dtype)


def _merge(graph: Graph, products: list[Node], names: set[str]) -> Merged | None:
    first = products[0]
    columns = [p.shape[1] for p in products]
    total = sum(columns)
    strides = (total, 1)
    aliases: list[tuple[Node, tuple[int, ...]]] = []
    start = 0
    for p, width in zip(products, columns, strict=True):
        meta = torch.empty_strided((p.shape[0], total), strides, dtype=p.dtype, device="meta")[:, start:start + width]
        found = restrided_aliases(p, meta, views_only=False)
        if found is None:
            return None
        aliases += found
        start += width
    build = Builder(fresh=lambda name: fresh_name(name, names), nodes=[])
    t = torch.ops.aten.permute.default

    def concat(parts: list[Node], name: str) -> Node:
        shape = (total, *parts[0].shape[1:])
        return build.add(name, torch.ops.aten.cat.default, (parts, 0), shape=shape, dtype=parts[0].dtype)

    # the weights as Linear holds them ([N, K] rows), stacked, and turned back into the [K, N] operand
    rows = [build.add(f"{p.name}_w", t, (p.args[-1], [1, 0]), shape=p.args[-1].shape[::-1],  # type: ignore[union-attr]
                      dtype=p.dtype, strides=p.args[-1].strides[::-1]) for p in products]  # type: ignore[union-attr]
    weight = concat(rows, f"{first.name}_wcat")
    concats = [weight]
    b = build.add(f"{first.name}_wcat_t", t, (weight, [1, 0]), shape=(weight.shape[1], total), dtype=first.dtype,
                  strides=(1, weight.shape[1]))
    a = first.args[-2]
    if first.op == _ADDMM:
        bias = concat([p.args[0] for p in products], f"{first.name}_bcat")  # type: ignore[misc]
        concats.append(bias)
        merged = build.add(f"{first.name}_merged", first.target, (bias, a, b), shape=(first.shape[0], total),
                           dtype=first.dtype)
    else:
        merged = build.add(f"{first.name}_merged", first.target, (a, b), shape=(first.shape[0], total),
                           dtype=first.dtype)
    traced = [(p.op, p.kind, p.target, p.args, dict(p.kwargs), p.strides) for p in products]
    start = 0
    for p, width in zip(products, columns, strict=True):
        p.op, p.kind, p.target = "aten.slice.Tensor", OpKind.VIEW, torch.ops.aten.slice.Tensor
        p.args, p.kwargs, p.strides = (merged, 1, start, start + width), {}, strides
        start += width
    traced_aliases = [(alias, alias.strides) for alias, _ in aliases]
    for alias, new in aliases:
        alias.strides = new
    at = graph.nodes.index(first)
    graph.nodes[at:at] = build.nodes
    return Merged(products, traced, list(build.nodes), concats, traced_aliases)


def _topological(graph: Graph) -> None:
    """Reorder graph.nodes so that every node follows its operands, keeping the order otherwise (the
    concatenations read weights' views that the later products had defined after the first one)."""
    members = set(graph.nodes)
    position = {n: i for i, n in enumerate(graph.nodes)}
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(graph.nodes)))
    dag.add_edges_from((position[a], position[n]) for n in graph.nodes for a in n.input_nodes() if a in members)
    graph.nodes = [graph.nodes[i] for i in nx.lexicographical_topological_sort(dag)]


def _drop_former_operands(graph: Graph, operands: list[Any]) -> None:
    """The merged products' former operands that nothing reads any more (the later products' views
    and casts of their rows, the weights' transposes), and the views and casts those alone read."""
    region: set[Node] = set()
    stack = [n for n in operands if isinstance(n, Node)]
    while stack:
        n = stack.pop()
        if n not in region and (n.kind in _ALIASES or n.op == _CAST):
            region.add(n)
            stack += n.input_nodes()
    drop_unread(graph, region)
