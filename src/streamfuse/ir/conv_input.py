"""A convolution's input that is neither NCHW- nor channels_last-dense, copied by a generated kernel.

cuDNN takes dense inputs only: ATen copies any other input (ShuffleNet v2's convolutions read one
half of `x.chunk(2, dim=1)`, a channel slice of a dense tensor) in a copy kernel of its own before
the convolution, 17 launches and 66.6 µs of shufflenet_v2 at batch 32 on the H200 (run 120). The
same copy as an explicit `clone` is a generated kernel: it costs what ATen's does, and the
convolution, now reading a dense NCHW tensor, qualifies for the network's channels_last layout
(tune/network_layout.py), under which that kernel stores its result channels_last for cuDNN's
NHWC kernels, as Inductor's `clone_convolution_split_transpose` kernels do for the same model.

    conv(view_of_x, W, ...)  ->  conv(clone(view_of_x), W, ...)

Only the convolution's first operand; weights are constants read as they are.
"""

from __future__ import annotations

import torch

from streamfuse.ir.fold import fresh_name
from streamfuse.ir.graph import Graph, Node
from streamfuse.ir.indexing import channels_last_strides, contiguous_strides
from streamfuse.ir.lowerings import Builder

_CONV = "aten.convolution.default"


def copy_strided_conv_inputs(graph: Graph) -> int:
    """Put a clone before each 2-D convolution whose input is not dense; returns how many."""
    names = {n.name for n in graph.nodes}
    nodes: list[Node] = []
    copied = 0
    for node in graph.nodes:
        if _eligible(node):
            x = node.args[0]
            assert isinstance(x, Node)
            build = Builder(fresh=lambda name: fresh_name(name, names), nodes=nodes)
            clone = build.add(f"{x.name}_dense", torch.ops.aten.clone.default, (x,), shape=x.shape, dtype=x.dtype)
            node.args = (clone, *node.args[1:])
            graph.notes.append(f"input of %{node.name} copied dense by a generated kernel, not by ATen before cuDNN")
            copied += 1
        nodes.append(node)
    if copied:
        graph.nodes = nodes
        graph.link_users()
    return copied


def _eligible(node: Node) -> bool:
    if node.op != _CONV or len(node.args) != 9 or node.kwargs or node.args[6] or len(node.shape) != 4:
        return False
    x = node.args[0]
    if not isinstance(x, Node) or len(x.shape) != 4 or x.dtype is None or not x.dtype.is_floating_point:
        return False
    return not (_dense(x, contiguous_strides(x.shape)) or _dense(x, channels_last_strides(x.shape)))


def _dense(x: Node, strides: tuple[int, ...]) -> bool:
    """`x` has these strides wherever they matter (the stride of a dim of size 1 is free)."""
    return all(s == d for size, s, d in zip(x.shape, x.strides, strides, strict=True) if size > 1)
