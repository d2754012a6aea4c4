"""A Linear layer's bias added by the product itself: `mm` + bias add -> `addmm`.

torch.export traces a Linear over a 3-D or 4-D activation as a view to 2-D, `mm`, a view back and an
`add` of the bias (convnext_tiny's 36 Linear layers at batch 1); AOTAutograd, behind
torch.compile(backend="streamfuse"), gets `addmm` from at::linear for the same layers. cuBLAS adds
the bias of an `addmm` in its GEMM epilogue (cuBLASLt's bias epilogue), so the bias add costs
nothing there, and the kernel after the product no longer reads the bias. On the H200 the two
entry points ran convnext_tiny at 646.0 (streamfuse.compile, mm) and 587.5 µs (the backend, addmm)
with the same number of launches (run 83), the plans differing in this alone.

    add(view(mm(a, b), shape), bias)  ->  view(addmm(bias, a, b), shape)

where the bias is a 1-D [N] tensor over the product's last dim (or a view of one with leading
ones), every dtype is the same, the add has no alpha, and nothing else reads the `mm` or its view.
addmm computes the same sum (the product's value plus the bias, in the product's dtype).

The other way (`split_addmm`, Config.addmm_bias): an addmm whose every reader is a pointwise op
becomes `mm` and an add of the bias, which the readers' kernel computes as it reads the product:

    addmm(bias, a, b)  ->  add(mm(a, b), bias)

cuBLAS then chooses its kernel for a plain product; which of the two is faster depends on the shape
(tune/addmm_split.py times them).
"""

from __future__ import annotations

import torch

from streamfuse.ir.fold import fresh_name, replace_uses, splice
from streamfuse.ir.graph import Graph, Node
from streamfuse.ir.lowerings import Builder
from streamfuse.ir.ops import OpKind

_MM = "aten.mm.default"
_ADD = "aten.add.Tensor"
_VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")


def bias_into_addmm(graph: Graph) -> int:
    """Rewrite each matching `mm` + bias add into `addmm` (module docstring), in place; returns how many."""
    names = {n.name for n in graph.nodes}
    outputs = set(graph.output_nodes)
    build = Builder(fresh=lambda name: fresh_name(name, names), nodes=[])
    done = 0
    for add in [n for n in graph.nodes if n.op == _ADD]:
        match = _match(add, outputs)
        if match is None:
            continue
        mm, view, bias = match
        build.nodes = []
        if bias.shape != (mm.shape[1],):  # [1, ..., N] -> [N]
            bias = build.add(f"{bias.name}_n", torch.ops.aten.view.default, (bias, [mm.shape[1]]),
                             shape=(mm.shape[1],), dtype=bias.dtype)
        fused = build.add(f"{mm.name}_bias", torch.ops.aten.addmm.default, (bias, *mm.args), shape=mm.shape,
                          dtype=mm.dtype, strides=mm.strides)
        back = build.add(f"{add.name}_view", torch.ops.aten.view.default, (fused, list(add.shape)),
                         shape=add.shape, dtype=add.dtype, strides=add.strides)
        splice(graph, add, build.nodes, back, (mm, view))
        done += 1
    if done:
        graph.link_users()
        graph.notes.append(f"{done} Linear bias add(s) folded into addmm (cuBLAS adds the bias in its GEMM epilogue)")
    return done


def _match(add: Node, outputs: set[Node]) -> tuple[Node, Node, Node] | None:
    """(mm, view, bias) when `add` adds a bias over the last dim to a view of an mm read by nothing else."""
    if len(add.args) != 2 or add.kwargs or add.dtype is None or not add.dtype.is_floating_point:
        return None
    for view, bias in (add.args, add.args[::-1]):
        if not (isinstance(view, Node) and isinstance(bias, Node) and view.op in _VIEWS):
            continue
        mm = view.args[0]
        if not (isinstance(mm, Node) and mm.op == _MM and len(mm.args) == 2 and not mm.kwargs):
            continue
        if mm.users != [view] or view.users != [add] or mm in outputs or view in outputs:
            continue
        n = mm.shape[1] if len(mm.shape) == 2 else -1
        if add.shape != view.shape or not add.shape or add.shape[-1] != n:
            continue
        if not bias.shape or bias.shape[-1] != n or any(s != 1 for s in bias.shape[:-1]):
            continue
        if len(bias.shape) > len(add.shape) or not (mm.dtype == bias.dtype == add.dtype):
            continue
        return mm, view, bias
    return None


_ADDMM = "aten.addmm.default"
_VIEW_KINDS = (OpKind.VIEW, OpKind.BROADCAST)


def split_candidates(graph: Graph) -> list[Node]:
    """The addmm nodes `split_addmm` may rewrite: a 1-D [N] bias, no alpha or beta, 2-D floating
    operands of one dtype, and every reader (through views) a pointwise op; nothing of it a graph
    output (a product the caller or a backward reads is stored as it is)."""
    outputs = set(graph.output_nodes)

    def pointwise_readers(node: Node) -> bool:
        if node in outputs or not node.users:
            return False
        return all(pointwise_readers(u) if u.kind in _VIEW_KINDS else u.kind is OpKind.POINTWISE for u in node.users)

    out = []
    for n in graph.nodes:
        if n.op != _ADDMM or n.kwargs or len(n.args) != 3 or n.dtype is None or not n.dtype.is_floating_point:
            continue
        bias, a, b = n.args
        if not all(isinstance(x, Node) and x.dtype == n.dtype for x in (bias, a, b)):
            continue
        if len(n.shape) != 2 or bias.shape != (n.shape[1],) or len(a.shape) != 2 or len(b.shape) != 2:
            continue
        if pointwise_readers(n):
            out.append(n)
    return out


def split_addmm(graph: Graph, nodes: list[Node]) -> int:
    """Rewrite each of `nodes` (split_candidates) into mm + bias add, in place; returns how many."""
    names = {n.name for n in graph.nodes}
    build = Builder(fresh=lambda name: fresh_name(name, names), nodes=[])
    for node in nodes:
        bias, a, b = node.args
        build.nodes = []
        mm = build.add(f"{node.name}_mm", torch.ops.aten.mm.default, (a, b), shape=node.shape, dtype=node.dtype,
                       strides=node.strides)
        add = build.add(f"{node.name}_bias", torch.ops.aten.add.Tensor, (mm, bias), shape=node.shape,
                        dtype=node.dtype, strides=node.strides)
        replace_uses(graph, node, add)
        at = graph.nodes.index(node)
        graph.nodes[at:at + 1] = build.nodes
    if nodes:
        graph.link_users()
        graph.notes.append(f"{len(nodes)} addmm bias(es) added by the pointwise kernel after the product "
                           "(Config.addmm_bias)")
    return len(nodes)
