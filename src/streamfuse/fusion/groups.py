"""What the fusion planner produces: groups of nodes (each one kernel or ATen call) and reasons."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from streamfuse.ir.graph import Graph, Node
from streamfuse.ir.ops import OpKind


class GroupKind(enum.Enum):
    POINTWISE = "pointwise"
    """A generated kernel over one iteration shape."""
    REDUCTION = "reduction"
    """A generated kernel over rows x reduced extent, with prologue and epilogue."""
    MATMUL = "matmul"
    """A Triton matmul template (mm / addmm) with its pointwise epilogue fused into the tile's store."""
    HORIZONTAL = "horizontal"
    """Independent small pointwise groups packed into one launch (program-id ranges pick the part)."""
    ATEN = "aten"
    """One op run through ATen (opaque, contraction, or a refused reduction): one launch."""
    ALIAS = "alias"
    """A view or getitem run through ATen: zero-copy, no launch."""

    @property
    def generated(self) -> bool:
        return self in (GroupKind.POINTWISE, GroupKind.REDUCTION, GroupKind.HORIZONTAL, GroupKind.MATMUL)


@dataclass(frozen=True)
class ReductionDomain:
    """The rows x columns space of a reduction kernel: `shape` is the reduced input's shape,
    `dims` the reduced dimensions (sorted, non-negative)."""

    shape: tuple[int, ...]
    dims: tuple[int, ...]

    @property
    def outer_shape(self) -> tuple[int, ...]:
        return tuple(s for d, s in enumerate(self.shape) if d not in self.dims)

    @property
    def reduce_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[d] for d in self.dims)

    @property
    def keepdim_shape(self) -> tuple[int, ...]:
        return tuple(1 if d in self.dims else s for d, s in enumerate(self.shape))

    @property
    def rows(self) -> int:
        return math.prod(self.outer_shape)

    @property
    def row_size(self) -> int:
        return math.prod(self.reduce_shape)


@dataclass
class Group:
    id: int
    kind: GroupKind
    nodes: list[Node]
    """Members in topological order."""
    inputs: list[Node] = field(default_factory=list)
    """Tensors read from outside the group (graph inputs, constants, other groups' results)."""
    outputs: list[Node] = field(default_factory=list)
    """Members whose value is needed outside the group (by another group or as a graph output)."""
    shape: tuple[int, ...] = ()
    """POINTWISE: the iteration shape (every output has it)."""
    domain: ReductionDomain | None = None
    """REDUCTION: the rows x columns space."""
    split: int = 1
    """Divides each thread's elements in the launch geometry (fusion/geometry.py): the planner's
    remedy for a fusion that would otherwise lose occupancy."""
    contraction: Node | None = None
    """MATMUL: the mm / addmm node whose accumulator the epilogue reads."""
    note: str = ""
    """Why an ATEN group was not generated, when it could have been; for MATMUL, the cost-model choice."""
    parts: list[Group] = field(default_factory=list)
    """HORIZONTAL: the packed pointwise groups, in launch-range order."""
    walk: tuple[int, ...] | None = None
    """POINTWISE: the order the kernel walks its domain in, outermost dim first, where that is not
    row-major: ir.indexing.CHANNELS_LAST_ORDER for a kernel the network layout has store a result
    channels_last (tune/network_layout.py), so its stores stay coalesced. Every output of a
    POINTWISE group has the domain's shape, so the walk covers each of them."""
    rows_contiguous: bool = False
    """REDUCTION: the rows lie next to each other in memory (a mean over H and W of a channels_last
    tensor), so the kernel puts its threads along the rows and loops over each row
    (fusion/geometry.rows_contiguous_launch; set by tune/network_layout.py)."""

    @property
    def name(self) -> str:
        if self.kind is GroupKind.HORIZONTAL:
            return f"k{self.id}_horizontal_x{len(self.parts)}"
        ops = [n.op.split(".")[1] for n in self.nodes if n.op.startswith(("aten.", "streamfuse."))]
        head = "_".join(dict.fromkeys(ops))[:40] or self.nodes[0].op
        return f"k{self.id}_{head}"

    @property
    def launches(self) -> int:
        return 0 if self.kind is GroupKind.ALIAS else 1


@dataclass(frozen=True)
class Refusal:
    producer: Node
    consumer: Node
    reason: str

    def __str__(self) -> str:
        return f"%{self.producer.name} -> %{self.consumer.name}: {self.reason}"


@dataclass
class Plan:
    graph: Graph
    groups: list[Group]
    """In an order that respects every dependency."""
    refusals: list[Refusal]
    merges: int
    """How many producer->consumer merges the planner made."""
    matmul_choices: dict[Node, Any] = field(default_factory=dict)
    """Contraction -> fusion.strategy.MatmulChoice: how it runs, with the predicted or measured times."""

    def group_of(self) -> dict[Node, Group]:
        return {n: g for g in self.groups for n in g.nodes}


def read_bytes(inp: Node, nodes: Iterable[Node]) -> float:
    """Bytes a kernel of `nodes` reads of its input `inp`: all of it, except a table that only
    embedding lookups read, of which at most the rows looked up are (a GPT-2 decode step reads one
    row of its 154 MB token table)."""
    readers = [n for n in nodes if inp in n.input_nodes()]
    if readers and all(n.kind is OpKind.GATHER and n.args[0] is inp and inp not in n.args[1:] for n in readers):
        return float(min(inp.numel, sum(n.numel for n in readers)) * inp.itemsize)
    return float(inp.numel * inp.itemsize)
