"""The graph IR: an explicit DAG of Nodes in topological order.

A Node is one aten op (or a graph input). It records the op, its fusion kind, its
arguments (other Nodes or Python constants, possibly nested in lists), and the meta of its
result: shape, dtype, strides. Ops with several results are followed by `getitem` Nodes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from streamfuse.ir.ops import OpKind

Arg = Any  # Node | int | float | bool | None | torch.dtype | list[Arg] | tuple[Arg, ...]


@dataclass(eq=False)
class Node:
    name: str
    op: str
    """Qualified op name ("aten.add.Tensor"), "input" for graph inputs, "getitem"."""
    kind: OpKind
    target: Any
    """The callable (a torch OpOverload, or operator.getitem); None for inputs."""
    args: tuple[Arg, ...] = ()
    kwargs: dict[str, Arg] = field(default_factory=dict)
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    """None for a node whose result is a tuple (read through getitem nodes) or not a tensor."""
    strides: tuple[int, ...] = ()
    users: list[Node] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize if self.dtype is not None else 0

    def input_nodes(self) -> list[Node]:
        """Distinct Node arguments, in order of first appearance."""
        seen: list[Node] = []
        for group in (self.args, self.kwargs.values()):
            for a in group:  # most arguments are Nodes or scalars: no generator for them
                if isinstance(a, Node):
                    if a not in seen:
                        seen.append(a)
                elif isinstance(a, (list, tuple, dict)):
                    for b in iter_nodes(a):
                        if b not in seen:
                            seen.append(b)
        return seen

    def __repr__(self) -> str:
        dt = str(self.dtype).replace("torch.", "") if self.dtype else "-"
        return f"%{self.name}:{dt}{list(self.shape)}={self.op}"


def iter_nodes(value: Arg) -> Iterator[Node]:
    if isinstance(value, Node):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from iter_nodes(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from iter_nodes(v)


def map_args(value: Arg, fn: Any) -> Arg:
    """Replace every Node inside `value` (lists and tuples too) by fn(node)."""
    if isinstance(value, Node):
        return fn(value)
    if isinstance(value, list):
        return [map_args(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(map_args(v, fn) for v in value)
    return value


@dataclass
class Graph:
    nodes: list[Node]
    """All nodes, inputs first, in a topological order."""
    inputs: list[Node]
    outputs: list[Arg]
    """Flat list of results: Nodes, or constants/None for non-tensor results."""
    constants: dict[Node, torch.Tensor] = field(default_factory=dict)
    """Nodes whose value is fixed at compile time: parameters, buffers, lifted constants, and
    views of those that the runtime takes once."""
    snapshots: set[Node] = field(default_factory=set)
    """Constants computed at compile time (folded weights): the compiled graph owns them, so no
    caller changes them in place and derived copies of them (another memory layout) stay valid."""
    source_ops: int = 0
    """aten ops in the captured graph (before streamfuse's own lowerings; getitem excluded)."""
    writebacks: list[tuple[int, Node]] = field(default_factory=list)
    """(output index, input or constant node): outputs whose values are copied into that input's
    memory at the end of every call (an in-place update the graph received as `copy_` into a
    placeholder: an optimizer's parameters and states, batch-norm running statistics). They are the
    last outputs; callers see only the ones before them (`user_outputs`)."""
    notes: list[str] = field(default_factory=list)
    """Graph rewrites a user should know about (e.g. batch-norm folded into weights), for explain()."""
    padded_outputs: list[int | None] | None = None
    """For a capture at a batch bucket: each output's rows per batch element (None: not sliced), from
    the analysis of the graph as captured, compared with a capture at another batch size
    (ir/batch.py `batch_sized`); None where no comparison was made. The rewrites for the device
    (folded constants) can hide that an output was made with the batch's size."""

    def __post_init__(self) -> None:
        self.link_users()

    def link_users(self) -> None:
        for n in self.nodes:
            n.users = []
        for n in self.nodes:
            for a in n.input_nodes():
                a.users.append(n)

    @property
    def written_inputs(self) -> list[int]:
        """Positions in `inputs` of the inputs a writeback updates (the others update constants)."""
        written = {id(dst) for _, dst in self.writebacks}
        return [i for i, n in enumerate(self.inputs) if id(n) in written]

    @property
    def user_outputs(self) -> int:
        """How many outputs the caller sees (the rest are written back into inputs)."""
        return len(self.outputs) - len(self.writebacks)

    @property
    def output_nodes(self) -> list[Node]:
        return [o for o in self.outputs if isinstance(o, Node)]

    def constant_nodes(self) -> frozenset[Node]:
        """Nodes no kernel writes: the constants, and views of them (a Linear's transposed weight)."""
        fixed = set(self.constants)
        for n in self.nodes:
            inputs = n.input_nodes()
            if n.kind is OpKind.VIEW and inputs and all(a in fixed for a in inputs):
                fixed.add(n)
        return frozenset(fixed)

    def ops(self) -> list[Node]:
        """The nodes that are operations (everything but graph inputs)."""
        return [n for n in self.nodes if n.kind is not OpKind.INPUT]

    def validate(self) -> None:
        """Fail loudly on a non-topological order or a dangling reference."""
        position = {n: i for i, n in enumerate(self.nodes)}
        for i, n in enumerate(self.nodes):
            for a in n.input_nodes():
                if a not in position:
                    raise ValueError(f"node {n!r} reads {a!r}, which is not in the graph")
                if position[a] >= i:
                    raise ValueError(f"graph is not topologically ordered: {n!r} before {a!r}")
        for o in self.output_nodes:
            if o not in position:
                raise ValueError(f"graph output {o!r} is not in the graph")

    def __str__(self) -> str:
        lines = [f"graph({', '.join(repr(i) for i in self.inputs)})"]
        for n in self.ops():
            args = ", ".join(_fmt_arg(a) for a in n.args)
            kw = "".join(f", {k}={_fmt_arg(v)}" for k, v in n.kwargs.items())
            lines.append(f"  {n!r}({args}{kw})  [{n.kind.value}]")
        lines.append(f"  return ({', '.join(_fmt_arg(o) for o in self.outputs)})")
        return "\n".join(lines)


def _fmt_arg(a: Arg) -> str:
    if isinstance(a, Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_fmt_arg(x) for x in a) + "]"
    return repr(a)


def disjoint_union(graphs: list[Graph], prefixes: list[str]) -> Graph:
    """One graph running `graphs` side by side: inputs, outputs and constants concatenated in order.
    Node names get the given prefixes so they stay unique. The graphs' nodes are reused (moved)."""
    nodes: list[Node] = []
    inputs: list[Node] = []
    outputs: list[Arg] = []
    constants: dict[Node, torch.Tensor] = {}
    snapshots: set[Node] = set()
    for g, prefix in zip(graphs, prefixes, strict=True):
        for n in g.nodes:
            n.name = f"{prefix}{n.name}"
        nodes += g.nodes
        inputs += g.inputs
        outputs += g.outputs
        constants.update(g.constants)
        snapshots |= g.snapshots
    return Graph(nodes=nodes, inputs=inputs, outputs=outputs, constants=constants, snapshots=snapshots,
                 source_ops=sum(g.source_ops for g in graphs), notes=[n for g in graphs for n in g.notes])
