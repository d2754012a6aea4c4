"""A sum with a scatter into zeros becomes the scatter into the other addend.

A weight used twice gets two gradients, which AOTAutograd adds. GPT-2's word embedding is also its
LM head, so the backward computes (sizes for GPT-2 small, float32)

    grad = add(mm(dlogits^T, h), index_put(full(0), [ids], dembed, accumulate=True))

which holds three [50257, 768] buffers (147 MiB each) at once: the product, the zeros the
embedding's gradient is scattered into, and their sum. Accumulating the scatter into the product
gives the same sum with one buffer and without the zero fill and the add:

    add(x, index_put(zeros, indices, values, accumulate=True))  ->  index_put(x, indices, values, accumulate=True)

for a zero fill read by nothing else, a scatter read only by the add, and an add without alpha whose
addends and result have one shape and dtype and whose result has x's strides (index_put's result
keeps its argument 0's). The values summed at one element are the same; only the order of the
floating-point additions differs (x first, not last). The functional index_put still copies x; at
run time runtime/writeback.scatter_into_fresh updates x in place where x is a buffer the call fills
and nothing else reads.

The backend keeps an embedding's gradient as ATen's `embedding_dense_backward` (Config.embedding_backward,
capture/decomp.py), the op eager runs, instead of torch's decomposition into a scatter into zeros:
ATen's accumulating index_put sums repeated indices one after another, and BERT-base's token types
(all index 0, 1024 repeats at 8x128 tokens) made its three embedding gradients take 502 µs of a 20.6 ms
training step in `indexing_backward_kernel` (run 222, H100), where eager's kernel does not show among
its step's 15 costliest (each under 130 µs). A tied weight's sum folds that op too:

    add(x, embedding_dense_backward(g, ids, W, -1, False))  ->  index_put(x, [ids], g, accumulate=True)

for float32 and float64 gradients (the op accumulates 16-bit gradients in float32, which index_put
into a 16-bit x would not), int64 indices and no padding index (whose rows the op leaves at zero).
"""

from __future__ import annotations

import torch

from streamfuse.ir.fold import fresh_name, splice
from streamfuse.ir.graph import Arg, Graph, Node, iter_nodes
from streamfuse.ir.indexing import dense_order, is_contiguous_meta
from streamfuse.ir.lowerings import Builder

_ADD = "aten.add.Tensor"
_INDEX_PUT = "aten.index_put.default"
_EMBEDDING_BACKWARD = "aten.embedding_dense_backward.default"
FILLS = {"aten.full.default": 1, "aten.full_like.default": 1, "aten.new_full.default": 2,
         "aten.zeros.default": None, "aten.zeros_like.default": None, "aten.new_zeros.default": None}
"""Ops whose result is a new buffer of their own filled with one value: the position of the fill
value (None: zeros). runtime/writeback.py runs a scatter in place on such a buffer."""


def fold_scatter_add(graph: Graph) -> int:
    """Rewrite each matching add of a scatter into zeros (module docstring), in place; returns how many."""
    names = {n.name for n in graph.nodes}
    outputs = set(graph.output_nodes)
    build = Builder(fresh=lambda name: fresh_name(name, names), nodes=[])
    done = 0
    for add in [n for n in graph.nodes if n.op == _ADD]:
        match = _match(add, outputs)
        if match is None:
            continue
        x, scatter, zeros = match
        indices, values = _scattered(scatter)
        build.nodes = []
        folded = build.add(f"{scatter.name}_into_{x.name}", torch.ops.aten.index_put.default,
                           (x, indices, values, True), shape=add.shape, dtype=add.dtype, strides=add.strides)
        splice(graph, add, build.nodes, folded, tuple(n for n in (scatter, zeros) if n is not None))
        done += 1
    if done:
        graph.link_users()
        graph.notes.append(f"{done} add(s) of a scatter into zeros folded into the scatter (a weight's two "
                           "gradients summed in one buffer: no zero fill, no add)")
    return done


def _match(add: Node, outputs: set[Node]) -> tuple[Node, Node, Node | None] | None:
    """(x, scatter, zeros) when `add` is add(x, index_put(zeros, ..., accumulate=True)) in either order,
    or (x, embedding gradient, None) for add(x, embedding_dense_backward(...)) as the module docstring
    allows."""
    if len(add.args) != 2 or add.kwargs or add.dtype is None or add.dtype == torch.bool or add.dtype.is_complex:
        return None
    for x, scatter in (add.args, add.args[::-1]):
        if not (isinstance(x, Node) and isinstance(scatter, Node)) or x is scatter:
            continue
        if scatter.users != [add] or scatter in outputs or scatter.kwargs:
            continue
        if not (x.shape == scatter.shape == add.shape and x.dtype == scatter.dtype == add.dtype):
            continue
        if x.strides != add.strides or not _dense(x):  # the folded scatter's result has x's strides
            continue
        if scatter.op == _EMBEDDING_BACKWARD:
            if _foldable_embedding_gradient(scatter, x):
                return x, scatter, None
            continue
        if scatter.op != _INDEX_PUT or len(scatter.args) != 4 or scatter.args[3] is not True:
            continue
        zeros = scatter.args[0]
        if not isinstance(zeros, Node) or not _zero_fill(zeros) or zeros.users != [scatter] or zeros in outputs:
            continue
        if any(a is zeros for a in iter_nodes(scatter.args[1:])):
            continue  # the zeros are also what is scattered (the fold removes them)
        if zeros.shape != scatter.shape:
            continue
        return x, scatter, zeros
    return None


def _foldable_embedding_gradient(grad: Node, x: Node) -> bool:
    """embedding_dense_backward(g, ids, W, -1, False) whose sum into `x` index_put computes as the op
    would: float32/64 (no 16-bit accumulation), int64 indices of g's leading shape, no padding index."""
    if len(grad.args) != 5 or not all(isinstance(a, Node) for a in grad.args[:2]):
        return False
    g, ids, _num_weights, padding_idx, by_freq = grad.args
    assert isinstance(g, Node) and isinstance(ids, Node)
    return (padding_idx == -1 and by_freq is False and g.dtype == x.dtype
            and g.dtype in (torch.float32, torch.float64) and ids.dtype == torch.int64
            and bool(ids.shape) and ids.shape == g.shape[:-1] and x is not g and x is not ids)


def _scattered(scatter: Node) -> tuple[Arg, Arg]:
    """(indices list, values) that index_put scatters, of an index_put or an embedding gradient."""
    if scatter.op == _EMBEDDING_BACKWARD:
        return [scatter.args[1]], scatter.args[0]
    return scatter.args[1], scatter.args[2]


def _zero_fill(node: Node) -> bool:
    if node.op not in FILLS:
        return False
    at = FILLS[node.op]
    if at is None:
        return True
    value = node.args[at] if len(node.args) > at else node.kwargs.get("fill_value")
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def _dense(node: Node) -> bool:
    """Every element at its own address without gaps (row-major or a dense permutation): a clone that
    preserves the layout (index_put's copy of argument 0) keeps these strides."""
    return len(node.strides) == len(node.shape) and (
        is_contiguous_meta(node) or dense_order(node.shape, node.strides) is not None)
