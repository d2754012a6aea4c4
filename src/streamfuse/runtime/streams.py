"""Running one Executable over several CUDA streams, joined by events.

`schedule_steps` turns the fusion plan into a StreamSchedule (pure: schedule/streams.py decides
streams and waits over the launching groups; zero-copy aliases follow their producer). The
StreamRunner issues the steps in that order, each on its stream.

Memory safety across streams: buffers come from PyTorch's caching allocator; a buffer read on a
stream other than the one it was allocated on is marked with `record_stream`, so the allocator
never hands its memory out again while that stream may still read it. Outputs made on side
streams are marked for the caller's stream. During CUDA-graph capture nothing is released at all
(runtime/graphs.py), so no memory is reused inside a graph whatever stream reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from streamfuse.config import Config
from streamfuse.fusion.groups import Group, GroupKind, Plan
from streamfuse.schedule.cost import estimate_us
from streamfuse.schedule.streams import StreamPlan, assign_streams

if TYPE_CHECKING:
    from streamfuse.runtime.executable import Executable

CALLER = -1
"""Pseudo-stream of graph inputs and constants: the caller's current stream."""


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
    plan: StreamPlan | None = None

    @property
    def events(self) -> int:
        """Cross-stream waits per call (kernel-to-kernel, fork and join)."""
        return sum(len(w) for w in self.waits.values()) + len(self.fork) + len(self.join)


def schedule_steps(plan: Plan, config: Config) -> StreamSchedule:
    groups = plan.groups
    index = {g.id: i for i, g in enumerate(groups)}
    launching = [g for g in groups if g.kind is not GroupKind.ALIAS]
    owner = plan.group_of()
    preds = launch_predecessors(groups, owner)
    import networkx as nx

    dag: nx.DiGraph = nx.DiGraph()
    dag.add_nodes_from(g.id for g in launching)
    for g in launching:
        for p in preds[g.id]:
            dag.add_edge(p, g.id)
    splan = assign_streams(dag, config.max_streams, {g.id: estimate_us(g) for g in launching})
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
    return StreamSchedule(streams=streams, stream_of=stream_of, order=order, waits=waits, record=record,
                          fork=fork, join=join, own_first_stream=own_first, plan=splan)


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


class StreamRunner:
    """Issues an Executable's steps on their streams; stream objects and events live as long as it."""

    def __init__(self, exe: Executable, schedule: StreamSchedule, device: torch.device):
        self.exe = exe
        self.schedule = schedule
        self.device = device
        high = torch.cuda.Stream.priority_range()[1] if hasattr(torch.cuda.Stream, "priority_range") else -1
        self.side = {s: torch.cuda.Stream(device=device, priority=high if s == 0 else 0)
                     for s in range(schedule.streams) if s > 0 or schedule.own_first_stream}
        self.events = {i: torch.cuda.Event() for i in schedule.record}
        self.fork_event = torch.cuda.Event()
        self.join_events = {s: torch.cuda.Event() for s in schedule.join}
        self.alloc_stream = self._allocation_streams()
        self.cross_reads = self._cross_reads()

    def run(self, env: list[Any], release: bool) -> None:
        sched, steps = self.schedule, self.exe.steps
        caller = torch.cuda.current_stream(self.device)
        streams = {s: self.side.get(s, caller) for s in range(sched.streams)}
        if sched.fork:
            self.fork_event.record(caller)
            for s in sched.fork:
                streams[s].wait_event(self.fork_event)
        for i in sched.order:
            stream = streams[sched.stream_of[i]]
            for w in sched.waits.get(i, ()):
                stream.wait_event(self.events[w])
            with torch.cuda.stream(stream):
                steps[i].run(env)
            if i in self.events:
                self.events[i].record(stream)
            if release:
                for slot in self.cross_reads[i]:
                    if env[slot] is not None:
                        env[slot].record_stream(stream)
                for slot in self.exe.release[i]:
                    env[slot] = None
        for s in sched.join:
            self.join_events[s].record(streams[s])
            caller.wait_event(self.join_events[s])
        if release:
            for slot in self.exe.out_slots:
                if slot is not None and self.alloc_stream.get(slot, CALLER) != CALLER and env[slot] is not None:
                    env[slot].record_stream(caller)

    def _allocation_streams(self) -> dict[int, int]:
        """Slot -> stream its memory was allocated on (views: their base's); CALLER for inputs."""
        exe, sched = self.exe, self.schedule
        alloc: dict[int, int] = {s: CALLER for s in exe.input_slots} | {s: CALLER for s, _ in exe.constants}
        for i in sched.order:
            group = exe.plan.groups[i]
            for n in group.nodes:
                if group.kind is GroupKind.ALIAS:
                    base = n.input_nodes()[0] if n.input_nodes() else None
                    alloc[exe.slot[n]] = alloc.get(exe.slot[base], CALLER) if base is not None else CALLER
                else:
                    alloc[exe.slot[n]] = self._real_stream(sched.stream_of[i])
        return alloc

    def _real_stream(self, s: int) -> int:
        return CALLER if s == 0 and not self.schedule.own_first_stream else s

    def _cross_reads(self) -> dict[int, list[int]]:
        exe, sched = self.exe, self.schedule
        reads: dict[int, list[int]] = {}
        for i, group in enumerate(exe.plan.groups):
            here = self._real_stream(sched.stream_of[i])
            slots = {exe.slot[a] for n in group.nodes for a in n.input_nodes()}
            reads[i] = sorted(s for s in slots if self.alloc_stream.get(s, CALLER) != here)
        return reads
