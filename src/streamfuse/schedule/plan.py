"""The stream schedule of a fusion plan: which stream each step runs on, in which order, and
which events join the streams. Pure (no CUDA): schedule/streams.py decides streams and waits over
the launching groups; zero-copy aliases follow their producer; fork and join waits connect the
plan's streams to the caller's stream only where no other wait already does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from streamfuse.config import Config
from streamfuse.fusion.groups import Group, GroupKind, Plan
from streamfuse.schedule.cost import estimate_us
from streamfuse.schedule.streams import StreamPlan, assign_streams


@dataclass
class StreamSchedule:
    streams: int
    """Streams used by the launches (0 when nothing launches)."""
    stream_of: dict[int, int]
    """Step index -> stream (aliases follow their producer)."""
    order: list[int]
    """Step indices in issue order."""
    waits: dict[int, list[int]]
    """Step index -> steps whose completion event its stream waits on before it."""
    record: set[int]
    """Steps after which an event is recorded (some later step waits on it)."""
    fork: list[int] = field(default_factory=list)
    """Streams that must first wait for the caller's stream."""
    join: list[int] = field(default_factory=list)
    """Streams the caller's stream waits for at the end."""
    own_first_stream: bool = False
    """Stream 0 is streamfuse's own high-priority stream (else it is the caller's stream)."""
    concurrency: dict[int, int] = field(default_factory=dict)
    """Step index -> how many launches may run at once with it: 1 + the launches that are neither
    before nor after it in the DAG, at most the stream count (launching steps only; the tuner
    times a kernel beside that many copies of itself)."""
    plan: StreamPlan | None = None

    @property
    def events(self) -> int:
        """Cross-stream waits per call (kernel-to-kernel, fork and join)."""
        return sum(len(w) for w in self.waits.values()) + len(self.fork) + len(self.join)


def schedule_steps(plan: Plan, config: Config, measured_us: dict[int, float] | None = None) -> StreamSchedule:
    """Streams, events and issue order for the plan's launches. `measured_us` (by group id) replaces
    the cost model's estimate where a kernel was timed on the device (a convolution's layout)."""
    measured_us = measured_us or {}
    groups = plan.groups
    index = {g.id: i for i, g in enumerate(groups)}
    launching = [g for g in groups if g.kind is not GroupKind.ALIAS]
    owner = plan.group_of()
    preds = launch_predecessors(groups, owner)
    dag: nx.DiGraph = nx.DiGraph()
    dag.add_nodes_from(g.id for g in launching)
    for g in launching:
        for p in preds[g.id]:
            dag.add_edge(p, g.id)
    cost = {g.id: measured_us.get(g.id, estimate_us(g)) for g in launching}
    splan = assign_streams(dag, config.max_streams, cost)
    stream_of = {index[gid]: s for gid, s in splan.stream_of.items()}
    waits: dict[int, list[int]] = {}
    record: set[int] = set()
    for u, v in splan.waits:
        waits.setdefault(index[v], []).append(index[u])
        record.add(index[u])
    order = _issue_order(groups, splan.order, index, owner)
    for i, g in enumerate(groups):  # an alias runs on the host; it follows its first producer's stream
        if g.kind is GroupKind.ALIAS:
            producers = [owner[a] for a in g.nodes[0].input_nodes() if a in owner]
            stream_of[i] = stream_of.get(index[producers[0].id], 0) if producers else 0
    streams = splan.streams
    own_first = config.stream_priorities and streams > 1
    per_stream: dict[int, list[int]] = {}
    for i in order:
        if groups[i].kind is not GroupKind.ALIAS:
            per_stream.setdefault(stream_of[i], []).append(i)
    fork = [s for s, steps in sorted(per_stream.items())
            if (s > 0 or own_first) and (s == 0 or not waits.get(steps[0]))]
    join = [s for s, steps in sorted(per_stream.items()) if (s > 0 or own_first) and (s == 0 or steps[-1] not in record)]
    concurrency = {index[gid]: k for gid, k in launch_concurrency(dag, streams).items()}
    return StreamSchedule(streams=streams, stream_of=stream_of, order=order, waits=waits, record=record,
                          fork=fork, join=join, own_first_stream=own_first, plan=splan, concurrency=concurrency)


def launch_concurrency(dag: nx.DiGraph, streams: int) -> dict[Any, int]:
    """For each kernel: 1 + the kernels it has no path to or from, capped at `streams` (the plan's
    stream count, itself at most the DAG's width): an upper bound on what runs beside it."""
    if streams <= 1:
        return dict.fromkeys(dag.nodes, 1)
    n = dag.number_of_nodes()
    return {v: min(streams, n - len(nx.ancestors(dag, v)) - len(nx.descendants(dag, v))) for v in dag.nodes}


def launch_predecessors(groups: list[Group], owner: dict[Any, Group]) -> dict[int, set[int]]:
    """For each group, the launching groups it depends on, looking through aliases."""
    direct = {g.id: {owner[a].id for n in g.nodes for a in n.input_nodes() if a in owner} - {g.id} for g in groups}
    kind = {g.id: g.kind for g in groups}
    resolved: dict[int, set[int]] = {}
    for g in groups:  # topological order: predecessors are resolved first
        out: set[int] = set()
        for p in direct[g.id]:
            out |= resolved[p] if kind[p] is GroupKind.ALIAS else {p}
        resolved[g.id] = out
    return resolved


def _issue_order(groups: list[Group], launch_order: list[Any], index: dict[int, int],
                 owner: dict[Any, Group]) -> list[int]:
    """The scheduler's order for launches, each preceded by the aliases it needs."""
    done: set[int] = set()
    order: list[int] = []

    def emit(i: int) -> None:
        if i in done:
            return
        for a in {owner[x].id for n in groups[i].nodes for x in n.input_nodes() if x in owner}:
            if groups[index[a]].kind is GroupKind.ALIAS:
                emit(index[a])
        done.add(i)
        order.append(i)

    for gid in launch_order:
        emit(index[gid])
    for i in range(len(groups)):
        emit(i)
    return order
