"""Human-readable account of a CompiledGraph: each kernel, its ops, every refused fusion."""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamfuse.fusion.groups import Group, GroupKind
from streamfuse.ir.graph import Node

if TYPE_CHECKING:
    from streamfuse.runtime.compiled import CompiledGraph


def _tensor(n: Node) -> str:
    dt = str(n.dtype).replace("torch.", "") if n.dtype else "?"
    return f"%{n.name}:{dt}{list(n.shape)}"


def _describe(g: Group, compiled: CompiledGraph) -> str:
    ops = ", ".join(n.op.removeprefix("aten.") for n in g.nodes)
    if g.kind is GroupKind.POINTWISE:
        src = compiled.sources[g.id]
        head = f"pointwise over {list(g.shape)}, grid {src.grid}, {src.num_warps} warps, {src.constexprs}"
    elif g.kind is GroupKind.REDUCTION:
        src = compiled.sources[g.id]
        assert g.domain is not None
        head = (f"reduction of {g.domain.rows} rows x {g.domain.row_size} over dims {list(g.domain.dims)} of "
                f"{list(g.domain.shape)}, grid {src.grid}, {src.num_warps} warps, {src.constexprs}")
    elif g.kind is GroupKind.ATEN:
        head = f"ATen ({g.note})" if g.note else "ATen"
    else:
        head = "zero-copy alias (no launch)"
    lines = [f"{g.name}  [{g.kind.value}] {head}", f"    ops ({len(g.nodes)}): {ops}"]
    if g.kind.generated:
        lines.append(f"    reads:  {', '.join(_tensor(n) for n in g.inputs) or '-'}")
        lines.append(f"    writes: {', '.join(_tensor(n) for n in g.outputs)}")
    return "\n".join(lines)


def explain_plan(compiled: CompiledGraph, source: bool = True) -> str:
    s = compiled.stats
    plan = compiled.plan
    out = [
        f"streamfuse plan: {s['source_ops']} source ops -> {s['kernels']} kernel launches per call "
        f"({s['generated_kernels']} generated, {s['aten_kernels']} ATen), {plan.merges} merges, "
        f"executor={compiled.executor}, device={compiled.device}",
        "",
        "kernels, in launch order:",
    ]
    out += [_describe(g, compiled) for g in plan.groups]
    out += ["", f"refused fusions ({len(plan.refusals)}):"]
    out += [f"  {r}" for r in plan.refusals] or ["  (none)"]
    if source and compiled.sources:
        out += ["", "generated Triton source:"]
        for g in plan.groups:
            if g.id in compiled.sources:
                out += ["", compiled.sources[g.id].source.rstrip()]
    return "\n".join(out)
