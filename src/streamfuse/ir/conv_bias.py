"""A convolution's bias added in the epilogue kernel after it, not by ATen (as Inductor does).

cuDNN's convolutions take no bias: ATen runs the convolution, then adds the bias in a kernel of its
own (aten/src/ATen/native/cudnn/ConvShared.cpp, "cuDNN convolutions does not handle bias"). A
convolution with a bias followed by an activation was three launches (convolution, bias add,
the generated activation kernel); with the bias moved out of the convolution it is two, and the
add costs nothing in the epilogue that reads the convolution's result anyway (measured on the H200
for the folded batch-norm's bias, which ir/fold.py has always put there: conv+bias+ReLU 15.1 µs
against 12.9 with the add fused). SqueezeNet's 26 convolutions, and the squeeze-and-excitation
convolutions of MobileNet v3, EfficientNet and RegNet-Y, all carry a bias.

    conv(x, W, b)  ->  conv(x, W, None) + b.view(1, C, 1, ...)

The same arithmetic in the same order (one float add of the bias to each output element, in the
convolution's dtype). Rewritten only where every reader of the convolution is a pointwise op or a
reduction (or a view read only by those), so the add has a kernel to join, and the convolution is
not a graph output.
"""

from __future__ import annotations

from streamfuse.ir.fold import bias_added_after, replace_uses
from streamfuse.ir.graph import Graph, Node
from streamfuse.ir.ops import OpKind

_CONV = "aten.convolution.default"


def bias_to_epilogue(graph: Graph) -> int:
    """Move each eligible convolution's bias into an add after it, in place; returns how many."""
    names = {n.name for n in graph.nodes}
    outputs = set(graph.output_nodes)
    moved = 0
    nodes: list[Node] = []
    for node in graph.nodes:
        nodes.append(node)
        if not _eligible(node, outputs):
            continue
        bias = node.args[2]
        assert isinstance(bias, Node)
        added = bias_added_after(node, bias, names)
        replace_uses(graph, node, added[-1])
        node.args = (*node.args[:2], None, *node.args[3:])
        nodes += added
        graph.notes.append(f"bias of %{node.name} added in the kernel after it, not by ATen after cuDNN")
        moved += 1
    if moved:
        graph.nodes = nodes
        graph.link_users()
    return moved


def _eligible(node: Node, outputs: set[Node]) -> bool:
    if node.op != _CONV or len(node.args) != 9 or node.kwargs or len(node.shape) < 3 or node in outputs:
        return False
    bias = node.args[2]
    if not isinstance(bias, Node) or bias.shape != (node.shape[1],) or bias.dtype != node.dtype:
        return False
    if node.dtype is None or not node.dtype.is_floating_point:
        return False
    return bool(node.users) and all(_joins(u, views=1) for u in node.users)


_EPILOGUE = (OpKind.POINTWISE, OpKind.REDUCTION)


def _joins(user: Node, views: int) -> bool:
    """A reader the add can join: a pointwise op or a reduction's prologue, or a view (ConvNeXt's
    permute before its LayerNorm) all of whose readers are such."""
    if user.kind in _EPILOGUE:
        return True
    return user.kind is OpKind.VIEW and views > 0 and bool(user.users) and all(
        _joins(u, views - 1) for u in user.users)
