"""In-place updates of a graph's inputs (Graph.writebacks): an optimizer's parameters and states,
running statistics, a static KV cache.

AOTAutograd hands inference graphs their input mutations as `copy_(input, new value)`; the IR keeps
them as writebacks, and the plan applies them at the end of each call, after every kernel that
reads the old value, in one multi-tensor copy. Where a generated pointwise kernel computes the new
value, it can store it straight into the input instead (store_in_place), and the copy for it goes.
So can an ATen scatter whose functional form copies the input and updates the copy (index_put,
index_copy: a static KV cache's update, `cache[:, :, pos] = k`): it runs as its in-place overload on
the input itself, which saves the copy of the whole input inside the op and the copy back.
"""

from __future__ import annotations

import networkx as nx
import torch

from streamfuse.fusion.groups import GroupKind, Plan
from streamfuse.ir.graph import Graph, Node, iter_nodes
from streamfuse.ir.indexing import is_contiguous_meta
from streamfuse.ir.ops import OpKind
from streamfuse.ir.scatter_add import FILLS
from streamfuse.runtime.steps import KernelStep, NodeStep, Step
from streamfuse.schedule.plan import launch_predecessors


def store_in_place(plan: Plan, steps: list[Step], graph: Graph, slot: dict[Node, int]) -> set[int]:
    """Writebacks (Graph.writebacks) whose new value a generated pointwise kernel can store straight
    into the input it replaces, instead of a buffer copied over the input at the end of the call (an
    optimizer step: the parameters and states are written once instead of twice). Returns the
    indices into graph.writebacks handled so; their steps' `out_into` says where to store.

    Safe only when nothing can read the old value after the kernel writes the new one:
    - the kernel (one part of a horizontal kernel) computes the value elementwise over the input's
      shape and reads the input only directly, at the element it writes, with the same strides:
      each element is loaded before it is stored, by the same program;
    - every other kernel reading the input, or a view of it, is an ancestor of this one, so every
      schedule (streams included) runs it first;
    - the value is not also a result the caller sees.
    An ATen index_put or index_copy of the input itself (not a view), whose other arguments do not
    read it, runs as its in-place overload under the same reader rule."""
    owner = {n: i for i, g in enumerate(plan.groups) for n in g.nodes}
    index = {g.id: i for i, g in enumerate(plan.groups)}
    preds = launch_predecessors(plan.groups, plan.group_of())  # the stream scheduler's dependencies
    dag = nx.DiGraph([(index[p], index[g.id]) for g in plan.groups for p in preds[g.id]])
    dag.add_nodes_from(range(len(plan.groups)))
    visible = set(map(id, graph.outputs[: graph.user_outputs]))
    done: set[int] = set()

    def read_before(gi: int, dst: Node) -> bool:
        """Every launch but `gi` reading `dst` or a view of it runs before `gi` in any schedule."""
        readers = {owner[u] for v in _views_of(dst) for u in v.users if u in owner and owner[u] != gi
                   and plan.groups[owner[u]].kind is not GroupKind.ALIAS}
        return readers <= nx.ancestors(dag, gi)

    for k, (out, dst) in enumerate(graph.writebacks):
        src = graph.outputs[out]
        if not isinstance(src, Node) or id(src) in visible or src not in owner or src.kind is OpKind.INPUT:
            continue
        gi = owner[src]
        step, group = steps[gi], plan.groups[gi]
        if isinstance(step, NodeStep) and _scatter_fits(step, src, dst) and read_before(gi, dst):
            step.calls[0].target = _IN_PLACE[src.op]  # returns `dst` itself, updated
            done.add(k)
            continue
        if not isinstance(step, KernelStep) or src not in step.source.outputs:
            continue
        part = group if group.kind is GroupKind.POINTWISE else next(
            (p for p in group.parts if src in p.nodes), None) if group.kind is GroupKind.HORIZONTAL else None
        if part is None or src.shape != dst.shape or src.dtype != dst.dtype or src.strides != dst.strides \
                or not is_contiguous_meta(dst) or tuple(part.shape) != tuple(src.shape):
            continue
        views = _views_of(dst)
        # inside the kernel, only direct reads of the input at the element being written: a view
        # (a transpose of a square parameter keeps the shape) reads other programs' elements
        if any(owner.get(u) == gi for v in views if v is not dst for u in (v, *v.users)):
            continue
        if any(u not in part.nodes or u.shape != dst.shape for u in dst.users if owner.get(u) == gi):
            continue
        if not read_before(gi, dst):
            continue
        step.out_into[step.source.outputs.index(src)] = slot[dst]
        done.add(k)
    return done


def scatter_into_fresh(plan: Plan, steps: list[Step], graph: Graph, stream_of: dict[int, int]) -> int:
    """ATen scatters (index_put, index_copy) whose argument 0 is a buffer this call fills and
    nothing else reads, not a graph output: their in-place overload updates that buffer, where the
    functional form allocates a second one and copies the first into it. Returns how many.
    - The buffer: a `full` (the embedding backward's decomposition is full + index_put with
      accumulate; GPT-2's word-embedding gradient, 147 MiB, twice in the backward's pool before), or
      the result of a generated kernel or of a product (ir/scatter_add.py folds the LM head's
      gradient and the embedding's scatter into one), possibly through views that nothing else reads.
    - The scatter's other arguments cannot read the buffer: it has no other reader, no other view.
    - Only where the buffer is made on the scatter's stream (`stream_of`: step index -> stream): the
      result lives in the buffer's memory, which the caching allocator ties to the stream it was
      allocated on, and the stream plan's releases assume the scatter's. Empty where the call runs on
      one stream (the reference executor, CPU tensors, training graphs): every step is on it."""
    outputs = set(map(id, graph.outputs))
    owner = {n: i for i, g in enumerate(plan.groups) for n in g.nodes}
    done = 0
    for i, step in enumerate(steps):
        if not isinstance(step, NodeStep):
            continue
        for c in step.calls:
            src = c.node
            if src.op not in _IN_PLACE or not src.args or not isinstance(src.args[0], Node):
                continue
            dst = src.args[0]
            if dst.users != [src] or id(dst) in outputs:
                continue
            base = _fresh_base(dst, plan, steps, owner, outputs)
            if base is None or stream_of.get(owner[base], 0) != stream_of.get(i, 0):
                continue
            if src.shape != dst.shape or src.dtype != dst.dtype or src.strides != dst.strides:
                continue
            if any(a is dst for a in iter_nodes((src.args[1:], tuple(src.kwargs.values())))):
                continue  # the buffer is also the scatter's source (one user, read twice)
            c.target = _IN_PLACE[src.op]  # returns the buffer itself, updated
            done += 1
    if done:
        graph.notes.append(f"{done} scatter(s) (index_put, index_copy) into a buffer filled in the same call run "
                           "in place: no second buffer, no copy")
    return done


_FRESH = frozenset(FILLS) | {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
                             "aten.clone.default", "aten._to_copy.default"}
"""ATen ops whose result is always a new buffer of their own (a fill, a product, a copy): nothing
else can see it."""


def _fresh_base(dst: Node, plan: Plan, steps: list[Step], owner: dict[Node, int], outputs: set[int]) -> Node | None:
    """The node whose buffer `dst` is, when that buffer is filled by this call and read by nothing but
    the chain of views leading to `dst` (each read once, none a graph output); else None."""
    node = dst
    while True:
        if node not in owner:
            return None  # a graph input or a constant
        group = plan.groups[owner[node]]
        if group.kind is GroupKind.ALIAS:
            if node.kind is not OpKind.VIEW or not node.args or not isinstance(node.args[0], Node):
                return None  # a getitem, or an expand (its elements overlap)
            parent = node.args[0]
            if parent.users != [node] or id(parent) in outputs:
                return None
            node = parent
            continue
        step = steps[owner[node]]
        if isinstance(step, KernelStep) and step.failed is None:
            # a generated kernel allocates its results, unless it stores one into an input (out_into);
            # not a view among them: should the kernel fail to compile at its first launch, its ops
            # run through ATen, where a view is its argument's memory
            fresh = not step.out_into and node.kind not in (OpKind.VIEW, OpKind.BROADCAST, OpKind.GETITEM)
        else:  # an ATen op (or a group's ops run one by one: the reference executor, a failed kernel)
            fresh = node.op in _FRESH
        return node if fresh else None


_IN_PLACE = {"aten.index_put.default": torch.ops.aten.index_put_.default,
             "aten.index_copy.default": torch.ops.aten.index_copy_.default}
"""Functional scatters (a copy of argument 0, updated) and their in-place overloads."""


def _scatter_fits(step: NodeStep, src: Node, dst: Node) -> bool:
    """`step` is an ATen scatter computing `dst`'s new value from `dst` itself, which its in-place
    overload can do on `dst`; False for another op, argument 0 not `dst` itself, a layout or dtype
    that differs, or another argument that reads `dst`'s memory (the update would overlap its own
    source)."""
    if len(step.calls) != 1 or step.calls[0].node is not src or src.op not in _IN_PLACE:
        return False
    if not src.args or src.args[0] is not dst or src.shape != dst.shape or src.dtype != dst.dtype \
            or src.strides != dst.strides:
        return False
    views = set(_views_of(dst))
    return not any(a in views for a in iter_nodes((src.args[1:], tuple(src.kwargs.values()))))


def _views_of(node: Node) -> list[Node]:
    """`node` and every view or alias taken of it, transitively."""
    found, stack = [node], [node]
    while stack:
        for u in stack.pop().users:
            if u.kind in (OpKind.VIEW, OpKind.BROADCAST) or u.op == "aten.alias.default":
                if u not in found:
                    found.append(u)
                    stack.append(u)
    return found
