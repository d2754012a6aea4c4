"""Fold inference batch-norm into the preceding convolution's weights (as TensorRT does, and
Inductor with freezing).

    conv(x, W, b) -> (y - mean) * rsqrt(var + eps) * gamma + beta
        ==  conv(x, W * s[:, None, ...], (b - mean) * s + beta),   s = gamma * rsqrt(var + eps)

A convolution is linear in its weights and its bias, so the per-channel affine map of an
inference batch-norm is absorbed by scaling each output channel's filter (dim 0 of W, which
stays true with groups and depthwise convs) and shifting its bias. The epilogue kernel that
applied the batch-norm, and its reads of four parameter vectors, disappear: conv+BN+ReLU leaves
a ReLU-only epilogue, conv+BN leaves the convolution alone.

Where: after conversion, on the chain `ir/lowerings.py` (`_lower_batch_norm`) emits for
`_native_batch_norm_legit_no_training`. Matching the lowered chain keeps the pass a pure
Graph -> Graph rewrite (no torch.fx, no flag through the converter). The chain is matched
structurally, op by op, with every operand checked, so any match, whatever produced it, is the
same algebra: folding it is correct.

It folds only when the convolution's weight (and bias, if any) and the batch-norm's statistics
and affine parameters are all compile-time constants, the convolution is not transposed (its
weight is [in, out/groups, ...]: channels are not dim 0), and the batch-norm is the convolution
result's only reader (otherwise the other readers would see the normalized values).

Snapshot semantics: the folded tensors are computed at compile time (in float64, then cast to the
weight's dtype, on the weight's device). streamfuse.compile watches the tensors they came from
(SnapshotWatch: a version-counter compare per call) and computes them again in place when one
changed in place (an optimizer step, load_state_dict, `p.add_()`; until session 27 such changes
were silently not seen); the backend binds its graph again unfolded instead (capture/backend.py).
Assigning a parameter's `.data` or a new Parameter is not seen: compile again. `Config(fold_batchnorm=False)`
runs the batch-norm as a fused epilogue that reads the live parameters on every call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeGuard, TypeVar

import torch

from streamfuse.ir.graph import Graph, Node, map_args
from streamfuse.ir.lowerings import Builder
from streamfuse.ir.ops import OpKind

_CONV = "aten.convolution.default"
_CONV_ARITY = 9
"""aten.convolution.default has nine arguments and no defaults; the converter passes them positionally."""

Sources = tuple[torch.Tensor | None, ...]
"""(weight, bias, gamma, beta, mean, var): the tensors one fold reads."""


T = TypeVar("T")


class SnapshotCache:
    """Tensors computed at compile time from a model's weights (folded batch-norms, stacked sibling
    filters: ir/merge.py), keyed by the identity of their sources and what was computed.

    One compile may build several graphs of the same model (one per batch bucket, captured
    later). Sharing the snapshots keeps one copy of the derived weights instead of one per bucket,
    and gives every bucket the same snapshot even if the module's weights changed in between."""

    def __init__(self) -> None:
        self._entries: dict[tuple[object, ...], tuple[tuple[torch.Tensor | None, ...], Any, Callable[[], Any]]] = {}

    def get(self, sources: tuple[torch.Tensor | None, ...], what: object, make: Callable[[], T]) -> T:
        """`make()` (which must read `sources` alone, at call time), computed once per sources."""
        hit = self._hit(sources, what)
        if hit is not None:
            return hit[1]  # type: ignore[no-any-return]
        value = make()
        self._entries[(*(id(t) for t in sources), what)] = (sources, value, make)
        return value

    def has(self, sources: tuple[torch.Tensor | None, ...], what: object) -> bool:
        """Whether `get(sources, what, ...)` would return a snapshot already made (no new memory)."""
        return self._hit(sources, what) is not None

    def _hit(self, sources: tuple[torch.Tensor | None, ...], what: object) -> tuple[Any, ...] | None:
        hit = self._entries.get((*(id(t) for t in sources), what))
        # the entry holds its sources, so their ids cannot be reused while it lives; `is` is a guard
        return hit if hit is not None and all(a is b for a, b in zip(hit[0], sources, strict=True)) else None

    def sources(self) -> list[torch.Tensor]:
        """Every distinct tensor a snapshot was computed from (to watch for in-place changes)."""
        seen: dict[int, torch.Tensor] = {}
        for tensors, _, _ in self._entries.values():
            for t in tensors:
                if t is not None:
                    seen.setdefault(id(t), t)
        return list(seen.values())

    def refresh(self) -> None:
        """Every snapshot computed again from its sources' current values and copied into the
        tensors the plans read (their addresses stay: recorded CUDA graphs see the new values).
        In the order they were made, so a snapshot of snapshots (stacked folded filters) follows."""
        with torch.no_grad():
            for _, value, make in self._entries.values():
                fresh = make()
                for old, new in zip(_tensors(value), _tensors(fresh), strict=True):
                    old.copy_(new)

    def watch(self, *models: Any) -> SnapshotWatch | None:
        """A watch over the model's own tensors behind the snapshots; None if there are none (or
        they keep no version counter: made under inference_mode). `models` (those that are
        nn.Modules): their batch-norms whose running statistics a snapshot read are watched through their
        `num_batches_tracked` too. ATen's training-mode batch-norm updates the statistics without
        bumping their version counters, and the module bumps that counter's on every such forward
        (a recalibration pass in train mode, then eval: the folds were stale, helper sweep session 41)."""
        made = {id(t) for _, value, _ in self._entries.values() for t in _tensors(value)}
        live = [t for t in self.sources() if id(t) not in made]
        if not live or any(t.is_inference() for t in live):
            return None
        modules = [m for model in models if isinstance(model, torch.nn.Module) for m in model.modules()]
        return SnapshotWatch(self, live + statistics_counters(modules, live))


def statistics_counters(modules: Iterable[Any], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The `num_batches_tracked` of those `modules` whose running mean is one of `tensors`: a
    training-mode forward bumps it, but not the version counters of the statistics it updates."""
    read = {id(t) for t in tensors}
    return [m.num_batches_tracked for m in modules if isinstance(getattr(m, "num_batches_tracked", None), torch.Tensor)
            and id(getattr(m, "running_mean", None)) in read and not m.num_batches_tracked.is_inference()]


def watchable(tensors: Any) -> bool:
    """Snapshots of these tensors can follow them: none is an inference tensor (made under
    torch.inference_mode), which keeps no version counter, so an in-place change (a load_state_dict
    inside inference_mode) would leave a snapshot stale (helper sweep, session 41)."""
    return not any(isinstance(t, torch.Tensor) and t.is_inference() for t in tensors)


class SnapshotWatch:
    """streamfuse.compile's folded weights follow the model: each call compares the version counters
    of the parameters and buffers they were computed from (an optimizer step, load_state_dict or a
    `p.add_()` bumps them) and, when one moved, computes every snapshot again in place. A version
    read per source tensor per call (resnet50: 265 tensors, ~10 µs of host time). Assigning a
    tensor's `.data` bumps no counter and is not seen."""

    def __init__(self, cache: SnapshotCache, tensors: list[torch.Tensor]):
        self.cache = cache
        self.tensors = tensors
        self.versions = [t._version for t in tensors]
        self.refreshes = 0
        """Times the snapshots were computed again."""

    def check(self) -> None:
        versions = [t._version for t in self.tensors]
        if versions != self.versions:
            self.cache.refresh()
            self.versions = versions
            self.refreshes += 1


def _tensors(value: Any) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else [t for t in value if isinstance(t, torch.Tensor)]


@dataclass
class _Match:
    """One convolution followed by a lowered batch-norm that can be folded into it."""

    conv: Node
    weight: Node
    bias: Node | None
    mean: Node
    var: Node
    eps: float
    gamma: Node | None = None
    beta: Node | None = None
    chain: list[Node] = field(default_factory=list)
    """The batch-norm's nodes, removed by the fold; the last one's readers read the conv instead."""


SNAPSHOT_NOTE = "a snapshot, computed again in place when a parameter it came from changes in place"


def fold_batchnorm(graph: Graph, cache: SnapshotCache | None = None, note: str = SNAPSHOT_NOTE) -> int:
    """Fold every foldable inference batch-norm into its convolution, in place; returns how many.

    `cache` shares folded tensors between graphs of the same model (see SnapshotCache); `note` ends
    the line each fold adds to the graph's notes (what happens when the parameters change)."""
    cache = cache if cache is not None else SnapshotCache()
    folds = 0
    replaced: list[Node | None] = []
    for conv in [n for n in graph.nodes if n.op == _CONV]:
        # users go stale during the loop only where a fold touched: the folded chain's constants and
        # the removed nodes, which only make a later match more conservative (an extra reader); no
        # later match reads the new nodes' users. So they are linked once, after the last fold
        # (googlenet: 57 folds relinked the whole graph 57 times)
        match = _match(graph, conv)
        if match is None:
            continue
        sources = _sources(graph, match)
        weight, bias = cache.get(sources, ("batch-norm fold", match.eps), partial(_fold_tensors, sources, match.eps))
        _rewrite(graph, match, weight, bias, note)
        replaced += [match.weight, match.bias, match.gamma, match.beta, match.mean, match.var]
        folds += 1
    if folds:
        graph.link_users()
        drop_unread_constants(graph, replaced)
    return folds


# ---------------------------------------------------------------------------- matching
def _match(graph: Graph, conv: Node) -> _Match | None:
    """The batch-norm chain reading `conv`, if it and `conv` fold; None otherwise."""
    if len(conv.args) != _CONV_ARITY or conv.kwargs or len(conv.shape) < 3 or conv.dtype is None:
        return None
    weight, bias, transposed = conv.args[1], conv.args[2], conv.args[6]
    if transposed is not False or not _is_constant(graph, weight) or not weight.dtype.is_floating_point:
        return None
    if bias is not None and not _is_constant(graph, bias):
        return None
    outputs = graph.output_nodes
    if len(conv.users) != 1 or conv in outputs:
        return None
    per_channel = (1, conv.shape[1]) + (1,) * (len(conv.shape) - 2)

    # core: (conv - mean) * rsqrt(var + eps)
    centered = conv.users[0]
    if not _is_call(centered, "aten.sub.Tensor") or centered.args[0] is not conv:
        return None
    mean_view = centered.args[1]
    normed = _only_user(centered, outputs)
    if normed is None or not _is_call(normed, "aten.mul.Tensor"):
        return None
    rstd = _other_operand(normed, centered)
    if rstd is None or not _is_call(rstd, "aten.rsqrt.default", arity=1):
        return None
    var_eps = rstd.args[0]
    if not (isinstance(var_eps, Node) and _is_call(var_eps, "aten.add.Tensor")):
        return None
    var_view, eps = var_eps.args
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return None
    mean, var = _channel_constant(graph, mean_view, per_channel), _channel_constant(graph, var_view, per_channel)
    if mean is None or var is None:
        return None
    assert isinstance(mean_view, Node) and isinstance(var_view, Node)
    match = _Match(conv, weight, bias, mean, var, float(eps),
                   chain=[mean_view, centered, var_view, var_eps, rstd, normed])

    # optional tail, in the lowering's order: * gamma, + beta, cast back to the conv's dtype
    _extend_affine(graph, match, "aten.mul.Tensor", per_channel, outputs)
    _extend_affine(graph, match, "aten.add.Tensor", per_channel, outputs)
    _extend_cast(match, outputs)
    if match.chain[-1].dtype != conv.dtype or not _exclusive(match.chain, outputs):
        return None
    return match


def _extend_affine(graph: Graph, match: _Match, op: str, per_channel: tuple[int, ...], outputs: list[Node]) -> None:
    """Append `tail op view(constant)` (gamma for mul, beta for add) to the chain when it is next."""
    tail = match.chain[-1]
    step = _only_user(tail, outputs)
    if step is None or not _is_call(step, op):
        return
    view = _other_operand(step, tail)
    constant = _channel_constant(graph, view, per_channel)
    if view is None or constant is None or len(view.users) != 1 or view in outputs:
        return
    if op == "aten.mul.Tensor":
        match.gamma = constant
    else:
        match.beta = constant
    match.chain += [view, step]


def _extend_cast(match: _Match, outputs: list[Node]) -> None:
    """Append the lowering's final cast (mixed-precision batch-norm) when it returns to the conv's dtype."""
    tail = match.chain[-1]
    step = _only_user(tail, outputs)
    if (step is not None and step.op == "aten._to_copy.default" and step.args == (tail,)
            and set(step.kwargs) == {"dtype"} and step.dtype == match.conv.dtype):
        match.chain.append(step)


def _is_constant(graph: Graph, value: object) -> TypeGuard[Node]:
    return isinstance(value, Node) and value in graph.constants and value.dtype is not None


def _is_call(node: Node, op: str, arity: int = 2) -> bool:
    """`node` is `op` on `arity` positional arguments, without kwargs (an add/sub alpha is not matched)."""
    return node.op == op and len(node.args) == arity and not node.kwargs


def _only_user(node: Node, outputs: list[Node]) -> Node | None:
    return node.users[0] if len(node.users) == 1 and node not in outputs else None


def _other_operand(node: Node, known: Node) -> Node | None:
    """The operand of a binary (commutative) op that is not `known`, if it is a Node."""
    a, b = node.args
    other = b if a is known else a if b is known else None
    return other if isinstance(other, Node) and other is not known else None


def _channel_constant(graph: Graph, view: object, per_channel: tuple[int, ...]) -> Node | None:
    """The [C] constant behind `view([C] constant, [1, C, 1, ...])`, the lowering's per-channel operand."""
    if not (isinstance(view, Node) and view.op == "aten.view.default" and view.shape == per_channel):
        return None
    source = view.args[0]
    if not _is_constant(graph, source) or source.shape != (per_channel[1],):
        return None
    return source if source.dtype.is_floating_point else None


def _exclusive(chain: list[Node], outputs: list[Node]) -> bool:
    """Only the chain reads its own intermediates (its last node's readers are rewired)."""
    inside = set(chain)
    return all(n not in outputs and all(u in inside for u in n.users) for n in chain[:-1])


# ---------------------------------------------------------------------------- folding
def _sources(graph: Graph, m: _Match) -> Sources:
    return tuple(graph.constants[n] if n is not None else None
                 for n in (m.weight, m.bias, m.gamma, m.beta, m.mean, m.var))


def _fold_tensors(sources: Sources, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """W' = W * s per output channel and b' = (b - mean) * s + beta, s = gamma / sqrt(var + eps).

    In float64 (rsqrt of a tiny variance and the subtraction lose bits in float32), then cast
    to the weight's dtype (ATen's convolution requires the bias in the weight's dtype). Reads the
    source tensors themselves, so SnapshotCache.refresh can compute it again from their new values."""
    weight, bias, gamma, beta, mean, var = sources
    assert weight is not None and mean is not None and var is not None
    device = weight.device

    def wide(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device=device, dtype=torch.float64)

    with torch.no_grad():
        scale = torch.rsqrt(wide(var) + eps)
        if gamma is not None:
            scale = scale * wide(gamma)
        shift = (wide(bias) if bias is not None else 0.0) - wide(mean)
        new_bias = shift * scale + (wide(beta) if beta is not None else 0.0)
        folded = wide(weight) * scale.view((-1,) + (1,) * (weight.dim() - 1))
        # keep the weight's layout (e.g. channels_last): the conv node's recorded output strides follow it
        new_weight = torch.empty_like(weight, memory_format=torch.preserve_format).copy_(folded)
        return new_weight, new_bias.to(weight.dtype).contiguous()


def _rewrite(graph: Graph, m: _Match, weight: torch.Tensor, bias: torch.Tensor, note: str) -> None:
    """Point the conv at the folded constants, drop the chain, and let its readers read the conv."""
    names = {n.name for n in graph.nodes}
    w_node = constant_node(graph, fresh_name(f"{m.weight.name}_folded", names), weight)
    b_node = constant_node(graph, fresh_name(f"{m.conv.name}_bias_folded", names), bias)
    args = list(m.conv.args)
    # the folded bias goes to the epilogue, not to cuDNN: ATen adds a convolution's bias in a kernel
    # of its own (measured on the H200: conv+bias+ReLU 15.1 us against 12.9 with the add fused)
    args[1], args[2] = w_node, None
    m.conv.args = tuple(args)
    added = bias_added_after(m.conv, b_node, names)
    replace_uses(graph, m.chain[-1], added[-1])

    removed = set(m.chain)
    at = graph.nodes.index(m.conv)
    nodes = graph.nodes[:at] + [w_node, b_node, m.conv, *added] + graph.nodes[at + 1:]
    graph.nodes = [n for n in nodes if n not in removed]
    graph.notes.append(f"batch-norm after %{m.conv.name} folded into its weights, its bias added in the epilogue "
                       f"({note})")


def bias_added_after(conv: Node, bias: Node, names: set[str]) -> list[Node]:
    """New nodes adding a [C] `bias` to `conv`'s result per channel: its view to [1, C, 1, ...], then
    the add (last), in the convolution's strides. Nobody reads them yet (see replace_uses)."""
    per_channel = (1, conv.shape[1]) + (1,) * (len(conv.shape) - 2)
    build = Builder(fresh=lambda name: fresh_name(name, names), nodes=[])
    view = build.add(f"{bias.name}_c", torch.ops.aten.view.default, (bias, list(per_channel)),
                     shape=per_channel, dtype=bias.dtype)
    build.add(f"{conv.name}_biased", torch.ops.aten.add.Tensor, (conv, view), shape=conv.shape, dtype=conv.dtype,
              strides=conv.strides)
    return build.nodes


def replace_uses(graph: Graph, old: Node, new: Node) -> None:
    """Every reader of `old` (its linked users, and the graph's outputs) reads `new` instead."""
    def swap(n: Node) -> Node:
        return new if n is old else n

    for user in old.users:
        user.args = map_args(user.args, swap)
        user.kwargs = {k: map_args(v, swap) for k, v in user.kwargs.items()}
    graph.outputs = [map_args(o, swap) for o in graph.outputs]


def constant_node(graph: Graph, name: str, value: torch.Tensor) -> Node:
    node = Node(name, "input", OpKind.INPUT, None, shape=tuple(value.shape), dtype=value.dtype,
                strides=tuple(value.stride()))
    graph.constants[node] = value
    graph.snapshots.add(node)
    return node


def drop_unread_constants(graph: Graph, candidates: list[Node | None]) -> None:
    """Remove the constants the fold left unread (others may still read shared ones), so the graph
    holds no reference to parameters it no longer uses."""
    outputs = graph.output_nodes
    dead = {n for n in candidates if n is not None and not n.users and n not in outputs}
    if dead:
        graph.nodes = [n for n in graph.nodes if n not in dead]
        for n in dead:
            graph.constants.pop(n, None)
            graph.snapshots.discard(n)


def drop_unread(graph: Graph, region: set[Node]) -> None:
    """The nodes of `region` nothing reads any more (readers first; not outputs), so the plan does not
    compute them (folded nodes, a merge's former operands)."""
    gone: set[Node] = set()
    outputs = graph.output_nodes
    for n in reversed(graph.nodes):
        if n in region and n not in outputs and all(u in gone for u in n.users):
            gone.add(n)
    if gone:
        graph.nodes = [n for n in graph.nodes if n not in gone]
        graph.link_users()


def fresh_name(name: str, names: set[str]) -> str:
    base, i = name, 1
    while name in names:
        name, i = f"{base}_{i}", i + 1
    names.add(name)
    return name


def splice(graph: Graph, old: Node, new: list[Node], result: Node, dropped: tuple[Node, ...] = ()) -> None:
    """Put `new` (ending in `result`, which every reader of `old` reads instead) where `old` was,
    and drop `old` and `dropped` from the graph. The caller relinks users (graph.link_users) once
    it has made all its rewrites."""
    replace_uses(graph, old, result)
    at = graph.nodes.index(old)
    graph.nodes[at:at + 1] = new
    gone = set(map(id, dropped))
    graph.nodes = [n for n in graph.nodes if id(n) not in gone]
