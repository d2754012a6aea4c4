"""Evaluate once, at compile time, what does not depend on the model's inputs or state.

Traced models compute some tensors from nothing but shapes and literals on every call: a shifted-
window attention mask built with `zeros` and slice assignments of Python numbers (swin_t: 90
`slice_scatter`, 45 `lift_fresh_copy` and 45 `copy` launches per call at batch 1), the index of a
`torch.roll` (`arange`, `add`, `fmod`), position ids. Each is a kernel launch of its own, or part of
one, on every call, for a result that never changes.

A node folds when every operand is such a value: a number the trace lifted into a 0-d tensor, or
another folded node, including ops with no tensor operand at all (`arange`, `full`). Parameters and
buffers do not seed it (nor larger constants the trace made: export lifts a function's closure-
captured parameters that way): streamfuse.compile reads them live, and a user may change them in
place between calls, so what is computed from them stays in the plan. Nor does anything an
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
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from streamfuse.ir.fold import constant_node, drop_unread_constants, fresh_name, replace_uses
from streamfuse.ir.graph import Graph, Node, map_args
from streamfuse.ir.lowerings import Builder
from streamfuse.ir.ops import OpKind

_ALIASES = frozenset({OpKind.VIEW, OpKind.BROADCAST})
_CHEAP = frozenset({OpKind.POINTWISE, OpKind.VIEW, OpKind.BROADCAST})


def fold_constants(graph: Graph, max_bytes: int) -> int:
    """Fold in place (module docstring); returns how many ops were evaluated and removed."""
    written = {id(dst) for _, dst in graph.writebacks}
    values: dict[Node, object] = {n: t for n, t in graph.constants.items() if _literal(graph, n, t, written)}
    returned = returned_nodes(graph)
    folded: list[Node] = []
    cheap: set[Node] = set()  # generated in-kernel from nothing (a `full`, pointwise ops on it): not stored
    for n in graph.nodes:
        if n.kind is OpKind.INPUT or n in values or n in returned or not evaluable(n):
            continue
        if not all(a in values for a in n.input_nodes()):
            continue
        if n.dtype is not None and n.numel * n.itemsize > max_bytes:
            continue
        try:
            # real values even where the compiler runs under AOTAutograd's FakeTensorMode: an `arange`
            # evaluated there would be fake, and a fake constant cannot run
            with torch.no_grad(), unset_fake_temporarily():
                value = n.target(*map_args(n.args, values.__getitem__),
                                 **{k: map_args(v, values.__getitem__) for k, v in n.kwargs.items()})
        except Exception:  # noqa: BLE001 - an op that cannot run here runs in the plan, as before
            continue
        if isinstance(value, FakeTensor) or (n.dtype is not None and not matches_meta(value, n)):
            continue
        values[n] = value
        if n.kind in _CHEAP and all(a in cheap for a in n.input_nodes()):
            cheap.add(n)  # a kernel computes it for free where it is read; as a constant it would be loaded
        else:
            folded.append(n)
    if not folded:
        return 0
    inside = set(folded)
    kept = _read_from_outside(graph, inside)
    names = {n.name for n in graph.nodes}
    for n in folded:
        if n not in kept:
            continue
        assert isinstance(values[n], torch.Tensor)
        const = constant_node(graph, fresh_name(f"{n.name}_const", names), values[n])  # type: ignore[arg-type]
        replace_uses(graph, n, const)
        graph.nodes.insert(graph.nodes.index(n), const)
    # the folded ops are gone; views that the rest of the graph reads stay, reading the new constants
    views = {n for n in folded if n.kind in _ALIASES and n not in kept and _read_by_rest(n, inside, graph)}
    dropped = set(folded) - views
    graph.nodes = [n for n in graph.nodes if n not in dropped]
    graph.link_users()
    gone: set[Node] = set()  # cheap nodes only folded ops read (readers first: reverse order)
    for n in reversed(graph.nodes):
        if n in cheap and all(u in dropped or u in gone for u in n.users):
            gone.add(n)
    if gone:
        graph.nodes = [n for n in graph.nodes if n not in gone]
        graph.link_users()
    _drop_unread_snapshots(graph)
    removed = len([n for n in folded if n in dropped and n.kind not in _ALIASES])
    if removed:
        graph.notes.append(f"{removed} op(s) that depend on no input, parameter or buffer evaluated once at compile "
                           f"time ({len(kept)} result(s) kept as constants)")
    rolls = rolls_as_slices(graph)
    if rolls:
        graph.notes.append(f"{rolls} index_select(s) with a constant cyclic index (torch.roll) read as a cat of two "
                           "slices, which fuses with the kernels around it")
    return removed


def rolls_as_slices(graph: Graph) -> int:
    """index_select(x, dim, c) where the constant c is (arange(n) + a) % n over x's n positions (what
    torch.roll traces to, once the index is folded) -> cat([x[a:], x[:a]], dim): two views and a
    cat, generated and fused with their neighbours, instead of a gather kernel of ATen's (a = 0: a
    clone)."""
    names = {n.name for n in graph.nodes}
    build = Builder(fresh=lambda name: fresh_name(name, names), nodes=[])
    rewritten = 0
    for n in list(graph.nodes):
        if n.op != "aten.index_select.default" or len(n.args) != 3 or n.kwargs:
            continue
        x, dim, index = n.args
        if not (isinstance(x, Node) and isinstance(index, Node) and isinstance(dim, int) and index in graph.constants):
            continue
        dim = dim + len(x.shape) if dim < 0 else dim
        size = x.shape[dim] if 0 <= dim < len(x.shape) else -1
        shift = _cyclic_shift(graph.constants[index], size)
        if shift is None or n.shape != x.shape:
            continue
        build.nodes = []
        if shift == 0:  # the identity: a copy, fused
            build.add(f"{n.name}_same", torch.ops.aten.clone.default, (x,), shape=n.shape, dtype=n.dtype,
                      strides=n.strides)
            replace_uses(graph, n, build.nodes[-1])
            at = graph.nodes.index(n)
            graph.nodes[at:at + 1] = build.nodes
            rewritten += 1
            continue
        tail = build.add(f"{n.name}_tail", torch.ops.aten.slice.Tensor, (x, dim, shift, size),
                         shape=x.shape[:dim] + (size - shift,) + x.shape[dim + 1:], dtype=x.dtype,
                         strides=x.strides)
        head = build.add(f"{n.name}_head", torch.ops.aten.slice.Tensor, (x, dim, 0, shift),
                         shape=x.shape[:dim] + (shift,) + x.shape[dim + 1:], dtype=x.dtype, strides=x.strides)
        cat = build.add(f"{n.name}_roll", torch.ops.aten.cat.default, ([tail, head], dim), shape=n.shape,
                        dtype=n.dtype, strides=n.strides)
        replace_uses(graph, n, cat)
        at = graph.nodes.index(n)
        graph.nodes[at:at + 1] = build.nodes
        rewritten += 1
    if rewritten:
        graph.link_users()
        _drop_unread_snapshots(graph)
    return rewritten


def _drop_unread_snapshots(graph: Graph) -> None:
    """The literals and folded constants nothing reads any more leave the graph (users linked)."""
    drop_unread_constants(graph, [n for n in graph.constants if n in graph.snapshots and not n.users])


def _cyclic_shift(index: torch.Tensor, size: int) -> int | None:
    """a, where `index` is (arange(size) + a) % size with 0 <= a < size; None otherwise."""
    if size < 1 or index.dim() != 1 or index.numel() != size or index.dtype not in (torch.int64, torch.int32):
        return None
    idx = index.detach().cpu().long()
    a = int(idx[0])
    if not 0 <= a < size:
        return None
    return a if torch.equal(idx, (torch.arange(size) + a) % size) else None


def _literal(graph: Graph, n: Node, t: torch.Tensor, written: set[int]) -> bool:
    """A number the trace lifted into a 0-d tensor (`img[a:b] = count`). Larger constants the trace
    made may be a function's closure-captured parameters and buffers (export lifts them as
    constants too), which stay live like the module's own."""
    return (n in graph.snapshots and id(n) not in written and t.dim() == 0
            and not isinstance(t, (torch.nn.Parameter, FakeTensor)))


def returned_nodes(graph: Graph) -> set[Node]:
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


def evaluable(n: Node) -> bool:
    """A deterministic, non-mutating ATen op (or a getitem of one's results)."""
    if n.target is operator.getitem:
        return True
    if not isinstance(n.target, torch._ops.OpOverload):
        return False
    if n.target._schema.is_mutable or torch.Tag.nondeterministic_seeded in n.target.tags:
        return False
    return True


def matches_meta(value: object, n: Node) -> bool:
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
