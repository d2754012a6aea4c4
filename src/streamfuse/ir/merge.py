"""Merge sibling convolutions (TensorRT's horizontal layer merge).

Convolutions that read the same input with the same geometry (filter size, stride, padding,
dilation, one group, not transposed) compute independent output channels of one convolution
whose filters are theirs stacked along dim 0:

    conv(x, W1), conv(x, W2), conv(x, W3)  ==  channel slices of conv(x, cat([W1, W2, W3]))

An inception block's three 1x1 convolutions over the block input become one cuDNN launch instead
of three (GoogLeNet: 9 blocks, 57 convolutions at batch 1, each 5-9 µs on the H200, issue 15), and
the slices are views: the epilogues that follow read them where they lie.

It merges only convolutions whose weights (and biases) are compile-time snapshots (ir/fold.py:
after batch-norm folding, which is where inception networks' convolutions stand), so merging
copies nothing a caller could still change in place; a convolution that is a graph output stays
alone (the caller gets the layout eager gives). The merged filters are computed once, at compile
time, and shared between the graphs of one model (ir/fold.SnapshotCache).

Off by default (`Config.merge_sibling_convolutions`): the gain is not yet measured on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from streamfuse.ir.fold import SnapshotCache, constant_node, drop_unread_constants, fresh_name
from streamfuse.ir.graph import Graph, Node
from streamfuse.ir.indexing import channels_last_strides, contiguous_strides
from streamfuse.ir.ops import OpKind

_CONV = "aten.convolution.default"
_CONV_ARITY = 9


def stacked(cache: SnapshotCache, sources: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """`sources` concatenated along dim 0 (in the first one's memory format), once per set of sources."""
    def make() -> torch.Tensor:
        first = sources[0]
        with torch.no_grad():
            merged = torch.cat([t.detach() for t in sources], 0)
            if first.dim() == 4 and first.is_contiguous(memory_format=torch.channels_last) and not first.is_contiguous():
                merged = merged.contiguous(memory_format=torch.channels_last)
        return merged

    return cache.get(sources, "stacked along dim 0", make)


def merge_sibling_convolutions(graph: Graph, cache: SnapshotCache | None = None) -> int:
    """Merge every set of sibling convolutions in place; returns how many convolutions were removed.
    `cache` shares the stacked filters between graphs of the same model (ir/fold.SnapshotCache)."""
    cache = cache if cache is not None else SnapshotCache()
    removed = 0
    for convs in sibling_sets(graph, _sibling_key):
        _merge(graph, convs, cache)
        removed += len(convs) - 1
    return removed


def sibling_sets(graph: Graph, key: Callable[[Graph, Node, set[Node]], Any]) -> list[list[Node]]:
    """The sets of two or more nodes with one `key(graph, node, graph's outputs)` (None: alone), in
    graph order."""
    outputs = set(graph.output_nodes)
    sets: dict[Any, list[Node]] = {}
    for n in graph.nodes:
        k = key(graph, n, outputs)
        if k is not None:
            sets.setdefault(k, []).append(n)
    return [nodes for nodes in sets.values() if len(nodes) > 1]


def _sibling_key(graph: Graph, n: Node, outputs: set[Node]) -> tuple[Any, ...] | None:
    """What a convolution must share with another to merge (None: it cannot merge)."""
    if n.op != _CONV or len(n.args) != _CONV_ARITY or n.kwargs or n in outputs or n.dtype is None:
        return None
    x, w, b, stride, padding, dilation, transposed, output_padding, groups = n.args
    if not isinstance(x, Node) or not isinstance(w, Node) or w not in graph.snapshots:
        return None
    if b is not None and (not isinstance(b, Node) or b not in graph.snapshots):
        return None
    if transposed or groups != 1 or len(n.shape) != 4:
        return None
    layout = _layout(n)
    if layout is None:
        return None
    return (x, tuple(w.shape[1:]), w.dtype, b is None, tuple(stride), tuple(padding), tuple(dilation),
            tuple(output_padding), layout, n.dtype)


def _layout(n: Node) -> str | None:
    """"nchw" or "nhwc" for a convolution result stored densely in one of them, else None."""
    size_n, c, h, w = n.shape
    if n.strides == (c * h * w, h * w, w, 1):
        return "nchw"
    if n.strides == (h * w * c, 1, w * c, c):
        return "nhwc"
    return None


def _merge(graph: Graph, convs: list[Node], cache: SnapshotCache) -> None:
    """One convolution over the stacked filters before the first sibling; each sibling becomes a
    channel slice of it (the node itself is rewritten, so its readers need no change)."""
    names = {n.name for n in graph.nodes}
    first = convs[0]
    x, w, b = first.args[0], first.args[1], first.args[2]
    assert isinstance(w, Node)
    weight = stacked(cache, tuple(graph.constants[c.args[1]] for c in convs))  # type: ignore[index]
    w_node = constant_node(graph, fresh_name(f"{w.name}_merged", names), weight)
    new_nodes = [w_node]
    b_node = None
    if b is not None:
        bias = stacked(cache, tuple(graph.constants[c.args[2]] for c in convs))  # type: ignore[index]
        b_node = constant_node(graph, fresh_name(f"{first.name}_bias_merged", names), bias)
        new_nodes.append(b_node)
    channels = sum(c.shape[1] for c in convs)
    shape = (first.shape[0], channels, first.shape[2], first.shape[3])
    layout = _layout(first)
    assert layout is not None
    merged = Node(fresh_name(f"{first.name}_merged", names), first.op, first.kind, first.target,
                  args=(x, w_node, b_node, *first.args[3:]), shape=shape, dtype=first.dtype,
                  strides=contiguous_strides(shape) if layout == "nchw" else channels_last_strides(shape))
    new_nodes.append(merged)
    old_weights: list[Node | None] = []
    start = 0
    for c in convs:
        old_weights += [c.args[1], c.args[2]]  # type: ignore[list-item]
        end = start + c.shape[1]
        c.op, c.kind, c.target = "aten.slice.Tensor", OpKind.VIEW, torch.ops.aten.slice.Tensor
        c.args, c.kwargs, c.strides = (merged, 1, start, end), {}, merged.strides
        start = end
    at = graph.nodes.index(first)
    moved = set(convs)
    graph.nodes = graph.nodes[:at] + new_nodes + convs + [n for n in graph.nodes[at:] if n not in moved]
    graph.link_users()
    drop_unread_constants(graph, old_weights)
    graph.notes.append(f"{len(convs)} convolutions reading %{getattr(x, 'name', x)} merged into %{merged.name} "
                       f"({channels} output channels; each result a channel slice of it)")
