"""Human-readable account of a CompiledGraph: each kernel, its ops, every refused fusion."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from streamfuse.codegen.kernel import memory_order
from streamfuse.fusion.geometry import Resources, branched_inputs, estimate
from streamfuse.fusion.groups import Group, GroupKind
from streamfuse.fusion.legality import matmul_operands
from streamfuse.ir.graph import Node
from streamfuse.ir.ops import OpKind
from streamfuse.runtime.steps import STAND_IN_NOTES, ChannelsLastConvStep, KernelStep
from streamfuse.schedule.cost import estimate_us, unfused_us

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
                f"{list(g.domain.shape)}, grid {src.grid}, {src.num_warps} warps, {src.constexprs}"
                + ("; looped, threads along the rows (adjacent in memory)"
                   if g.rows_contiguous else "")
                + (f", each row split over {src.grid[1]} programs" if len(src.grid) > 1 else ""))
    elif g.kind is GroupKind.HORIZONTAL:
        src = compiled.sources[g.id]
        shapes = ", ".join(str(list(p.shape)) for p in g.parts)
        head = (f"{len(g.parts)} independent pointwise kernels in one launch ({shapes}), grid {src.grid}, "
                f"{src.num_warps} warps, {src.constexprs}")
    elif g.kind is GroupKind.MATMUL:
        src = compiled.sources[g.id]
        assert g.contraction is not None
        a, b = matmul_operands(g.contraction)
        c = src.constexprs
        split = c["SPLIT_K"]
        loop = ("matrix-vector loop" if c["BLOCK_M"] == 1 else
                "tl.dot tiles loaded through tensor descriptors (TMA)" if src.descriptors else "tl.dot tiles")
        split_text = (f", K split {split} ways (the last program of a tile sums and runs the epilogue)"
                      if split > 1 else "")
        head = (f"Triton matmul template {list(a.shape)} @ {list(b.shape)} with "
                f"{len(g.nodes) - 1} epilogue op(s), {loop}, tile {c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']}"
                f"{split_text}, grid {src.grid}, {src.num_warps} warps, {src.num_stages} stages; {g.note}")
    elif g.kind is GroupKind.ATEN:
        head = f"ATen ({g.note})" if g.note else "ATen"
        stand_in = STAND_IN_NOTES.get(g.nodes[0].target) if len(g.nodes) == 1 else None
        head += f"; {stand_in}" if stand_in else ""
        conv = compiled.base.conv_layouts.get(g.name)
        if conv is not None:
            measured = (f", measured {conv.channels_last_us:.1f} µs channels_last vs {conv.native_us:.1f} µs NCHW"
                        if conv.native_us is not None and conv.channels_last_us is not None else "")
            head += f"; runs in {conv.layout.replace('native', 'NCHW')} ({conv.reason}{measured})"
            if any(isinstance(st, ChannelsLastConvStep) and st.group is g and not st.convert_back
                   for st in compiled.base.steps):
                head += "; its readers (generated kernels) take the channels_last result as it is"
    else:
        head = "zero-copy alias (no launch)"
    lines = [f"{g.name}  [{g.kind.value}] {head}", f"    ops ({len(g.nodes)}): {ops}"]
    if g.kind.generated:
        lines.append(f"    reads:  {', '.join(_tensor(n) for n in g.inputs) or '-'}")
        lines.append(f"    writes: {', '.join(_tensor(n) + (' (channels_last)' if memory_order(n) else '') for n in g.outputs)}")
        ceilings = compiled.base.ceilings
        fused = estimate_us(g, ceilings=ceilings)
        before, kernels = unfused_us(g, ceilings)
        lines.append(f"    predicted: {fused:.1f} us fused, {before:.1f} us as {kernels} separate kernel(s) "
                     f"({ceilings.name}, {ceilings.source})")
        lines.append(f"    resources: {kernel_resources(g, compiled)}")
    return "\n".join(lines)


def kernel_resources(g: Group, compiled: CompiledGraph) -> Resources:
    """The compiled kernel's registers / shared memory when it has run on a GPU, else the estimate."""
    step = compiled.base.steps[compiled.plan.groups.index(g)]
    binary = step.binary() if isinstance(step, KernelStep) else None
    src = compiled.sources[g.id]
    if binary is not None:
        return Resources(threads=src.num_warps * 32, registers=int(binary.n_regs),
                         shared_bytes=int(binary.metadata.shared), spills=int(binary.n_spills), measured=True)
    parts = g.parts or [g]
    reductions = sum(1 for p in parts for n in p.nodes if n.kind is OpKind.REDUCTION)
    c = src.constexprs
    tile = ((c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], src.num_warps, src.num_stages or 3)
            if g.kind is GroupKind.MATMUL else None)
    itemsize = g.contraction.itemsize if g.contraction is not None else 4
    kind = GroupKind.POINTWISE if g.kind is GroupKind.HORIZONTAL else g.kind
    shape = max((p.shape for p in parts), key=lambda s: math.prod(s)) if kind is GroupKind.POINTWISE else g.shape
    return estimate(kind, g.inputs, g.outputs, shape, g.domain, reductions, compiled.config,
                    compiled.base.sm_count, matmul_tile=tile, itemsize=itemsize, split=g.split,
                    rows_contiguous=g.rows_contiguous,
                    branched=branched_inputs(g.kind, g.nodes, g.inputs, compiled.config))


def explain_plan(compiled: CompiledGraph, source: bool = True) -> str:
    s = compiled.stats
    plan = compiled.plan
    out = [
        f"streamfuse plan: {s['source_ops']} source ops -> {s['kernels']} kernel launches per call "
        f"({s['generated_kernels']} generated, {s['aten_kernels']} ATen), {plan.merges} merges, "
        f"executor={compiled.executor}, device={compiled.device}",
        "",
    ]
    network = compiled.base.network_layout
    if network is not None and compiled.base.conv_layouts:
        out += [network.describe(), ""]
    out += ["kernels, in launch order:"]
    out += [_describe(g, compiled) for g in plan.groups]
    if compiled.graph.notes:
        out += ["", "graph rewrites:"] + [f"  {note}" for note in compiled.graph.notes]
    out += ["", *_schedule_lines(compiled)]
    out += ["", *_compile_lines(compiled)]
    out += ["", f"refused fusions ({len(plan.refusals)}):"]
    out += [f"  {r}" for r in plan.refusals] or ["  (none)"]
    if source and compiled.sources:
        out += ["", "generated Triton source:"]
        for g in plan.groups:
            if g.id in compiled.sources:
                out += ["", compiled.sources[g.id].source.rstrip()]
    return "\n".join(out)


def _writeback_lines(compiled: CompiledGraph) -> list[str]:
    """Inputs the graph updates in place (runtime/writeback.py), if any."""
    exe = compiled.base
    if not exe.graph.writebacks:
        return []
    return [f"inputs updated in place: {len(exe.graph.writebacks)} ({exe.stored_in_place} stored by the kernel "
            f"computing the new value, {len(exe.writebacks)} copied over the input after the last kernel)"]


def _compile_lines(compiled: CompiledGraph) -> list[str]:
    """How the plan was built and what it falls back to: capture path, stage times, kernels that
    did not compile, plans for other shapes, and the eager fallback if the plan failed."""
    s = compiled.stats
    stages = ", ".join(f"{k} {v:.2f}" for k, v in (s.get("compile_stages_s") or {}).items() if v >= 0.005)
    lines = [f"compile: {s['compile_s']:.2f} s" if s.get("compile_s") is not None else "compile:"]
    lines[0] += f" ({stages})" if stages else ""
    if s.get("first_call_s") is not None:
        lines[0] += f"; first call {s['first_call_s']:.2f} s"
    if compiled.capture_path is not None:
        lines.append(f"  captured by {compiled.capture_path}")
    for failure in compiled.base.precompile_failures:
        lines.append(f"  not compiled ahead (its first launch compiles it): {failure}")
    for step in compiled.base.steps:
        if isinstance(step, KernelStep) and step.failure is not None:
            lines.append(f"  runs through ATen: {step.failure}")
    if compiled.eager_reason is not None:
        lines.append(f"  every call runs the model eagerly: {compiled.eager_reason}")
    if compiled.specializations:
        lines.append(f"plans for other input shapes or dtypes ({len(compiled.specializations)} kept, at most "
                     f"{compiled.config.max_specializations}, least recently used out):")
        for key, other in compiled.specializations.items():
            shapes = ", ".join(f"{list(shape)} {str(dtype).removeprefix('torch.')}" for shape, dtype, _ in key)
            cost = other.stats.get("compile_s")
            lines.append(f"  ({shapes}): " + (f"compiled in {cost:.2f} s, {other.stats['kernels']} kernels"
                                                if cost is not None else str(other.stats.get("fallback"))))
    if compiled.specialization_overflow:
        lines.append(f"  {compiled.specializations_built} specializations compiled "
                     f"(Config.max_specializations_built): calls with other new shapes run the model eagerly")
    return lines


def _schedule_lines(compiled: CompiledGraph) -> list[str]:
    sched = compiled.base.schedule
    extra = compiled.base.release_waits
    lines = [f"schedule: {sched.streams} stream(s), {sched.events + extra} cross-stream wait(s) per call"
             + (f" ({extra} of them so that memory read across streams is reused within the call)" if extra else "")
             + (" (stream 0: high priority, critical path)" if sched.own_first_stream else "")]
    if sched.streams > 1:
        groups = compiled.plan.groups
        for s in range(sched.streams):
            names = [groups[i].name for i in sched.order if sched.stream_of[i] == s and groups[i].launches]
            lines.append(f"  stream {s}: {', '.join(names)}")
        for s in sched.fork:
            lines.append(f"  wait: stream {s} waits for the caller's stream before its first kernel (fork)")
        for v, us in sched.waits.items():
            for u in us:
                lines.append(f"  wait: {groups[v].name} on stream {sched.stream_of[v]} waits for {groups[u].name}")
        for s in sched.join:
            lines.append(f"  wait: the caller's stream waits for stream {s}'s last kernel (join)")
    kernels = [st for st in compiled.base.steps if isinstance(st, KernelStep)]
    if any(st.source.pdl for st in kernels):
        lines.append(f"programmatic dependent launch: {sum(st.pdl for st in kernels)} of {len(kernels)} generated "
                     "kernels start while the kernel before them on their stream finishes (one of ours, or a "
                     "convolution unless Config.pdl_after_convolutions=False; the first on each "
                     "stream launches plainly" + ("" if compiled.config.pdl_beside_others else
                                                  ", and so does a kernel that runs beside other streams'") + ")")
    else:
        lines.append("programmatic dependent launch: off (" + (
            "Config.pdl=False" if not compiled.config.pdl else
            "needs a GPU of compute capability 9.0 or newer" if compiled.device.type == "cuda"
            else "not a CUDA device") + ")")
    lines += _writeback_lines(compiled)
    if compiled.use_graphs:
        config = compiled.config
        outputs = ("outputs: the graph's own buffers, overwritten by the next call (reuse_outputs=True)"
                   if config.reuse_outputs else
                   f"outputs: fresh; up to {config.output_sets} recorded instance(s) per graph hand out their own "
                   f"buffers once the caller has let go of them, otherwise a copy "
                   f"({compiled.stats['graph_instances']} instance(s) recorded)")
        lines.append(outputs)
        lines.append(f"inputs: copied {compiled.input_copy()}")
        written = len(compiled.graph.written_inputs)
        if written:
            read = compiled.inputs_read_in_place()
            lines.append(f"inputs updated in place: {written}; " + (
                "the recorded graphs read and write them where they are" if read == written else
                f"the recorded graph reads {read} of them where they are, copies the others in and back "
                "(not contiguous, or moved too often)" if read is not None else
                "read where they are once a graph is recorded")
                + (f" ({compiled.inputs_moved} call(s) found them moved: recorded again)"
                   if compiled.inputs_moved else ""))
        lines.append(f"CUDA graphs: {compiled.stats['graphs']} recorded (max {compiled.config.max_graphs}); "
                     + ("batch padded up to buckets " + str(list(compiled.config.batch_buckets))
                        if compiled.batch_reason is None else f"batch fixed at {compiled.base_batch}: "
                        f"{compiled.batch_reason}"))
        if compiled.graph_failure:
            lines.append(f"CUDA-graph capture failed, running on streams instead: {compiled.graph_failure}")
    elif compiled.graph_skip is not None:
        lines.append(f"CUDA graphs: not used: {compiled.graph_skip}")
    else:
        lines.append("CUDA graphs: off (" + ("not a CUDA device" if compiled.device.type != "cuda"
                                             else "Config.cuda_graphs=False") + ")")
    return lines
