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

An embedding's gradient that stays a scatter into zeros (its weight used once: BERT's word, position
and token-type embeddings) is given back to ATen's own op, `embedding_backward_kernels`:

    index_put(zeros[W, D], [ids], values, accumulate=True)  ->  embedding_dense_backward(values, ids, W, -1, False)

torch's decomposition table turns embedding_dense_backward into that scatter, and ATen's
index_put with accumulate runs duplicates of one index one after another (sorted, then a serial
sum per run): BERT-base's token types, all 0, make 1024 duplicates at 8x128 tokens, and its three
embedding gradients took 502 µs of a 20.6 ms training step (run 222, H100) in
`indexing_backward_kernel`. Eager's embedding_dense_backward does not show in its step's 15
costliest kernels (each under 130 µs): its kernel sums duplicates in parallel across features. The
sums are the same; the order of the additions is eager's.
"""

from __future__ import annotations

import torch

from streamfuse.ir.fold import fresh_name, splice
from streamfuse.ir.graph import Graph, Node, iter_nodes
from streamfuse.ir.indexing import dense_order, is_contiguous_meta
from streamfuse.ir.lowerings import Builder

_ADD = "aten.add.Tensor"
_INDEX_PUT = "aten.index_put.default"
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
        build.nodes = []
        folded = build.add(f"{scatter.name}_into_{x.name}", torch.ops.aten.index_put.default,
                           (x, scatter.args[1], scatter.args[2], True), shape=add.shape, dtype=add.dtype,
                           strides=add.strides)
        splice(graph, add, build.nodes, folded, (scatter, zeros))
        done += 1
    if done:
        graph.link_users()
        graph.notes.append(f"{done} add(s) of a scatter into zeros folded into the scatter (a weight's two "
                           "gradients summed in one buffer: no zero fill, no add)")
    return done


def _match(add: Node, outputs: set[Node]) -> tuple[Node, Node, Node] | None:
    """(x, scatter, zeros) when `add` is add(x, index_put(zeros, ..., accumulate=True)) in either order."""
    if len(add.args) != 2 or add.kwargs or add.dtype is None or add.dtype == torch.bool or add.dtype.is_complex:
        return None
    for x, scatter in (add.args, add.args[::-1]):
        if not (isinstance(x, Node) and isinstance(scatter, Node)) or x is scatter:
            continue
        if scatter.op != _INDEX_PUT or scatter.users != [add] or scatter in outputs or scatter.kwargs:
            continue
        if len(scatter.args) != 4 or scatter.args[3] is not True:
            continue
        zeros = scatter.args[0]
        if not isinstance(zeros, Node) or not _zero_fill(zeros) or zeros.users != [scatter] or zeros in outputs:
            continue
        if any(a is zeros for a in iter_nodes(scatter.args[1:])):
            continue  # the zeros are also what is scattered (the fold removes them)
        if not (x.shape == scatter.shape == zeros.shape == add.shape and x.dtype == scatter.dtype == add.dtype):
            continue
        if x.strides != add.strides or not _dense(x):  # the folded scatter's result has x's strides
            continue
        return x, scatter, zeros
    return None


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


_EMBEDDING_BACKWARD = torch.ops.aten.embedding_dense_backward.default


def embedding_backward_kernels(graph: Graph) -> int:
    """Rewrite each scatter into zeros that is an embedding's gradient (module docstring) as ATen's
    embedding_dense_backward, in place; returns how many. Matched: index_put(zeros, [ids], values,
    True) with a contiguous [W, D] zero fill that nothing else reads, one integer index tensor of
    values' leading shape, and values [..., D] in the fill's floating dtype."""
    names = {n.name for n in graph.nodes}
    outputs = set(graph.output_nodes)
    build = Builder(fresh=lambda name: fresh_name(name, names), nodes=[])
    done = 0
    for scatter in [n for n in graph.nodes if n.op == _INDEX_PUT]:
        match = _embedding_gradient(scatter, outputs)
        if match is None:
            continue
        zeros, ids, values = match
        build.nodes = []
        grad = build.add(f"{scatter.name}_embedding", _EMBEDDING_BACKWARD, (values, ids, zeros.shape[0], -1, False),
                         shape=scatter.shape, dtype=scatter.dtype, strides=scatter.strides)
        splice(graph, scatter, build.nodes, grad, (zeros,))
        done += 1
    if done:
        graph.link_users()
        graph.notes.append(f"{done} scatter(s) into zeros run as ATen's embedding_dense_backward "
                           "(Config.embedding_backward)")
    return done


def _embedding_gradient(scatter: Node, outputs: set[Node]) -> tuple[Node, Node, Node] | None:
    """(zeros, ids, values) when `scatter` is an embedding's gradient scattered into zeros."""
    if scatter.kwargs or len(scatter.args) != 4 or scatter.args[3] is not True:
        return None
    zeros, indices, values = scatter.args[:3]
    if not (isinstance(zeros, Node) and isinstance(values, Node) and isinstance(indices, (list, tuple))):
        return None
    if len(indices) != 1 or not isinstance(indices[0], Node):
        return None
    ids = indices[0]
    if not _zero_fill(zeros) or zeros.users != [scatter] or zeros in outputs or len(zeros.shape) != 2:
        return None
    if ids is zeros or values is zeros:  # the fill is also what is scattered (the rewrite drops it)
        return None
    if not is_contiguous_meta(zeros) or zeros.strides != scatter.strides or zeros.shape != scatter.shape:
        return None
    if ids.dtype not in (torch.int64, torch.int32) or not ids.shape or ids.shape != values.shape[:-1]:
        return None
    if values.dtype != zeros.dtype or zeros.dtype is None or not zeros.dtype.is_floating_point:
        return None
    if values.shape[-1] != zeros.shape[1] or zeros.shape[0] == 0:
        return None
    return zeros, ids, values
