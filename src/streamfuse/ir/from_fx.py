"""Converter: an aten-level torch.fx GraphModule -> streamfuse Graph.

The only module of ir/ that touches torch.fx. Shapes, dtypes and strides come from each fx
node's meta["val"] (the fake tensors that AOTAutograd / export attach).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx

from streamfuse.ir.graph import Arg, Graph, Node, iter_nodes
from streamfuse.ir.lowerings import LOWERINGS
from streamfuse.ir.lowerings import Builder as _Builder
from streamfuse.ir.ops import MULTI_VIEWS, OpKind, kind_of, refine_kind

aten = torch.ops.aten

# Side-effect-free ops that only assert metadata; they have no place in an executed plan.
_DROPPED = {"aten._assert_tensor_metadata.default", "aten._assert_scalar.default"}


class UnsupportedGraph(ValueError):
    """The fx graph holds something the IR cannot represent (e.g. dynamic shapes)."""


def graph_from_fx(gm: torch.fx.GraphModule, bound: Mapping[str, torch.Tensor] | None = None,
                  literals: frozenset[str] = frozenset()) -> Graph:
    """Convert `gm`. Placeholders named in `bound` become compile-time constants (weights);
    the others, in order, are the graph's inputs. Bound placeholders named in `literals` (tensors
    the trace made, as torch.export lifts them) are snapshots, like get_attr constants."""
    bound = dict(bound or {})
    env: dict[torch.fx.Node, Arg] = {}
    nodes: list[Node] = []
    inputs: list[Node] = []
    constants: dict[Node, torch.Tensor] = {}
    literals_seen: set[Node] = set()  # tensors the trace made (get_attr), not the module's live state
    outputs: list[Arg] = []
    written: list[tuple[Arg, Node]] = []  # (new value, the input it is copied into)
    names: set[str] = set()

    def fresh(name: str) -> str:
        base, i = name, 1
        while name in names:
            name, i = f"{base}_{i}", i + 1
        names.add(name)
        return name

    def lookup(a: Any) -> Arg:
        if isinstance(a, torch.fx.Node):
            return env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(lookup(x) for x in a)
        if isinstance(a, torch.SymInt | torch.SymFloat | torch.SymBool):
            raise UnsupportedGraph("dynamic shapes are not supported: the graph holds a symbolic size")
        return a

    for fx_node in gm.graph.nodes:
        if fx_node.op == "placeholder":
            node = _tensor_node(fresh(fx_node.name), "input", OpKind.INPUT, None, (), {}, fx_node)
            nodes.append(node)
            env[fx_node] = node
            if fx_node.name in bound:
                constants[node] = bound[fx_node.name]
                if fx_node.name in literals:
                    literals_seen.add(node)
            else:
                inputs.append(node)
        elif fx_node.op == "get_attr":
            value = _fetch_attr(gm, str(fx_node.target))
            if not isinstance(value, torch.Tensor):
                env[fx_node] = value
                continue
            node = Node(fresh(fx_node.name), "input", OpKind.INPUT, None, shape=tuple(value.shape),
                        dtype=value.dtype, strides=tuple(value.stride()))
            nodes.append(node)
            constants[node] = value
            literals_seen.add(node)
            env[fx_node] = node
        elif fx_node.op == "call_function":
            target = fx_node.target
            qual = str(target)
            if qual in _DROPPED:
                continue
            args, kwargs = lookup(fx_node.args), {k: lookup(v) for k, v in fx_node.kwargs.items()}
            if target is aten._to_copy.default:
                kwargs = _same_device_copy(fx_node, kwargs)
            if target is aten.copy_.default and isinstance(fx_node.args[0], torch.fx.Node) \
                    and fx_node.args[0].op == "placeholder":
                # an in-place update of an input (AOTAutograd keeps inference mutations in the graph):
                # written back at the end of the call, after every kernel that reads the old value
                if not (isinstance(args[1], Node) and _same_meta(args[0], args[1])):
                    raise UnsupportedGraph(f"{fx_node.name} copies into input {fx_node.args[0].name} with a "
                                           "broadcast or a dtype conversion")
                written.append((args[1], args[0]))
                env[fx_node] = args[1]
                continue
            if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
                # the graph is taken to have no side effects (_live drops what no output reads): a
                # write that functionalization left would vanish, and the result be silently wrong
                raise UnsupportedGraph(f"{fx_node.name} ({qual}) writes into one of its arguments in place")
            if target is aten.copy.default and isinstance(args[1], Node) and args[1].kind is not OpKind.INPUT \
                    and _same_meta(args[0], args[1]):
                # functional copy(dst, src) of the same shape and dtype is src's values: no copy kernel
                # (`buf.copy_(expr)` functionalizes to copy_(buf, copy(buf, expr)))
                env[fx_node] = args[1]
                continue
            if target is operator.getitem and isinstance(args[0], (tuple, list)):
                env[fx_node] = args[0][args[1]]  # a result of an op the converter lowered itself
                continue
            if target is operator.getitem:
                node = _tensor_node(fresh(fx_node.name), "getitem", OpKind.GETITEM, operator.getitem,
                                    args, kwargs, fx_node)
            elif isinstance(target, torch._ops.OpOverload):
                lowering = LOWERINGS.get(target)
                if lowering is not None:
                    val = fx_node.meta["val"]
                    used = frozenset(u.args[1] for u in fx_node.users if u.target is operator.getitem)
                    lowered = lowering(_Builder(fresh, nodes, used), target, args, kwargs, val)
                    if lowered is not None:
                        env[fx_node] = lowered
                        continue
                kind = refine_kind(qual, kind_of(qual), args, kwargs)
                node = _tensor_node(fresh(fx_node.name), qual, kind, target, args, kwargs, fx_node)
            else:
                node = _tensor_node(fresh(fx_node.name), getattr(target, "__name__", qual), OpKind.OPAQUE,
                                    target, args, kwargs, fx_node)
            nodes.append(node)
            env[fx_node] = node
        elif fx_node.op == "output":
            (result,) = fx_node.args
            flat = result if isinstance(result, (list, tuple)) else [result]
            outputs = [lookup(r) for r in flat]
        else:
            raise UnsupportedGraph(f"fx node kind {fx_node.op!r} ({fx_node.name}) is not supported")

    source_ops = sum(1 for n in gm.graph.nodes if n.op == "call_function"
                     and n.target is not operator.getitem and str(n.target) not in _DROPPED)
    if len({id(dst) for _, dst in written}) != len(written):
        raise UnsupportedGraph("an input is written in place more than once")
    writebacks = [(len(outputs) + k, dst) for k, (_, dst) in enumerate(written)]
    outputs = outputs + [src for src, _ in written]
    nodes = _live(nodes, outputs)
    graph = Graph(nodes=nodes, inputs=inputs, outputs=outputs, constants=constants, snapshots=literals_seen,
                  source_ops=source_ops, writebacks=writebacks)
    graph.validate()
    return graph


def _same_device_copy(fx_node: torch.fx.Node, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`_to_copy`'s keywords without a `device` that is its input's own device (and the default layout
    and pinning that come with it): AOTAutograd's backward graphs name the device where they convert
    (the backward of `.to(dtype)`; GPT-2's backward reading dropout's saved bool masks as float32:
    `_to_copy(mask, dtype=float32, layout=strided, device=cuda:0)`, four per layer). That is a dtype
    conversion, not a move, and fuses like one (ir/ops.refine_kind keeps real moves in ATen)."""
    src = fx_node.args[0].meta.get("val") if fx_node.args and isinstance(fx_node.args[0], torch.fx.Node) else None
    out = fx_node.meta.get("val")
    device = kwargs.get("device")
    if device is None or not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor) \
            or torch.device(device) != src.device or out.device != src.device:
        return kwargs
    if kwargs.get("layout") not in (None, torch.strided) or kwargs.get("pin_memory"):
        return kwargs
    return {k: v for k, v in kwargs.items() if k not in ("device", "layout", "pin_memory")}


def _same_meta(dst: Any, src: Node) -> bool:
    """copy_(dst, src) is a plain overwrite: same shape and dtype (no broadcast or conversion)."""
    return isinstance(dst, Node) and dst.shape == src.shape and dst.dtype == src.dtype


def _live(nodes: list[Node], outputs: list[Arg]) -> list[Node]:
    """`nodes` without those no output depends on (placeholders stay): what a lowering leaves
    unused, such as the empty tensor bernoulli's shape came from (the graph has no side effects)."""
    live: set[int] = set()
    stack = list(iter_nodes(outputs))
    while stack:
        node = stack.pop()
        if id(node) not in live:
            live.add(id(node))
            stack.extend(node.input_nodes())
    return [n for n in nodes if id(n) in live or n.kind is OpKind.INPUT]


def _tensor_node(name: str, op: str, kind: OpKind, target: Any, args: tuple, kwargs: dict,
                 fx_node: torch.fx.Node) -> Node:
    val = fx_node.meta.get("val")
    meta = _meta(val) if isinstance(val, torch.Tensor) else {}
    if isinstance(val, torch.Tensor) and any(not isinstance(s, int) for s in val.shape):
        raise UnsupportedGraph(f"dynamic shapes are not supported ({fx_node.name} has shape {tuple(val.shape)})")
    multi_view = kind is OpKind.VIEW and op.rsplit(".", 1)[0] in MULTI_VIEWS
    if not isinstance(val, torch.Tensor) and kind not in (OpKind.OPAQUE, OpKind.GETITEM, OpKind.INPUT) \
            and not multi_view:
        kind = OpKind.OPAQUE  # a fusible op name with a non-tensor result (e.g. a tuple): run it in ATen
    return Node(name, op, kind, target, tuple(args), dict(kwargs), **meta)


def _meta(val: torch.Tensor) -> dict[str, Any]:
    return {"shape": tuple(int(s) for s in val.shape), "dtype": val.dtype,
            "strides": tuple(int(s) for s in val.stride())}


def _fetch_attr(gm: torch.fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
