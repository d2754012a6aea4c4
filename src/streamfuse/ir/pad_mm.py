"""A product of a weight whose result rows are not a whole number of 16 bytes, computed on the weight
padded to whole rows (Config.product_row_alignment).

cuBLAS's fast GEMM kernels need the result's contiguous extent to be a multiple of 16 bytes: GPT-2's
LM head (768 -> 50257 words, bf16: 100,514-byte rows) ran in a kernel for unaligned data, 837 us at
8 x 128 tokens on an H100, where reduce-overhead pads the weight and takes 124 us (run 216). Writing
the result into a buffer with padded rows alone did not help (826 us: the extent, not the leading
dimension, decides: run 217). So the product runs over the weight padded with zero columns:

    mm(a, b)            ->  slice(mm(a, pad(b, [0, P])), 1, 0, N)
    addmm(c, a, b)      ->  slice(addmm(pad(c, [0, P]), a, pad(b, [0, P])), 1, 0, N)

where b [K, N] (a Linear's `t(weight)`, cast under autocast) and c are computed from parameters
alone, so ir/weight_fold
evaluates the pads once into a watched snapshot (computed again when the weight changes in place):
P zero columns cost the product P / N more work and nothing per call. The result is the [M, N]
slice, with row stride N + P; the views after it take their strides from it (a view that cannot
express them stops the rewrite), and generated kernels are passed the strides of what they read.
A graph output among them is returned as a contiguous copy (eager's strides; a generated kernel).

Only where the weight lives on a CUDA device; a rewrite whose pads ir/weight_fold did not fold is
undone (unpad_unfolded). Whatever the number of rows: the rule must not depend on the batch, or the
graphs captured at two batch sizes would differ and the batch could not be padded to a bucket
(runtime/buckets.py). Run 218 (H100, K 768, N 50257) found the padded product faster at every size
from 8 to 1024 rows (3.5-6.4x bf16, 1.2-2.1x fp32 with TF32), and at one row 1.14x in bf16 and 0.98x
(1.2 us slower) in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamfuse.ir.constant_fold import evaluable
from streamfuse.ir.fold import drop_unread_constants, fresh_name, replace_uses
from streamfuse.ir.graph import Graph, Node, map_args
from streamfuse.ir.lowerings import Builder
from streamfuse.ir.ops import OpKind

ALIGN_BYTES = 16
_MM, _ADDMM, _PAD = "aten.mm.default", "aten.addmm.default", "aten.constant_pad_nd.default"
VIEW_OPS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEVICES = ("cuda",)
"""Device types whose weights are padded (the CPU's products gain nothing; tests add "cpu")."""


def padded_columns(columns: int, itemsize: int) -> int:
    """`columns` rounded up to a whole number of ALIGN_BYTES."""
    per = max(1, ALIGN_BYTES // itemsize)
    return -(-columns // per) * per


@dataclass
class Padded:
    """One rewrite, kept so that it can be undone (unpad_unfolded)."""

    original: Node
    pads: list[Node]
    product: Node
    result: Node
    views: list[tuple[Node, tuple[int, ...]]]
    """The views reading the result, with their strides as traced."""
    copies: list[tuple[Node, Node]]
    """(a graph output among the result and its views, the contiguous copy the graph returns instead)."""
    constants: dict[Node, tuple[torch.Tensor, bool]]
    """The product's constant operands (a Linear's bias): value, and whether a snapshot. A fold that
    took a pad of one drops it once nothing else reads it; an undo puts it back."""


def pad_product_columns(graph: Graph) -> list[Padded]:
    """Rewrite each eligible mm / addmm (module docstring) in place; returns the rewrites."""
    names = {n.name for n in graph.nodes}
    build = Builder(fresh=lambda name: fresh_name(name, names), nodes=[])
    done: list[Padded] = []
    for node in [n for n in graph.nodes if n.op in (_MM, _ADDMM)]:
        plan = _eligible(graph, node)
        if plan is None:
            continue
        columns, padded, reviews = plan
        pad = padded - columns
        build.nodes = []
        *rest, b = node.args
        b_pad = build.add(f"{node.name}_wpad", torch.ops.aten.constant_pad_nd.default, (b, [0, pad], 0.0),
                          shape=(b.shape[0], padded), dtype=b.dtype)  # type: ignore[union-attr]
        if node.op == _ADDMM:
            bias, a = rest
            c_pad = build.add(f"{node.name}_bpad", torch.ops.aten.constant_pad_nd.default, (bias, [0, pad], 0.0),
                              shape=(padded,), dtype=bias.dtype)  # type: ignore[union-attr]
            product = build.add(f"{node.name}_padded", node.target, (c_pad, a, b_pad), dict(node.kwargs),
                                shape=(node.shape[0], padded), dtype=node.dtype)
        else:
            product = build.add(f"{node.name}_padded", node.target, (rest[0], b_pad), dict(node.kwargs),
                                shape=(node.shape[0], padded), dtype=node.dtype)
        result = build.add(f"{node.name}_cols", torch.ops.aten.slice.Tensor, (product, 1, 0, columns),
                           shape=node.shape, dtype=node.dtype, strides=(padded, 1))
        replace_uses(graph, node, result)
        at = graph.nodes.index(node)
        graph.nodes[at:at + 1] = build.nodes
        pads = [n for n in build.nodes if n.op == _PAD]
        constants = {a: (graph.constants[a], a in graph.snapshots) for a in node.input_nodes() if a in graph.constants}
        traced = [(view, view.strides) for view, _ in reviews]
        for view, strides in reviews:
            view.strides = strides
        copies = _contiguous_outputs(graph, [result, *(v for v, _ in reviews)], build)
        done.append(Padded(node, pads, product, result, traced, copies, constants))
    if done:
        graph.link_users()
    return done


def _contiguous_outputs(graph: Graph, candidates: list[Node], build: Builder) -> list[tuple[Node, Node]]:
    """A contiguous copy (a generated kernel) for each of `candidates` that the graph returns, which
    it returns instead: a caller gets eager's strides, not the padded rows (torch.compile treats
    padded strides reaching a user as a bug: pytorch#152520). Readers inside the graph keep the slice."""
    returned = set(graph.output_nodes)
    copies: list[tuple[Node, Node]] = []
    for node in candidates:
        if node not in returned:
            continue
        build.nodes = []
        copy = build.add(f"{node.name}_contiguous", torch.ops.aten.clone.default, (node,), shape=node.shape,
                         dtype=node.dtype)  # contiguous (Builder's default strides)
        graph.nodes.insert(graph.nodes.index(node) + 1, copy)
        graph.outputs = [map_args(o, lambda n, node=node, copy=copy: copy if n is node else n)  # type: ignore[misc]
                         for o in graph.outputs]
        copies.append((node, copy))
    return copies


def unpad_unfolded(graph: Graph, padded: list[Padded]) -> int:
    """Undo each rewrite whose pads were not folded into snapshots (ir/weight_fold: past its memory
    budget, or a weight it cannot follow): a pad per call would cost more than the alignment saves
    (340 us for GPT-2's LM head in bf16, run 218). Notes what stays; returns how many stay."""
    undone = [p for p in padded if any(n in graph.nodes for n in p.pads)]
    for p in undone:
        replace_uses(graph, p.result, p.original)
        at = graph.nodes.index(p.product)
        gone = {id(n) for n in (*p.pads, p.product, p.result)}
        present = set(graph.nodes)
        dropped = [a for a in p.constants if a not in present]
        for a in dropped:
            value, snapshot = p.constants[a]
            graph.constants[a] = value
            if snapshot:
                graph.snapshots.add(a)
        graph.nodes[at:at] = [*dropped, p.original]
        graph.nodes = [n for n in graph.nodes if id(n) not in gone]
        for view, strides in p.views:
            view.strides = strides
        for node, copy in p.copies:  # the graph returns what it returned before: the result is the original again
            back = p.original if node is p.result else node
            graph.outputs = [map_args(o, lambda n, back=back, copy=copy: back if n is copy else n)  # type: ignore[misc]
                             for o in graph.outputs]
            graph.nodes.remove(copy)
    if undone:
        graph.link_users()
        drop_unread_constants(graph, list(graph.snapshots))  # a pad folded for an undone product
    kept = len(padded) - len(undone)
    if kept:
        graph.notes.append(f"{kept} product(s) with unaligned result rows computed over their weight padded to "
                           f"{ALIGN_BYTES}-byte rows, the pads evaluated once (Config.product_row_alignment)")
    return kept


def _eligible(graph: Graph, node: Node) -> tuple[int, int, list[tuple[Node, tuple[int, ...]]]] | None:
    """(columns, padded columns, the new strides of the views that read the result) or None."""
    if len(node.shape) != 2 or node.dtype not in _DTYPES:
        return None
    columns = node.shape[1]
    padded = padded_columns(columns, node.itemsize)
    if padded == columns:
        return None
    operands = node.args[1:] if node.op == _ADDMM else node.args
    if len(operands) != 2 or not all(isinstance(t, Node) and t.dtype == node.dtype for t in operands):
        return None
    a, b = operands
    if node.op == _ADDMM:
        bias = node.args[0]
        if not (isinstance(bias, Node) and bias.shape == (columns,) and from_weights(graph, bias)):
            return None
    if not from_weights(graph, b) or b.shape != (a.shape[1], columns):  # type: ignore[union-attr]
        return None
    reviews = restrided_aliases(node, torch.empty_strided(node.shape, (padded, 1), dtype=node.dtype, device="meta"))
    return None if reviews is None else (columns, padded, reviews)


def from_weights(graph: Graph, node: Node) -> bool:
    """`node` is computed from parameters and buffers on a DEVICES device alone, by deterministic ops: a
    Linear's `t(weight)`, or under autocast `t(_to_copy(weight))`, which ir/weight_fold folds together
    with the pad into one snapshot."""
    seen: dict[Node, bool] = {}

    def from_weights(n: Node) -> bool:
        if n not in seen:
            value = graph.constants.get(n)
            if value is not None:
                seen[n] = isinstance(value, torch.Tensor) and value.device.type in DEVICES
            else:
                operands = n.input_nodes()
                seen[n] = n.kind is not OpKind.INPUT and evaluable(n) and bool(operands) and all(
                    from_weights(a) for a in operands)
        return seen[n]

    return from_weights(node)


def restrided_aliases(node: Node, value: torch.Tensor,
                      views_only: bool = True) -> list[tuple[Node, tuple[int, ...]]] | None:
    """The strides each alias reading `node` (directly or through other such aliases) gets when `node`
    is `value` (a meta tensor of its new layout), by the alias ops themselves; None where one cannot
    take them. A view or reshape must stay a view (no copy); `views_only`: any other alias (a
    transpose, an expand) gives None too, else it is evaluated as well."""
    found: list[tuple[Node, tuple[int, ...]]] = []
    stack = [(node, value)]
    while stack:
        at, current = stack.pop()
        for user in at.users:
            if user.kind not in (OpKind.VIEW, OpKind.BROADCAST) or (views_only and user.kind is not OpKind.VIEW):
                continue
            if user.args[0] is not at or any(isinstance(x, Node) for x in (*user.args[1:], *user.kwargs.values())):
                return None
            try:
                if user.op in VIEW_OPS:
                    out = current.view(user.args[1])  # type: ignore[arg-type]
                elif views_only or not isinstance(user.target, torch._ops.OpOverload):
                    return None  # another alias: left as traced
                else:
                    out = user.target(current, *user.args[1:], **user.kwargs)
            except RuntimeError:
                return None
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != user.shape:
                return None
            found.append((user, tuple(out.stride())))
            stack.append((user, out))
    return found
