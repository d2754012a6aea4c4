"""Evaluate once what a model computes from its parameters and buffers alone, and keep it as a
watched snapshot (ir/fold.SnapshotCache), computed again in place when a source changes in place.

Models compute tensors from their weights on every call that do not depend on the call's inputs:
- a weight cast under autocast (every Linear's fp32 weight and bias to bfloat16: all the weights read
  and written again at half the size per call, ~510 MB of traffic for bert-base's 85 M weights);
- weight normalisation and spectral normalisation in eval (`torch.nn.utils.parametrizations`: a norm
  and a divide per layer, HiFi-GAN-style vocoders have dozens);
- position tables built from a buffer and literal indices (Llama's rotary cos/sin from `inv_freq`,
  GPT-2's and BERT's position embeddings gathered at `arange` positions, T5's relative position
  bias, BERT's token-type embedding of its zero buffer).

ir/constant_fold.py folds what depends on literals only and leaves parameters live. This pass folds
a region whose sources include live parameters or buffers, and registers each result it keeps in
the compile's SnapshotCache with a function that computes the region again from the sources: the
compiled model's SnapshotWatch (streamfuse.compile) compares the sources' version counters on every
call and recomputes in place (an optimizer step, `load_state_dict`, `p.add_()`); the backend binds
its graph again unfolded at the first such change (capture/backend.py). Values are computed by the
ops themselves (ATen, under no_grad), so they are exactly what eager computes.

What is not folded: anything the graph writes (a buffer updated in place, a KV cache), a random or
mutating op, an output or a view of one (a caller may change a returned tensor in place), a region of
views alone (the runtime takes those once already: executable._hoist_constant_aliases), a result that
shares memory with a source, a result larger than both Config.fold_constants_max_bytes and its largest
source (a materialized broadcast), and results past Config.fold_weights_max_bytes in all (the
snapshots hold memory for as long as the compiled model lives: autocast's bfloat16 weights are half
the float32 model's size again)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from streamfuse.ir.constant_fold import evaluable, matches_meta, returned_nodes
from streamfuse.ir.fold import (
    SNAPSHOT_NOTE,
    SnapshotCache,
    constant_node,
    drop_unread,
    drop_unread_constants,
    fold_batchnorm,
    fresh_name,
    replace_uses,
)
from streamfuse.ir.graph import Graph, Node, map_args
from streamfuse.ir.merge import merge_sibling_convolutions
from streamfuse.ir.merge_mm import merge_sibling_products, unmerge_unfolded
from streamfuse.ir.ops import OpKind
from streamfuse.ir.pad_mm import pad_product_columns, unpad_unfolded

if TYPE_CHECKING:
    from streamfuse.config import Config

_ALIASES = frozenset({OpKind.VIEW, OpKind.BROADCAST})
_WORK = frozenset({OpKind.REDUCTION, OpKind.CONTRACTION, OpKind.OPAQUE, OpKind.GATHER, OpKind.WINDOW})
"""Ops whose per-call cost a fold saves even where a generated kernel reads the result."""
_MATERIALIZE = frozenset({OpKind.CONTRACTION, OpKind.OPAQUE, OpKind.GATHER})
"""Readers that take their operand from memory: pointwise work on a weight before them is a kernel of its own."""


def fold_model_weights(graph: Graph, cache: SnapshotCache, config: Config, note: str = SNAPSHOT_NOTE,
                       merge_convolutions: bool = True) -> tuple[int, int]:
    """The folds of a captured model's weights, in order, all into `cache`: inference batch-norms into
    convolutions (first: their lowered chains are matched op by op, and this pass would fold their
    parameter-only ops), what is computed from the weights alone with sibling products over their
    concatenated weights (Config.merge_sibling_linears), and (`merge_convolutions`, with
    Config.merge_sibling_convolutions) sibling convolutions stacked. `note`: what happens when a
    source changes. Returns (batch-norms folded, ops folded)."""
    norms = fold_batchnorm(graph, cache, note=note) if config.fold_batchnorm else 0
    ops = 0
    if config.fold_weights:
        # sibling products merged over their weights concatenated, and products over weights padded
        # to aligned rows: the concatenations and pads folded here (undone where they were not)
        merged = merge_sibling_products(graph) if config.merge_sibling_linears else []
        padded = pad_product_columns(graph) if config.product_row_alignment else []
        ops = fold_weights(graph, cache, config.fold_weights_max_bytes, config.fold_constants_max_bytes, note)
        unpad_unfolded(graph, padded)
        unmerge_unfolded(graph, merged)
    if merge_convolutions and config.merge_sibling_convolutions:
        merge_sibling_convolutions(graph, cache)
    return norms, ops


def fold_weights(graph: Graph, cache: SnapshotCache, max_bytes: int, max_result_bytes: int,
                 note: str = SNAPSHOT_NOTE) -> int:
    """Fold in place (module docstring); returns how many ops no longer run per call. `cache`: the
    compile's snapshots (shared by its batch buckets), `max_bytes`: Config.fold_weights_max_bytes,
    `max_result_bytes`: Config.fold_constants_max_bytes, `note`: what happens when a source changes.

    The regions are found from the nodes' recorded shapes alone; only the results kept are computed,
    within the budget (autocast's casts of a large model's weights are never all made at once)."""
    written = {id(dst) for _, dst in graph.writebacks}
    known = {n for n, t in graph.constants.items()
             if id(n) not in written and not isinstance(t, FakeTensor) and t.device.type != "meta"}
    live = {n for n in known if n not in graph.snapshots}
    returned = returned_nodes(graph)
    region: dict[Node, list[Node]] = {}
    """Node computed from constants alone -> the such nodes it is computed from (itself last), in order."""
    for n in graph.nodes:
        if n in known or n.kind is OpKind.INPUT or n in returned or not evaluable(n):
            continue
        operands = n.input_nodes()
        if not all(a in known or a in region for a in operands):
            continue
        sizes = [0, *(a.numel * a.itemsize for a in operands)]
        largest = sum(sizes) if n.kind is OpKind.CONCAT else max(sizes)  # a concatenation is no broadcast
        if n.dtype is not None and n.numel * n.itemsize > max(max_result_bytes, largest + largest // 8):
            continue  # a broadcast materialized beyond its sources' size (a padded weight is not one)
        chain = {m: None for a in operands if a in region for m in region[a]}
        region[n] = [*chain, n]
        if any(a in live for a in operands):
            live.add(n)
    # literals alone (position ids from an arange) stay constant_fold's, which needs no watch; what a
    # parameter or buffer reaches is folded here
    kept = [n for n in region if n in live and n.kind not in _ALIASES and n.dtype is not None
            and _worth(n, region, _outside_readers(n, region))]
    # each kept result's computation, frozen before any rewrite (replace_uses gives readers new args)
    programs = {n: _program(region[n], region) for n in kept}
    budget, folded = max_bytes, 0
    names = {n.name for n in graph.nodes}
    replaced: list[Node | None] = []
    held: dict[int, int] = {}
    """Storage -> bytes of the snapshots this graph reads: regions computing the same thing (T5's
    position bias, taken once per layer) share one snapshot (SnapshotCache), held once."""
    for n in kept:
        size = n.numel * n.itemsize
        sources, calls = programs[n]
        tensors = tuple(graph.constants[a] for a in sources)
        what = ("weight fold", _signature(sources, calls))
        if size > budget and not cache.has(tensors, what):
            continue
        try:
            snapshot = cache.get(tensors, what,
                                 lambda n=n, tensors=tensors, calls=calls: _checked(n, tensors, calls))  # type: ignore[misc]
        except Exception:  # noqa: BLE001 - an op that cannot run here (or not as recorded) runs in the plan
            continue
        storage = snapshot.untyped_storage().data_ptr()
        if storage not in held:
            held[storage] = size
            budget -= size
        const = constant_node(graph, fresh_name(f"{n.name}_folded", names), snapshot)
        replace_uses(graph, n, const)
        graph.nodes.insert(graph.nodes.index(n), const)
        replaced += list(sources)
        folded += 1
    if not folded:
        return 0
    graph.link_users()
    before = set(graph.nodes)
    drop_unread(graph, set(region))
    drop_unread_constants(graph, replaced)
    folded = sum(1 for m in before - set(graph.nodes) if m in region and m.kind not in _ALIASES)
    graph.notes.append(f"{folded} op(s) computed from parameters and buffers alone evaluated once at compile time, "
                       f"{sum(held.values()) / 2**20:.1f} MiB kept ({note})")
    return folded


def _checked(n: Node, tensors: tuple[torch.Tensor, ...], calls: list[Call]) -> torch.Tensor:
    """The region's value, or ValueError where it differs from the node's recorded meta (shape, dtype,
    strides) or shares memory with a source (a view: nothing to keep)."""
    value = _recompute(tensors, calls)
    if isinstance(value, FakeTensor) or not matches_meta(value, n):
        raise ValueError(f"%{n.name} evaluates to other meta than recorded")
    storage = value.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() == storage for t in tensors):
        raise ValueError(f"%{n.name} is a view of a source")
    return value


def _outside_readers(n: Node, region: dict[Node, list[Node]]) -> list[Node]:
    """The nodes outside the region that read `n`, directly or through views the region holds."""
    readers: list[Node] = []
    stack, seen = [n], {n}
    while stack:
        for u in stack.pop().users:
            if u not in region:
                readers.append(u)
            elif u.kind in _ALIASES and u not in seen:
                seen.add(u)
                stack.append(u)
    return readers


def _worth(n: Node, region: dict[Node, list[Node]], readers: list[Node]) -> bool:
    """Folding `n` saves work per call: its region holds more than pointwise ops and views (a norm, a
    gather, a product), or something materializes it (an ATen product or convolution, a gather's table:
    a weight cast under autocast). Pointwise work on weights read only by generated kernels costs them
    nothing, fused where it is read (a batch-norm left unfolded keeps reading its live parameters)."""
    return bool(readers) and (any(m.kind in _WORK for m in region[n]) or any(r.kind in _MATERIALIZE for r in readers))


Call = tuple[object, tuple[object, ...], dict[str, object]]
"""(target, args, kwargs) of one folded op, its operands written as Slot positions."""


class Slot(int):
    """An operand of a frozen call: the position of a value in _recompute's list (sources first)."""

    def __repr__(self) -> str:  # not a literal int in _signature
        return f"<value {int(self)}>"


def _program(steps: list[Node], region: dict[Node, list[Node]]) -> tuple[tuple[Node, ...], list[Call]]:
    """The sources a region reads from outside it and its ops as calls over value positions (sources
    first, then each op's result in order), independent of the Nodes' later rewrites."""
    sources = tuple(dict.fromkeys(a for m in steps for a in m.input_nodes() if a not in region))
    at = {a: Slot(i) for i, a in enumerate(sources)} | {m: Slot(len(sources) + i) for i, m in enumerate(steps)}
    calls: list[Call] = [(m.target, map_args(m.args, at.__getitem__),  # type: ignore[misc]
                          {k: map_args(v, at.__getitem__) for k, v in m.kwargs.items()}) for m in steps]
    return sources, calls


def _recompute(tensors: tuple[torch.Tensor, ...], calls: list[Call]) -> torch.Tensor:
    """The region's last value from the sources' current values (SnapshotCache.refresh calls this
    again after an in-place change; `tensors` are the same tensor objects as at compile time)."""
    values: list[object] = list(tensors)

    def value(v: object) -> object:
        if isinstance(v, Slot):
            return values[v]
        if isinstance(v, (list, tuple)):
            return type(v)(value(x) for x in v)
        return v

    # real values even under AOTAutograd's FakeTensorMode (the backend's compile); autocast off: the
    # trace holds autocast's casts already, and an ATen op called in the caller's autocast region
    # (a refresh at call time) would cast again
    with torch.no_grad(), unset_fake_temporarily(), torch._C._DisableAutocast():
        for target, args, kwargs in calls:
            values.append(target(*value(args), **{k: value(v) for k, v in kwargs.items()}))  # type: ignore[operator]
    out = values[-1]
    assert isinstance(out, torch.Tensor)
    return out


def _signature(sources: tuple[Node, ...], calls: list[Call]) -> str:
    """What the region computes, independent of node names: graphs of one model captured at other
    batch sizes share the snapshot (SnapshotCache keys it with the sources' identities too)."""
    return repr((len(sources), [(str(target), args, kwargs) for target, args, kwargs in calls]))
