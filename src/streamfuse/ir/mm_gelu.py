"""A tanh-approximated GELU after a Linear layer, added by cuBLASLt in its GEMM epilogue.

GPT-2 and the models built like it apply GELU's tanh approximation to the first product of every
MLP, and the second product reads the result: with the product on cuBLAS, the activation is a
kernel of its own over the [tokens, 4 x hidden] product (a launch and a round trip through memory
per layer). ATen's `_addmm_activation(bias, a, b, use_gelu=True)` computes the same function on
CUDA with cuBLASLt's GELU epilogue (PyTorch's tests hold it to `gelu(addmm(...), approximate="tanh")`
within float32's default tolerance):

    gelu_tanh(view(addmm(bias, a, b), shape))  ->  view(_addmm_activation(bias, a, b, use_gelu=True), shape)

CUDA only: on the CPU, `_addmm_activation` applies the exact (erf) GELU, another function.

The activation is recognised by what it computes, not by how it is spelled (`F.gelu(x,
approximate="tanh")`, Hugging Face's `0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))`, or
`x * sigmoid(...)`): the pointwise ops that read only the product and numbers, ending in one node
that alone is read from outside, are evaluated in float64 on points over [-12, 12] and must equal
the tanh approximation there to 1e-9. The exact GELU differs by up to 4e-4 and is left alone.
"""

from __future__ import annotations

import math

import torch

from streamfuse.ir.fold import fresh_name, splice
from streamfuse.ir.graph import Graph, Node
from streamfuse.ir.lowerings import Builder
from streamfuse.ir.ops import OpKind

_ADDMM = "aten.addmm.default"
_VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TOLERANCE = 1e-9


def gelu_into_addmm(graph: Graph, candidates: list[Node]) -> int:
    """Rewrite each addmm of `candidates` that a tanh GELU alone reads (module docstring), in place;
    returns how many. The caller passes the addmm nodes that run through cuBLAS anyway."""
    names = {n.name for n in graph.nodes}
    outputs = set(graph.output_nodes)
    build = Builder(fresh=lambda name: fresh_name(name, names), nodes=[])
    done = 0
    for addmm in candidates:
        match = _match(addmm, outputs)
        if match is None:
            continue
        view, cone, result = match
        bias, a, b = addmm.args
        build.nodes = []
        fused = build.add(f"{addmm.name}_gelu", torch.ops.aten._addmm_activation.default, (bias, a, b),
                          {"use_gelu": True}, shape=addmm.shape, dtype=addmm.dtype)
        back = fused if view is None else build.add(f"{result.name}_view", torch.ops.aten.view.default,
                                                    (fused, list(result.shape)), shape=result.shape,
                                                    dtype=result.dtype)
        dropped = tuple(n for n in (addmm, view, *cone) if n is not None and n is not result)
        splice(graph, result, build.nodes, back, dropped)
        done += 1
    if done:
        graph.link_users()
        graph.notes.append(f"{done} tanh GELU(s) added by cuBLASLt in the product's epilogue "
                           "(_addmm_activation; Config.addmm_gelu_epilogue)")
    return done


def _match(addmm: Node, outputs: set[Node]) -> tuple[Node | None, list[Node], Node] | None:
    """(the view between product and activation or None, the activation's nodes, its result)."""
    if addmm.op != _ADDMM or addmm.kwargs or len(addmm.args) != 3 or addmm.dtype not in _DTYPES:
        return None
    bias, a, b = addmm.args
    if not all(isinstance(t, Node) and t.dtype == addmm.dtype for t in (bias, a, b)):
        return None
    if len(addmm.shape) != 2 or bias.shape != (addmm.shape[1],) or addmm in outputs:
        return None
    x, view = addmm, None
    if len(addmm.users) == 1 and addmm.users[0].op in _VIEWS:
        view = x = addmm.users[0]
        if x in outputs:
            return None
    elif any(u.op in _VIEWS for u in addmm.users):
        return None
    cone = _cone(x)
    if not cone:
        return None
    inside = set(cone)
    if any(u not in inside for u in x.users):
        return None
    leaving = [n for n in cone if n in outputs or any(u not in inside for u in n.users)]
    if len(leaving) != 1:
        return None
    result = leaving[0]
    if result.shape != x.shape or result.dtype != addmm.dtype or not _is_tanh_gelu(x, cone, result):
        return None
    return view, cone, result


def _cone(x: Node) -> list[Node]:
    """The pointwise nodes computed from `x` and numbers alone, in graph order."""
    inside: set[Node] = {x}
    order: list[Node] = []
    frontier = list(x.users)
    while frontier:
        node = frontier.pop(0)
        if node in inside or node.kind is not OpKind.POINTWISE or node.target is None:
            continue
        values = [*node.args, *node.kwargs.values()]
        if not all(v in inside if isinstance(v, Node) else isinstance(v, (int, float, bool, str)) or v is None
                   for v in values):
            continue
        inside.add(node)
        order.append(node)
        frontier += node.users
    return order


def _is_tanh_gelu(x: Node, cone: list[Node], result: Node) -> bool:
    """The cone evaluated in float64 equals 0.5 t (1 + tanh(sqrt(2/pi) (t + 0.044715 t^3)))."""
    t = torch.linspace(-12.0, 12.0, 4801, dtype=torch.float64)
    values: dict[Node, torch.Tensor] = {x: t}
    try:
        for node in cone:
            args = tuple(values[a] if isinstance(a, Node) else a for a in node.args)
            kwargs = {k: values[v] if isinstance(v, Node) else v for k, v in node.kwargs.items()}
            out = node.target(*args, **kwargs)
            if not isinstance(out, torch.Tensor) or out.dtype != torch.float64 or out.shape != t.shape:
                return False
            values[node] = out
    except (RuntimeError, TypeError, ValueError):
        return False
    expected = 0.5 * t * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (t + 0.044715 * t**3)))
    got = values[result]
    return bool(torch.isfinite(got).all()) and float((got - expected).abs().max()) <= _TOLERANCE
