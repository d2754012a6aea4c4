"""Fusion legality: may these nodes share one generated kernel? Returns the kernel's shape or a reason.

Correctness rules only; what is *profitable* is the planner's business (ARCHITECTURE.md keeps
legality apart from heuristics). The rules, for v1:

- every member is pointwise, broadcast, view, cat or reduction, in a supported dtype;
- without a reduction, every value leaving the kernel has one shape (the iteration shape);
- with reductions, all reduce the same dims of the same shape (one rows x columns domain); a
  value computed from a reduced value is either a full row tile (the domain's shape) or one
  value per row (keepdim or squeezed shape), so that each program owns whole rows;
- a cat reads each input at its offset along the cat dim, and max pooling reads a window around
  its position, so both take values computed at any index, but not values derived from a
  reduction in the same kernel;
- an embedding lookup reads its table from memory (not computed in the kernel) at a loaded index,
  so like a cat it takes indices computed anywhere but no values derived from a reduction;
- views and expands are never written out by a kernel: they stay zero-copy aliases;
- with a contraction (mm / addmm, when the cost model picked the Triton template): one per kernel,
  its operands read from outside (no prologue), and every value derived from it has the [M, N]
  tile's shape or a reshape of it that keeps the last dim N, so each program stores whole tiles.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from streamfuse.config import Config
from streamfuse.fusion.geometry import LOOPED_REDUCTIONS, long_rows, one_pass
from streamfuse.fusion.groups import GroupKind, ReductionDomain
from streamfuse.ir.graph import Node
from streamfuse.ir.indexing import concat_parts, permutation, squeeze_equal
from streamfuse.ir.ops import OpKind, packet_name

FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
GENERATED_REDUCTIONS = frozenset(
    {"aten.sum.dim_IntList", "aten.mean.dim", "aten.amax.default", "aten.amin.default", "aten.var.correction"}
)
KERNEL_DTYPES = FLOAT_DTYPES | {torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64}


@dataclass(frozen=True)
class KernelShape:
    kind: GroupKind
    inputs: tuple[Node, ...]
    outputs: tuple[Node, ...]
    shape: tuple[int, ...] = ()
    domain: ReductionDomain | None = None
    contraction: Node | None = None


def reduction_domain(node: Node) -> ReductionDomain:
    x = node.args[0]
    assert isinstance(x, Node)
    rank = len(x.shape)
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    norm = sorted({d + rank if d < 0 else d for d in dims}) if rank else []
    return ReductionDomain(shape=tuple(x.shape), dims=tuple(norm))


def node_refusal(node: Node, config: Config) -> str | None:
    """Why this single node cannot be in a generated kernel, or None if it can."""
    if node.kind is OpKind.CONTRACTION:
        return matmul_refusal(node)
    if node.kind is OpKind.GETITEM:
        return "getitem selects a result of a multi-output op: host-side, no kernel"
    if not node.kind.fusible:
        return f"{node.op} is opaque: it runs through ATen"
    if not node.is_tensor:
        return f"{node.op} has several results: it runs on the host as zero-copy views"
    if node.dtype not in KERNEL_DTYPES:
        return f"dtype {node.dtype} is not generated"
    for a in node.input_nodes():
        if a.dtype not in KERNEL_DTYPES:
            return f"input %{a.name} has dtype {a.dtype}, which is not generated"
    if node.kind is OpKind.CONCAT:
        tensors, _ = concat_parts(node)
        if not all(isinstance(t, Node) and len(t.shape) == len(node.shape) and t.numel > 0 for t in tensors):
            return "cat with an empty or lower-rank input runs through ATen"
    if node.kind is OpKind.WINDOW:
        x = node.args[0]
        if not (isinstance(x, Node) and len(x.shape) in (3, 4) and node.dtype in FLOAT_DTYPES):
            return "pooling of an integer or non-3/4-D tensor runs through ATen"
    if node.kind is OpKind.GATHER:
        table, ids = (node.args + (None, None))[:2]
        if not (isinstance(table, Node) and isinstance(ids, Node) and len(table.shape) == 2
                and table.dtype in FLOAT_DTYPES and node.dtype == table.dtype
                and ids.dtype in (torch.int32, torch.int64) and table.numel > 0):
            return "an embedding other than a float 2-D table at int32/int64 indices runs through ATen"
    if node.kind is OpKind.REDUCTION:
        if node.op not in GENERATED_REDUCTIONS:
            return f"reduction overload {node.op} is not generated"
        x = node.args[0]
        assert isinstance(x, Node)
        if x.dtype not in FLOAT_DTYPES or node.dtype not in FLOAT_DTYPES:
            return f"integer/bool reduction ({x.dtype} -> {node.dtype}) runs through ATen"
        dom = reduction_domain(node)
        if dom.rows * dom.row_size <= 1:
            # a copy of one element: its row tile would be a scalar load and store, which the reduction
            # template does not shape (x[1].sum(0) failed to compile: found by tests/test_fuzz.py)
            return "a reduction over a single element runs through ATen"
        if long_rows(dom, config) and not (config.long_row_reduction and packet_name(node.op) in LOOPED_REDUCTIONS):
            return (f"reduced extent {dom.row_size} exceeds max_persistent_reduction="
                    f"{config.max_persistent_reduction} and only a sum, mean, amax or amin loops over longer rows"
                    + ("" if config.long_row_reduction else " (long_row_reduction=False)"))
        if packet_name(node.op) in ("sum", "mean") and node.kwargs.get("dtype") not in (None, node.dtype):
            return "reduction with a dtype argument that differs from its result runs through ATen"
    return None


def check_group(nodes: list[Node], graph_outputs: set[Node], config: Config) -> KernelShape | str:
    """KernelShape if `nodes` (topologically ordered) can be one generated kernel, else the reason."""
    members = set(nodes)
    outputs = tuple(n for n in nodes if n in graph_outputs or any(u not in members for u in n.users))
    inputs = tuple(_external_inputs(nodes, members))
    if len(nodes) > config.max_ops_per_kernel:
        return f"{len(nodes)} ops exceed max_ops_per_kernel={config.max_ops_per_kernel}"
    if len(inputs) + len(outputs) > config.max_kernel_args:
        return f"{len(inputs) + len(outputs)} tensor arguments exceed max_kernel_args={config.max_kernel_args}"
    for n in nodes:
        reason = node_refusal(n, config)
        if reason is not None:
            return f"%{n.name}: {reason}"
    if all(n.kind in (OpKind.VIEW, OpKind.BROADCAST) for n in nodes):
        return "views alone need no kernel: they run as zero-copy aliases"
    for n in outputs:
        if n.kind in (OpKind.VIEW, OpKind.BROADCAST):
            return f"view %{n.name} ({n.op}) is also needed outside the kernel: it stays a zero-copy alias"
    for n in nodes:
        if n.kind is OpKind.GATHER and n.args[0] in members:
            return f"%{n.name} ({n.op}) reads its table from memory: the table's producer is not fused into it"
    if not outputs:
        return "the group computes nothing that is used"

    contractions = [n for n in nodes if n.kind is OpKind.CONTRACTION]
    if contractions:
        return _check_matmul(nodes, members, inputs, outputs, contractions)
    reductions = [n for n in nodes if n.kind is OpKind.REDUCTION]
    if not reductions:
        shapes = sorted({n.shape for n in outputs})
        if len(shapes) > 1:
            return f"outputs have different shapes {shapes}: one kernel writes one iteration shape"
        return KernelShape(GroupKind.POINTWISE, inputs, outputs, shape=shapes[0])

    domains = {reduction_domain(r) for r in reductions}
    if len(domains) > 1:
        desc = ", ".join(f"{list(d.shape)} over dims {list(d.dims)}" for d in sorted(domains, key=str))
        return f"reductions over different domains ({desc}): one reduction domain per kernel"
    (dom,) = domains
    reason = _check_reduction_levels(nodes, members, outputs, dom)
    if reason is not None:
        return reason
    if long_rows(dom, config) and not one_pass(nodes, outputs, dom):
        return (f"rows of {dom.row_size} elements (over max_persistent_reduction={config.max_persistent_reduction}) "
                "loop in one pass: no value of the kernel may need one of its reductions first")
    return KernelShape(GroupKind.REDUCTION, inputs, outputs, domain=dom)


def _check_reduction_levels(nodes: list[Node], members: set[Node], outputs: Iterable[Node],
                            dom: ReductionDomain) -> str | None:
    """Each program of a reduction kernel owns whole rows: values derived from a reduced value
    must be a full row tile or one value per row, and must not move rows around."""
    full, per_row = dom.shape, (dom.keepdim_shape, dom.outer_shape)
    level: dict[Node, str] = {}  # "full" | "row" for members that depend on a reduction
    for n in nodes:
        if n.kind is OpKind.REDUCTION:
            level[n] = "row"
            continue
        deps = [a for a in n.input_nodes() if a in members and a in level]
        if not deps:
            continue  # computed from loads alone: a pure function of its index, valid anywhere
        if n.kind.gathers:
            return (f"%{n.name} ({n.op}) reads values derived from a reduction at other positions (rows would "
                    "move between programs)")
        if n.shape == full:
            level[n] = "full"
        elif n.shape in per_row:
            level[n] = "row"
        else:
            return (f"%{n.name} has shape {list(n.shape)}, derived from a reduced value but neither the row "
                    f"tile {list(full)} nor one value per row {list(dom.keepdim_shape)}")
        if n.kind is OpKind.VIEW and not _keeps_element_order(n):
            # the kernel indexes values derived from a reduction by shape alone: a transpose of a
            # square result has the same shape and other elements (random-program fuzz, session 41:
            # `b + a.sum(0).permute(1, 0, 2)` with dims of equal size was wrong)
            return f"view %{n.name} ({n.op}) rearranges a value derived from a reduction"
        for a in deps:
            if level[n] == "full" and level[a] == "row" and a.shape != dom.keepdim_shape:
                return (f"%{n.name} broadcasts reduced value %{a.name} of shape {list(a.shape)} over rows "
                        f"(only the keepdim shape {list(dom.keepdim_shape)} keeps each row in one program)")
            if level[n] == "row" and level[a] == "row" and not squeeze_equal(a.shape, n.shape):
                return f"%{n.name} reshapes per-row value %{a.name} across rows"
            if level[n] == "row" and level[a] == "full":
                return f"%{n.name} turns row tile %{a.name} into a per-row value without a reduction"
        if n.kind in (OpKind.VIEW, OpKind.BROADCAST) and level[n] == "full" and n.shape != n.args[0].shape \
                and not (level.get(n.args[0]) == "row" and n.args[0].shape == dom.keepdim_shape):
            return f"view %{n.name} rearranges a value derived from a reduction"
    for n in outputs:
        if n.shape != full and n.shape not in per_row:
            return (f"output %{n.name} has shape {list(n.shape)}: a reduction kernel writes row tiles "
                    f"{list(full)} or per-row values {list(dom.keepdim_shape)}")
    return None


_RESHAPES = frozenset({"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "alias", "expand"})
"""Views that keep the row-major order of their source's elements (expand repeats them; where it
broadcasts a per-row value over rows, the level rules judge it)."""


def _keeps_element_order(n: Node) -> bool:
    """A view whose elements, read in row-major order, are its source's in the same order: a
    reshape, or a permutation that moves only dims of size 1."""
    name = packet_name(n.op)
    if name in _RESHAPES:
        return True
    if name not in ("permute", "transpose", "t"):
        return False
    src = n.args[0]
    assert isinstance(src, Node)
    moved = [d for d in permutation(n) if src.shape[d] != 1]
    return moved == sorted(moved)


MATMUL_OPS = frozenset({"aten.mm.default", "aten.addmm.default", "aten.bmm.default"})
MATMUL_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})


def matmul_refusal(node: Node) -> str | None:
    """Why this contraction cannot be the Triton matmul template, or None if it can."""
    if node.op not in MATMUL_OPS:
        return f"{node.op} runs through ATen (cuBLAS/cuDNN): only mm and addmm have a Triton template"
    a, b = matmul_operands(node)
    rank = 3 if node.op == "aten.bmm.default" else 2
    if not (isinstance(a, Node) and isinstance(b, Node)) or len(a.shape) != rank or len(b.shape) != rank:
        return f"{node.op} with operands of unexpected rank runs through ATen"
    if not (a.dtype == b.dtype == node.dtype and node.dtype in MATMUL_DTYPES):
        return f"{node.op} in {a.dtype} x {b.dtype} -> {node.dtype} runs through ATen (template: fp16, bf16, fp32)"
    if node.op == "aten.addmm.default" and not isinstance(node.args[0], Node):
        return "addmm with a scalar input runs through ATen"
    return None


def matmul_operands(node: Node) -> tuple[Node, Node]:
    """(A, B) of an mm, addmm or bmm node: the product is A @ B (batched for bmm)."""
    a, b = node.args[-2:] if node.op == "aten.addmm.default" else node.args[:2]
    return a, b  # type: ignore[return-value]


def matmul_dims(node: Node) -> tuple[int, int, int, int]:
    """(batch, M, N, K) of an mm / addmm (batch 1) or bmm node."""
    a, b = matmul_operands(node)
    batch = a.shape[0] if len(a.shape) == 3 else 1
    return batch, a.shape[-2], b.shape[-1], a.shape[-1]


def tile_core(shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    """`shape` without the trailing dims of size one after a last dim of n (a product viewed back to
    [N, S, 1, 1]: ir/conv_mm.py), which leave every element where the row-major tile has it. The
    matmul template indexes a tile-shaped output through this core (codegen/matmul._index_in)."""
    while len(shape) > 2 and shape[-1] == 1 and n != 1:
        shape = shape[:-1]
    return shape


def is_tile_shape(shape: tuple[int, ...], m: int, n: int) -> bool:
    """The [m, n] tile, or a reshape of it that keeps the last dim (e.g. [B, T, n] with B*T = m), with
    any trailing dims of size one (tile_core)."""
    core = tile_core(shape, n)
    return len(core) >= 1 and core[-1] == n and math.prod(core[:-1]) == m


def _check_matmul(nodes: list[Node], members: set[Node], inputs: tuple[Node, ...], outputs: tuple[Node, ...],
                  contractions: list[Node]) -> KernelShape | str:
    if len(contractions) > 1:
        return "two contractions in one kernel: the matmul template computes one product"
    mm = contractions[0]
    inside = [a for a in mm.input_nodes() if a in members]
    if inside:
        return (f"%{mm.name} reads %{inside[0].name}, computed in the same kernel: prologue fusion into the "
                "matmul template is not generated")
    gathering = [n for n in nodes if n.kind.gathers]
    if gathering:
        return f"a {gathering[0].op.split('.')[1]} in a matmul epilogue is not generated"
    if any(n.kind is OpKind.REDUCTION for n in nodes):
        return "a reduction in a matmul epilogue is not generated (the tile holds only part of a row)"
    n_cols = mm.shape[-1]
    m = mm.numel // n_cols  # rows of the product, batches stacked (bmm)
    dependent = {mm}
    for n in nodes:
        deps = [a for a in n.input_nodes() if a in dependent]
        if n is mm or not deps:
            continue
        dependent.add(n)
        if not is_tile_shape(n.shape, m, n_cols):
            return (f"%{n.name} has shape {list(n.shape)}: a matmul epilogue keeps the [{m}, {n_cols}] tile "
                    "(or a reshape of it with the same last dim)")
        if n.kind is OpKind.VIEW and packet_name(n.op) not in ("view", "_unsafe_view", "reshape"):
            return f"%{n.name} ({n.op}) rearranges the matmul result: the epilogue stores tiles in place"
        for a in deps:
            if a.shape != n.shape and n.kind is not OpKind.VIEW:
                return f"%{n.name} broadcasts %{a.name}, derived from the matmul, across tiles"
    for o in outputs:
        if not is_tile_shape(o.shape, m, n_cols):
            return f"output %{o.name} of shape {list(o.shape)} is not the matmul tile [{m}, {n_cols}]"
    return KernelShape(GroupKind.MATMUL, inputs, outputs, shape=tuple(mm.shape), contraction=mm)


def _external_inputs(nodes: list[Node], members: set[Node]) -> list[Node]:
    seen: dict[Node, None] = {}
    for n in nodes:
        for a in n.input_nodes():
            if a not in members and a.is_tensor:
                seen.setdefault(a, None)
    return list(seen)
