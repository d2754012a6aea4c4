"""One memory layout for a convolutional network's activations (Config.conv_layout).

Chosen one convolution at a time (tune/conv_layout.py), channels_last pays for converting each
convolution's NCHW input, a full copy of the activation per convolution; at batch 32 that copy
costs about as much as the convolution, so "auto" kept most of resnet50's convolutions in NCHW,
where cuDNN's float32 (TF32) kernels on the H200 are the slow ones, and the suite's vision models
ran at 0.70-0.74x of torch.compile(mode="reduce-overhead") at batch 32 (run 79; Inductor runs the
whole network channels_last).

Here the layout is chosen for the network: every eligible convolution runs channels_last, and the
generated pointwise kernel feeding a convolution stores its result channels_last (walking its
domain in that memory order, Group.walk), so the next convolution reads it
without a conversion. Only results read by nothing but generated pointwise kernels (which take
strides at launch) and channels_last convolutions are stored so; a model output never is.

"auto" (CUDA with Config.autotune) keeps the network layout only if the convolutions, timed the
way they would run in it (input already channels_last where a kernel stores it so), beat the
one-by-one choice by Config.network_layout_margin; "channels_last" always takes it; "native" never.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from streamfuse.config import Config
from streamfuse.fusion.geometry import fills_rows_contiguous, loopable
from streamfuse.fusion.groups import Group, GroupKind, Plan
from streamfuse.ir.graph import Node
from streamfuse.ir.indexing import CHANNELS_LAST_ORDER, channels_last_strides, contiguous_strides, dense_order
from streamfuse.ir.ops import OpKind, packet_name
from streamfuse.profile.timing import time_graph_us
from streamfuse.tune.conv_layout import ConvLayoutChoice, measure_layout

_STRIDED = frozenset({GroupKind.POINTWISE, GroupKind.HORIZONTAL})
"""Groups whose kernels load every input with the strides it has at launch."""


@dataclass
class NetworkLayout:
    channels_last: bool
    reason: str
    channels_last_us: float | None = None
    """The convolutions' µs in the network layout (measured under "auto")."""
    chosen_us: float | None = None
    """The convolutions' µs as chosen one at a time (measured under "auto")."""
    stored: list[Node] = field(default_factory=list)
    """Kernel results stored channels_last for the convolutions that read them."""

    def describe(self) -> str:
        measured = (f": convolutions {self.channels_last_us:.1f} µs so, against {self.chosen_us:.1f} µs "
                    f"in the layouts chosen one at a time" if self.channels_last_us is not None
                    and self.chosen_us is not None else "")
        if not self.channels_last:
            return f"activation layout: chosen per convolution ({self.reason}{measured})"
        return (f"activation layout: channels_last through the network ({self.reason}{measured}); "
                f"{len(self.stored)} kernel result(s) stored channels_last (convolution inputs and the "
                "kernels between convolutions)")


def storable(plan: Plan, owner: dict[Node, Group], convs: set[Node],
             kept_cl: frozenset[Node] = frozenset()) -> list[Node]:
    """The results a generated pointwise kernel stores channels_last under the network layout: 4-D
    floating results, recorded contiguous, no graph output, read only by generated pointwise kernels
    and as the input of convolutions in `convs`, that are either (1) a convolution's input, or (2)
    computed from a channels_last tensor: a convolution's result kept channels_last (`kept_cl`) or a
    result already stored so. (2) keeps a chain of generated kernels between convolutions in one
    layout: squeezenet's fire module stored its two ReLUs row-major between channels_last
    convolutions and the max pool after them, so both kernels converted layouts on the way (600-1300
    GB/s, 116 µs of its call at batch 32 against reduce-overhead's 40, run 118). A reader may also be
    a zero-copy view taking channels (`chunk`, `split`, `slice` along dim 1, and its `getitem`s) whose
    own readers all qualify; and a 5-D result read only as its `shuffled_view` qualifies as that view
    does, stored so that the view is channels_last (shufflenet_v2 at batch 32: 0.95x to 1.19x of
    reduce-overhead, run 122)."""
    outputs = set(plan.graph.output_nodes)
    found: list[Node] = []
    for conv in convs:
        x = conv.args[0]
        if isinstance(x, Node) and x not in found and _storable(x, outputs, owner, convs):
            found.append(x)
    cl = set(found) | set(kept_cl)
    for g in plan.groups:  # dependency order: one pass reaches every kernel of a chain
        for part in (g.parts if g.kind is GroupKind.HORIZONTAL else [g]):
            if part.kind is not GroupKind.POINTWISE or not any(i in cl for i in part.inputs):
                continue
            for x in part.outputs:
                if x not in cl and _storable(x, outputs, owner, convs):
                    found.append(x)
                    cl.add(x)
    return found


def _storable(x: Node, outputs: set[Node], owner: dict[Node, Group], convs: set[Node]) -> bool:
    """`x` is a pointwise kernel's 4-D floating result, recorded contiguous, no graph output, with
    more than one channel and pixel, that every reader takes as stored; or a 5-D such result read
    only as the 4-D view merging its dims 1 and 2 into channels (`shuffled_view`), stored so that
    view is channels_last."""
    if x in outputs or x.dtype is None or len(x.shape) not in (4, 5) or not x.dtype.is_floating_point:
        return False
    part = producing_part(owner.get(x), x)
    if part is None or part.kind is not GroupKind.POINTWISE or x not in part.outputs:
        return False
    if tuple(x.strides) != contiguous_strides(x.shape):
        return False
    seen = x if len(x.shape) == 4 else shuffled_view(x)
    if seen is None or seen in outputs or seen.shape[1] == 1 or seen.shape[2] * seen.shape[3] == 1:
        return False  # (one channel or one pixel: the same bytes in either layout)
    return all(_reads_as_stored(u, seen, owner, convs, outputs) for u in seen.users)


def shuffled_view(x: Node) -> Node | None:
    """The one reader of a 5-D `x` when it is the 4-D view [b, g * k, h, w] of `x`'s [b, g, k, h, w]:
    ShuffleNet's channel shuffle, `x.view(b, 2, c // 2, h, w).transpose(1, 2).contiguous().view(b, c,
    h, w)`, whose 5-D copy is a generated kernel's result. Else None."""
    if len(x.shape) != 5 or len(x.users) != 1:
        return None
    (v,) = x.users
    if packet_name(v.op) not in ("view", "_unsafe_view", "reshape") or v.args[0] is not x:
        return None
    b, g, k, h, w = x.shape
    return v if tuple(v.shape) == (b, g * k, h, w) else None


def stored_strides(x: Node) -> tuple[int, ...]:
    """The strides the network layout stores `x` with: channels_last, or for a 5-D result read as
    its `shuffled_view`, the strides that make that view channels_last."""
    if len(x.shape) == 4:
        return channels_last_strides(x.shape)
    _, g, k, h, w = x.shape
    c = g * k
    return (c * h * w, k, 1, w * c, c)


def read_channels_last(stored: list[Node]) -> set[Node]:
    """The stored results and the 4-D views through which their 5-D ones are read: each is a
    channels_last tensor when the plan runs."""
    return set(stored) | {v for x in stored if len(x.shape) == 5 and (v := shuffled_view(x)) is not None}


def producing_part(group: Group | None, x: Node) -> Group | None:
    """The group computing `x`: `group` itself, or its part that does where it is HORIZONTAL."""
    if group is None or group.kind is not GroupKind.HORIZONTAL:
        return group
    return next((p for p in group.parts if x in p.outputs), None)


def _reads_as_stored(user: Node, x: Node, owner: dict[Node, Group], convs: set[Node], outputs: set[Node]) -> bool:
    """`user` reads `x` correctly and cheaply in channels_last: a generated pointwise kernel (strides
    at launch), a convolution of `convs` reading it as its input only, or a zero-copy view taking
    channels of it, not returned, whose own readers all qualify."""
    group = owner.get(user)
    if group is not None and group.kind in _STRIDED:
        return True
    if group is not None and group.kind is GroupKind.ALIAS and user not in outputs and _slices_channels(user, x):
        return all(_reads_as_stored(u, user, owner, convs, outputs) for u in user.users)  # a torch view: any strides
    return user in convs and user.args[0] is x and x not in user.args[1:]


def _slices_channels(user: Node, x: Node) -> bool:
    """`user` is a zero-copy view taking channels of the 4-D `x` (ShuffleNet's `chunk`), or picks a
    result of one: valid on any strides, as the runtime runs it through torch on the tensor itself."""
    if user.kind is OpKind.GETITEM:
        return True
    name = packet_name(user.op)
    if name not in ("split", "split_with_sizes", "chunk", "slice") or user.args[0] is not x or len(x.shape) != 4:
        return False
    at = 1 if name == "slice" else 2  # slice(x, dim, ...); split / split_with_sizes / chunk(x, n, dim)
    dim = user.args[at] if len(user.args) > at else user.kwargs.get("dim", 0)
    return isinstance(dim, int) and dim % 4 == 1


def choose_network_layout(plan: Plan, owner: dict[Node, Group], convs: list[Group],
                          per_conv: dict[str, ConvLayoutChoice], keep_cl: dict[str, bool], config: Config,
                          device: torch.device,
                          timer: Callable[[Callable[[], Any]], float] = time_graph_us
                          ) -> tuple[NetworkLayout, dict[str, ConvLayoutChoice]]:
    """The network's layout, and each convolution's choice under it (`per_conv` where unchanged).
    Stores nothing yet: `apply` does, once the caller keeps the layout."""
    nodes = {g.nodes[0] for g in convs}
    if config.conv_layout == "native":
        return NetworkLayout(False, "Config.conv_layout"), per_conv
    if len(convs) < 2:
        return NetworkLayout(False, f"{len(convs)} convolution(s) it could convert"), per_conv
    kept_cl = frozenset(g.nodes[0] for g in convs if keep_cl[g.name])
    stored = storable(plan, owner, nodes, kept_cl)
    if config.conv_layout == "channels_last":
        return NetworkLayout(True, "Config.conv_layout", stored=stored), per_conv
    if device.type != "cuda" or not config.autotune:
        return NetworkLayout(False, "not measured: needs CUDA and Config.autotune"), per_conv
    return measure_network_layout(plan, convs, per_conv, keep_cl, stored, config, device, timer)


def measure_network_layout(plan: Plan, convs: list[Group], per_conv: dict[str, ConvLayoutChoice],
                           keep_cl: dict[str, bool], stored: list[Node], config: Config, device: torch.device,
                           timer: Callable[[Callable[[], Any]], float] = time_graph_us
                           ) -> tuple[NetworkLayout, dict[str, ConvLayoutChoice]]:
    """"auto": every convolution timed channels_last the way the network layout runs it (its input
    already channels_last where `stored` holds it; cached), summed against the one-by-one choices."""
    chosen = network = 0.0
    choices: dict[str, ConvLayoutChoice] = {}
    cl_inputs = read_channels_last(stored)
    for g in convs:
        node, one = g.nodes[0], per_conv[g.name]
        if one.measured_us is None:
            return NetworkLayout(False, f"{g.name} not measured ({one.reason})"), per_conv
        m = measure_layout(node, plan.graph, config, device, timer, convert_back=not keep_cl[g.name],
                           input_channels_last=node.args[0] in cl_inputs)
        if m.channels_last_us is None:
            return NetworkLayout(False, f"{g.name}: {m.reason}"), per_conv
        chosen += one.measured_us
        network += m.channels_last_us
        choices[g.name] = ConvLayoutChoice("channels_last", one.native_us, m.channels_last_us,
                                           reason="network layout, measured")
    wins = network < (1.0 - config.network_layout_margin) * chosen
    layout = NetworkLayout(wins, "measured", network, chosen, stored if wins else [])
    return layout, (choices if wins else per_conv)


def rows_contiguous_reductions(plan: Plan, owner: dict[Node, Group], runtime: Mapping[Node, tuple[int, ...]],
                               config: Config, sm_count: int) -> list[Group]:
    """Mark the reductions whose rows lie next to each other in memory (Group.rows_contiguous): every
    input of the domain's shape has its innermost kept dimension dense, as a channels_last tensor
    reduced over H and W has (`runtime`: strides that differ from the traced ones at run time, the
    convolutions' results kept channels_last). Their results of the domain's shape are stored
    channels_last too, where only generated kernels read them. Returns the marked groups."""
    marked = []
    for g in plan.groups:
        dom = g.domain
        if g.kind is not GroupKind.REDUCTION or dom is None or not loopable(g):
            continue
        if not fills_rows_contiguous(dom, config, sm_count):
            continue
        full = [x for x in g.inputs if x.shape == dom.shape]
        kept = [d for d in range(len(dom.shape)) if d not in dom.dims and dom.shape[d] > 1]
        if not full or not kept or not all(runtime.get(x, x.strides)[kept[-1]] == 1 for x in full):
            continue
        g.rows_contiguous = True
        marked.append(g)
        if dom.dims != (2, 3) or not all(tuple(runtime.get(x, x.strides)) == channels_last_strides(x.shape)
                                         for x in full):
            continue
        for out in g.outputs:
            if (out.shape == dom.shape and out not in plan.graph.output_nodes and out.dtype is not None
                    and out.dtype.is_floating_point and tuple(out.strides) == contiguous_strides(out.shape)
                    and all(owner[u].kind in _STRIDED or owner[u].kind is GroupKind.REDUCTION for u in out.users)):
                out.strides = channels_last_strides(out.shape)
    return marked


def apply(layout: NetworkLayout, owner: dict[Node, Group]) -> None:
    """Record the stored results' channels_last strides, and have their kernels walk that memory
    order (Group.walk): code generation writes them so."""
    for x in layout.stored:
        x.strides = stored_strides(x)
        part = producing_part(owner[x], x)
        assert part is not None
        if len(x.shape) == 4:
            part.walk = CHANNELS_LAST_ORDER
        else:
            part.walk = dense_order(x.shape, x.strides)
            view = shuffled_view(x)
            assert view is not None
            view.strides = channels_last_strides(view.shape)
