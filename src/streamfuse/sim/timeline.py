"""A predicted timeline: the cost model's kernel times placed on the planned streams.

List scheduling in the plan's issue order: a kernel starts when its stream is free and every
kernel it reads from has finished, plus the per-kernel launch latency of the execution mode
(inside a CUDA graph ~1.1 µs; launched one by one from Python ~9.6 µs, as measured on an H200,
GPU_FACTS.md). Eager PyTorch is modelled as the unfused plan on one stream.
"""

from __future__ import annotations

from typing import Any

from streamfuse.fusion.groups import GroupKind
from streamfuse.profile.report import Ceilings
from streamfuse.profile.timeline import Interval
from streamfuse.schedule.cost import estimate_us
from streamfuse.schedule.plan import launch_predecessors

GRAPH_LAUNCH_US = 1.1
EAGER_LAUNCH_US = 9.6
MIN_KERNEL_US = 1.0
"""The shortest a kernel is predicted to run: a tiny kernel is not free once launched (a CUDA graph
replays them at ~1.1 µs each, launch included: GPU_FACTS.md). Without it a plan of tiny kernels had
a predicted busy time near 0 and gap ratios of 10^6 % (the session-27 CLI sweep)."""


def predict_intervals(compiled: Any, ceilings: Ceilings, calls: int = 1, launch_us: float | None = None,
                      one_stream: bool = False) -> list[Interval]:
    """Intervals of `calls` back-to-back calls of a CompiledGraph on a GPU with `ceilings`."""
    exe = compiled.base
    groups = exe.plan.groups
    sched = exe.schedule
    latency = launch_us if launch_us is not None else (GRAPH_LAUNCH_US if exe.config.cuda_graphs else EAGER_LAUNCH_US)
    bytes_per_us = ceilings.bandwidth_gbps * 1e3
    flops_per_us = ceilings.tflops * 1e6 / 2  # half of the dense peak: a matmul rarely reaches more here
    preds = launch_predecessors(groups, exe.plan.group_of())
    index = {g.id: i for i, g in enumerate(groups)}
    out: list[Interval] = []
    clock = 0.0
    for _ in range(calls):
        stream_free: dict[int, float] = {}
        end: dict[int, float] = {}
        for i in sched.order:
            group = groups[i]
            if group.kind is GroupKind.ALIAS:
                continue
            stream = 0 if one_stream else sched.stream_of[i]
            ready = max([end[index[p]] for p in preds[group.id] if index[p] in end], default=clock)
            start = max(ready, stream_free.get(stream, clock)) + latency
            duration = max(estimate_us(group, bytes_per_us, flops_per_us, launch_us=0.0), MIN_KERNEL_US)
            end[i] = start + duration
            stream_free[stream] = end[i]
            out.append(Interval(kernel_name(compiled, group), stream, start, end[i]))
        clock = max(end.values(), default=clock)
    return out


def kernel_name(compiled: Any, group: Any) -> str:
    source = compiled.sources.get(group.id)
    if source is not None:
        return source.fn_name
    return group.nodes[0].op
