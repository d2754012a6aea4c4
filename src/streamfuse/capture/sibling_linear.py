"""Sibling Linears merged in training graphs (Config.merge_sibling_linears).

A transformer's attention projections read one input through separate Linears (BERT, RoBERTa,
DistilBERT, T5, Llama: query, key and value):

    q, k, v = linear(x, Wq, bq), linear(x, Wk, bk), linear(x, Wv, bv)

In a training step each costs three GEMMs (forward, input gradient, weight gradient), nine in all,
of a size that fills a GPU poorly (BERT-base at 8x128: 1024 x 768 x 768, 192 tiles of 64 x 64 on
132 SMs). Here the graph Dynamo hands the backend is rewritten before AOTAutograd traces it:

    y = linear(x, cat([Wq, Wk, Wv]), cat([bq, bk, bv]));  q, k, v = split(y, [Nq, Nk, Nv], -1)

AOTAutograd differentiates the rewrite like any graph: the backward's input gradient is one GEMM
over the concatenated output gradient (K = Nq + Nk + Nv) and the weight gradient one GEMM whose row
blocks are the three weights' gradients. The price is a copy of the three weights (and biases) per
step and, in the backward, the output gradients gathered into one buffer.

Merged only where it cannot change what the caller sees: the Linears read the same input node, their
weights (and biases, all or none) are graph inputs of one dtype, device, `in_features` and
`requires_grad`, no Linear's result is a graph output (it would come back a strided slice where eager
gives a dense tensor), and every `view` of a result is valid on the slice it becomes (checked on meta
tensors). Graphs that train nothing are left alone: an inference graph keeps its weights bound, and
a concatenated copy of them would be a second copy of those weights for the graph's life.

Off by default (Config.merge_sibling_linears has the measurements): the copies of the weights cost
memory and, against tensor-core GEMMs, much of the time the merged GEMMs save.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from streamfuse.capture.train_layout import example_value, trains

_LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)
_Parts = tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node | None]
"""A Linear's input, weight and bias nodes."""


def _weight_key(w: Any, b: Any) -> tuple[Any, ...] | None:
    """What a Linear's weight (and bias) must share with a sibling's; None: not mergeable."""
    wv, bv = example_value(w), example_value(b)
    if not isinstance(wv, torch.Tensor) or w.op != "placeholder" or wv.dim() != 2:
        return None
    if b is not None and (not isinstance(bv, torch.Tensor) or b.op != "placeholder" or bv.dim() != 1
                          or bv.dtype != wv.dtype or bv.requires_grad != wv.requires_grad):
        return None
    if not all(isinstance(s, int) for s in wv.shape):
        return None
    return (wv.dtype, wv.device, wv.shape[1], wv.requires_grad, b is None)


def _linear_parts(n: torch.fx.Node) -> _Parts | None:
    if n.op != "call_function" or n.target not in _LINEARS:
        return None
    names = ("input", "weight", "bias")
    args = list(n.args) + [None] * (3 - len(n.args))
    for k, v in n.kwargs.items():
        if k not in names:
            return None
        args[names.index(k)] = v
    x, w, b = args[:3]
    if not isinstance(x, torch.fx.Node) or not isinstance(w, torch.fx.Node) or not (b is None or isinstance(b, torch.fx.Node)):
        return None
    return x, w, b


def _slice_ok(n: torch.fx.Node, start: int, total: int) -> bool:
    """The Linear's result, as columns [start, start + N) of a dense result with `total` columns,
    serves every reader: none is the graph output, and each `view` of it is valid on the slice."""
    value = example_value(n)
    if not isinstance(value, torch.Tensor) or value.dim() < 1 or not all(isinstance(s, int) for s in value.shape):
        return False
    shape = list(value.shape)
    dense = torch.empty([*shape[:-1], total], dtype=value.dtype, device="meta")
    part = dense[..., start:start + shape[-1]]
    for user in n.users:
        if user.op == "output":
            return False
        is_view = (user.op == "call_method" and user.target == "view") or user.target is torch.Tensor.view
        if not is_view:
            continue
        if user.kwargs or user.args[0] is not n:
            return False
        sizes = user.args[1:]
        if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
            sizes = tuple(sizes[0])
        if not all(isinstance(s, int) for s in sizes):
            return False
        try:
            part.view(*sizes)
        except RuntimeError:
            return False
    return True


def merge_sibling_linears(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> int:
    """Rewrite `gm` in place as the module doc says; returns the Linears merged away (0: untouched)."""
    if not trains(example_inputs):
        return 0
    groups: dict[tuple[Any, ...], dict[torch.fx.Node, _Parts]] = {}
    for n in gm.graph.nodes:
        parts = _linear_parts(n)
        if parts is None:
            continue
        key = _weight_key(parts[1], parts[2])
        if key is not None:
            groups.setdefault((parts[0], *key), {})[n] = parts
    removed = 0
    for group in groups.values():
        linears = _usable(list(group))
        if len(linears) > 1:
            _merge(gm.graph, {n: group[n] for n in linears})
            removed += len(linears) - 1
    if removed:
        gm.graph.lint()
        gm.recompile()
    return removed


def _usable(linears: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The siblings whose results may become slices (all of them or none: a partial merge would
    change which columns each lands in, so the check is repeated on what is left)."""
    while len(linears) > 1:
        widths = [example_value(n).shape[-1] for n in linears]
        total, start, keep = sum(widths), 0, []
        for n, width in zip(linears, widths, strict=True):
            if _slice_ok(n, start, total):
                keep.append(n)
            start += width
        if len(keep) == len(linears):
            return linears
        linears = keep
    return linears


def _merge(graph: torch.fx.Graph, linears: dict[torch.fx.Node, _Parts]) -> None:
    """One Linear over the concatenated weights where the first sibling stood; each sibling's readers
    read its columns of the result."""
    first = next(iter(linears))
    parts = list(linears.values())
    x = parts[0][0]
    widths = [example_value(n).shape[-1] for n in linears]
    with graph.inserting_before(first):
        weight = graph.call_function(torch.cat, ([p[1] for p in parts], 0))
        bias = None if parts[0][2] is None else graph.call_function(torch.cat, ([p[2] for p in parts], 0))
        for cat in (weight, bias):
            if cat is not None:  # the backward concatenates again rather than keep a copy of the weights
                cat.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        merged = graph.call_function(torch._C._nn.linear, (x, weight, bias))
        split = graph.call_function(torch.split, (merged, widths, -1))
        pieces = [graph.call_function(operator.getitem, (split, i)) for i in range(len(linears))]
    for n, piece in zip(linears, pieces, strict=True):
        piece.meta.update({k: v for k, v in n.meta.items() if k in ("stack_trace", "nn_module_stack", "source_fn_stack")})
        n.replace_all_uses_with(piece)
        graph.erase_node(n)
