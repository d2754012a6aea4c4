"""A convolution over a 1x1 image with a 1x1 filter as the product it is (Config.pointwise_conv_mm).

A squeeze-and-excitation block (EfficientNet, MobileNet v3, RegNet-Y) pools its input to one value per
channel and runs two 1x1 convolutions over that [N, C, 1, 1] tensor: two fully connected layers.

    conv(x[N, C, 1, 1], W[S, C, 1, 1], b)  ->  view(addmm(b, view(x, [N, C]), view(W, [S, C]).t()), [N, S, 1, 1])

(`mm` without a bias). The same sums: out[n, s] = b[s] + sum_c x[n, c] * W[s, c]. Every view only
drops or adds dimensions of size one, so it is valid whatever the strides. The product then runs
as every other product does: cuBLAS with the bias in its epilogue, or split so the bias joins the
activation kernel after it (Config.addmm_bias), or a Triton template with that kernel fused in
(the matmul choices), where cuDNN ran an implicit-GEMM convolution for a GEMV.

Rewritten where the convolution is not transposed, has one group and no padding, its input, filter
and result are 1x1 in every spatial dimension, every operand has the result's floating dtype, and
the result is not a graph output (a tensor the caller or a backward reads keeps its producer).
"""

from __future__ import annotations

import torch

from streamfuse.ir.fold import fresh_name, splice
from streamfuse.ir.graph import Graph, Node
from streamfuse.ir.lowerings import Builder

_CONV = "aten.convolution.default"


def convolutions_as_products(graph: Graph, max_rows: int | None = None) -> int:
    """Rewrite each eligible convolution (module docstring) over at most `max_rows` images (None: any
    number) into a product, in place; returns how many."""
    names = {n.name for n in graph.nodes}
    outputs = set(graph.output_nodes)
    build = Builder(fresh=lambda name: fresh_name(name, names), nodes=[])
    done = 0
    for conv in [n for n in graph.nodes if _eligible(n, outputs)
                 and (max_rows is None or n.shape[0] <= max_rows)]:
        x, w, bias = conv.args[:3]
        assert isinstance(x, Node) and isinstance(w, Node)
        n, c, s = x.shape[0], x.shape[1], w.shape[0]
        build.nodes = []
        rows = build.add(f"{conv.name}_rows", torch.ops.aten.view.default, (x, [n, c]), shape=(n, c),
                         dtype=x.dtype, strides=(x.strides[0], x.strides[1]))
        flat = build.add(f"{w.name}_2d", torch.ops.aten.view.default, (w, [s, c]), shape=(s, c), dtype=w.dtype,
                         strides=(w.strides[0], w.strides[1]))
        cols = build.add(f"{w.name}_t", torch.ops.aten.t.default, (flat,), shape=(c, s), dtype=w.dtype,
                         strides=(w.strides[1], w.strides[0]))
        if isinstance(bias, Node):
            product = build.add(f"{conv.name}_mm", torch.ops.aten.addmm.default, (bias, rows, cols), shape=(n, s),
                                dtype=conv.dtype)
        else:
            product = build.add(f"{conv.name}_mm", torch.ops.aten.mm.default, (rows, cols), shape=(n, s),
                                dtype=conv.dtype)
        back = build.add(f"{conv.name}_4d", torch.ops.aten.view.default, (product, list(conv.shape)),
                         shape=conv.shape, dtype=conv.dtype)
        splice(graph, conv, build.nodes, back)
        done += 1
    if done:
        graph.link_users()
        graph.notes.append(f"{done} convolution(s) over a 1x1 image with a 1x1 filter run as products "
                           "(Config.pointwise_conv_mm)")
    return done


def _eligible(node: Node, outputs: set[Node]) -> bool:
    if node.op != _CONV or len(node.args) != 9 or node.kwargs or node in outputs or len(node.shape) < 3:
        return False
    x, w, bias, _stride, padding, _dilation, transposed, _output_padding, groups = node.args
    if not (isinstance(x, Node) and isinstance(w, Node)) or transposed or groups != 1:
        return False
    if bias is not None and not (isinstance(bias, Node) and bias.shape == (w.shape[0],)):
        return False
    dtype = node.dtype
    if dtype is None or not dtype.is_floating_point or any(
            t.dtype != dtype for t in (x, w, bias) if isinstance(t, Node)):
        return False
    spatial = len(node.shape) - 2
    if len(x.shape) != len(node.shape) or len(w.shape) != len(node.shape) or not isinstance(padding, (list, tuple)):
        return False
    return all(d == 1 for d in (*x.shape[2:], *w.shape[2:], *node.shape[2:])) and all(p == 0 for p in padding) \
        and len(padding) == spatial and node.shape[:2] == (x.shape[0], w.shape[0]) and w.shape[1] == x.shape[1]
