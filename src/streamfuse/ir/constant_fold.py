"""Evaluate once, at compile time, what does not depend on the model's inputs or state.

Traced models compute some tensors from nothing but shapes and literals on every call: a shifted-
window attention mask built with `zeros` and slice assignments of Python numbers (swin_t: 90
`slice_scatter`, 45 `lift_fresh_copy` and 45 `copy` launches per call at batch 1), the index of a
`torch.roll` (`arange`, `add`, `fmod`), position ids. Each is a kernel launch of its own, or part of
one, on every call, for a result that never changes.

A node folds when every operand is such a value: a constant the trace made (a lifted literal, a
`get_attr` tensor: Graph.snapshots), a snapshot streamfuse computed (folded batch-norm weights), or
another folded node, including ops with no tensor operand at all (`arange`, `full`). Parameters and
buffers of the module do not seed it: streamfuse.compile reads them live, and a user may change
them in place between calls, so what is computed from them stays in the plan. Nor does anything an
in-place update of the graph writes (a buffer the graph itself updates), a random op, or an op that
mutates. A result larger than Config.fold_constants_max_bytes is left to run (a materialized
broadcast would cost memory for good).

The folded results that the rest of the graph reads become constant nodes (snapshots the compiled
graph owns); views of them stay views; everything else folded is dropped. Values are computed by
the ops themselves (ATen, under no_grad), so they are exactly what eager computes.
"""

from __future__ import annotations

import operator

import torch

from streamfuse.ir.fold import constant_node, drop_unread_constants, replace_uses
from streamfuse.ir.graph import Graph, Node, map_args
from streamfuse.ir.ops import OpKind

_ALIASES = frozenset({OpKind.VIEW, OpKind.BROADCAST})


def fold_constants(graph: Graph, max_bytes: int) -> int:
    """Fold in place (module docstring); returns how many ops were evaluated and removed."""
    written = {id(dst) for _, dst in graph.writebacks}
    values: dict[Node, object] = {n: t for n, t in graph.constants.items()
                                  if n in graph.snapshots and id(n) not in written}
    returned = _returned(graph)
    folded: list[Node] = []
    for n in graph.nodes:
        if n.kind is OpKind.INPUT or n in values or n in returned or not _evaluable(n):
            continue
        if not all(a in values for a in n.input_nodes()):
            continue
        if n.dtype is not None and n.numel * n.itemsize > max_bytes:
            continue
        try:
            with torch.no_grad():
                value = n.target(*map_args(n.args, values.__getitem__),
                                 **{k: map_args(v, values.__getitem__) for k, v in n.kwargs.items()})
        except Exception:  # noqa: BLE001 - an op that cannot run here runs in the plan, as before
            continue
        if n.dtype is not None and not _matches(value, n):
            continue
        values[n] = value
        folded.append(n)
    if not folded:
        return 0
    inside = set(folded)
    kept = _read_from_outside(graph, inside)
    names = {n.name for n in graph.nodes}
    replaced: list[Node | None] = []
    for n in folded:
        if n not in kept:
            continue
        assert isinstance(values[n], torch.Tensor)
        const = constant_node(graph, _fresh(f"{n.name}_const", names), values[n])  # type: ignore[arg-type]
        replace_uses(graph, n, const)
        graph.nodes.insert(graph.nodes.index(n), const)
        inside.add(n)
    # the folded ops are gone; views that the rest of the graph reads stay, reading the new constants
    views = {n for n in folded if n.kind in _ALIASES and n not in kept and _read_by_rest(n, inside, graph)}
    dropped = [n for n in folded if n not in views]
    graph.nodes = [n for n in graph.nodes if n not in set(dropped)]
    graph.link_users()
    replaced += [n for n in graph.constants if not n.users and n in graph.snapshots]
    drop_unread_constants(graph, replaced)
    present = set(graph.nodes)
    for n in [n for n in graph.constants if n not in present]:
        del graph.constants[n]
        graph.snapshots.discard(n)
    removed = len([n for n in dropped if n.kind not in _ALIASES])
    if removed:
        graph.notes.append(f"{removed} op(s) that depend on no input, parameter or buffer evaluated once at compile "
                           f"time ({len(kept)} result(s) kept as constants)")
    return removed


def _returned(graph: Graph) -> set[Node]:
    """The outputs and what they view: a caller may change a returned tensor in place, so it must be
    computed afresh on every call, as eager does, never handed out from a constant."""
    out: set[Node] = set()
    stack = list(graph.output_nodes)
    while stack:
        n = stack.pop()
        if n not in out:
            out.add(n)
            if n.kind in _ALIASES:
                stack += n.input_nodes()
    return out


def _evaluable(n: Node) -> bool:
    """A deterministic, non-mutating ATen op (or a getitem of one's results)."""
    if n.target is operator.getitem:
        return True
    if not isinstance(n.target, torch._ops.OpOverload):
        return False
    if n.target._schema.is_mutable or torch.Tag.nondeterministic_seeded in n.target.tags:
        return False
    return True


def _matches(value: object, n: Node) -> bool:
    """The evaluated value has the node's recorded meta (shape, dtype, strides where they matter)."""
    if not isinstance(value, torch.Tensor):
        return False
    if tuple(value.shape) != n.shape or value.dtype != n.dtype:
        return False
    live = [d for d, s in enumerate(n.shape) if s != 1]
    return not n.strides or [value.stride(d) for d in live] == [n.strides[d] for d in live]


def _read_from_outside(graph: Graph, folded: set[Node]) -> set[Node]:
    """The folded non-view nodes whose values the rest of the graph needs: read by an unfolded node or
    returned, directly or through folded views (which stay views of them)."""
    needed: set[Node] = set()
    stack = [a for n in graph.nodes if n not in folded for a in n.input_nodes() if a in folded]
    stack += [o for o in graph.output_nodes if o in folded]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        if n.kind in _ALIASES:
            stack += [a for a in n.input_nodes() if a in folded]
            needed.add(n)
            continue
        needed.add(n)
    return {n for n in needed if n.kind not in _ALIASES}


def _read_by_rest(view: Node, folded: set[Node], graph: Graph) -> bool:
    """A folded view that an unfolded node (or the output) still reads, directly or through views."""
    outputs = graph.output_nodes
    stack, seen = [view], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in outputs or any(u not in folded for u in n.users):
            return True
        stack += [u for u in n.users if u.kind in _ALIASES]
    return False


def _fresh(name: str, names: set[str]) -> str:
    out, k = name, 1
    while out in names:
        out, k = f"{name}_{k}", k + 1
    names.add(out)
    return out
