"""Running one Executable over several CUDA streams, joined by events.

schedule/plan.py turns the fusion plan into a StreamSchedule (pure); the StreamRunner issues the
steps in that order, each on its stream.

Memory safety across streams: buffers come from PyTorch's caching allocator, which hands a freed
block out again only to allocations on the stream it was allocated on. A buffer read on another
stream is released where the schedule orders every such read before the next step of its own
stream (schedule/release.py, which adds a wait where none does and the buffer is large); the rest
are marked with `record_stream` on their reading streams. During CUDA-graph capture the allocator
holds a block marked so until the capture ends, so the first kind is what lets a captured graph
reuse memory read across streams (a training backward's saved activations and gradients).
Outputs made on side streams are marked for the caller's stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from streamfuse.fusion.groups import GroupKind
from streamfuse.schedule.plan import StreamSchedule
from streamfuse.schedule.release import ReleasePlan, plan_releases

if TYPE_CHECKING:
    from streamfuse.runtime.executable import Executable

_Actions = tuple[tuple[Any, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""Per step: events its stream waits on to release memory, slots released before it, slots marked
with record_stream after it, slots released after it (schedule/release.py's ReleasePlan)."""

CALLER = -1
"""Pseudo-stream of graph inputs and constants: the caller's current stream."""


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
        self.release = exe.release_lists(schedule.order)
        """After step i, the slots nothing issued later reads (issue order, not plan order: a slot
        freed after its last reader in plan order could still be read by a step issued later)."""
        self._plans: dict[int, tuple[list[list[int]], ReleasePlan, list[_Actions]]] = {}
        self.release_plan(self.release)

    def release_plan(self, releases: list[list[int]]) -> ReleasePlan:
        """Where the slots of `releases` (a release list of the Executable, cached by it) go back to
        the allocator, and the waits and events that needs (schedule/release.py)."""
        return self._planned(releases)[0]

    def _planned(self, releases: list[list[int]]) -> tuple[ReleasePlan, list[_Actions]]:
        """The release plan of `releases` and, per step, what a run does around it (one list index
        per step on the host path, not four dictionary lookups)."""
        hit = self._plans.get(id(releases))
        if hit is not None and hit[0] is releases:
            return hit[1], hit[2]
        exe, sched = self.exe, self.schedule
        launching = {i for i, g in enumerate(exe.plan.groups) if g.kind is not GroupKind.ALIAS}
        readers: dict[int, list[int]] = {}
        for i, group in enumerate(exe.plan.groups):
            for s in {exe.slot[a] for n in group.nodes for a in n.input_nodes()}:
                readers.setdefault(s, []).append(i)
        nbytes = {exe.slot[n]: n.numel * n.itemsize for n in exe.graph.nodes if n.dtype is not None}
        plan = plan_releases(sched.order, {i: self._real_stream(s) for i, s in sched.stream_of.items()}, launching,
                             sched.waits, [self._real_stream(s) for s in sched.join], CALLER, readers,
                             self.alloc_stream, nbytes, releases, exe.config.stream_release_bytes)
        for i in plan.record_events:
            self.events.setdefault(i, torch.cuda.Event())
        actions = [(tuple(self.events[w] for w in plan.waits.get(i, ())), tuple(plan.before.get(i, ())),
                    tuple(plan.record.get(i, ())), tuple(plan.after.get(i, ()))) for i in range(len(exe.steps))]
        self._plans[id(releases)] = (releases, plan, actions)
        return plan, actions

    def run(self, env: list[Any], release: bool, releases: list[list[int]] | None = None) -> None:
        """`releases`: other release lists (Executable.donating) in place of this runner's."""
        with torch.cuda.device(self.device):
            caller = torch.cuda.current_stream(self.device)
            try:
                self._issue(env, release, caller, releases or self.release)
            finally:
                torch.cuda.set_stream(caller)

    def _issue(self, env: list[Any], release: bool, caller: torch.cuda.Stream, releases: list[list[int]]) -> None:
        """The steps in schedule order. The current stream is switched only where the next step's
        stream differs (not a stream context per step: ~10 µs of host time each, most of a
        500-kernel call's Python when no graph replays); `run` restores the caller's."""
        sched, steps = self.schedule, self.exe.steps
        streams = {s: self.side.get(s, caller) for s in range(sched.streams)}
        if sched.fork:
            self.fork_event.record(caller)
            for s in sched.fork:
                streams[s].wait_event(self.fork_event)
        plan, actions = self._planned(releases)
        current = caller
        for i in sched.order:
            stream = streams[sched.stream_of[i]]
            for w in sched.waits.get(i, ()):
                stream.wait_event(self.events[w])
            if stream is not current:
                torch.cuda.set_stream(stream)
                current = stream
            waits, before, record, after = actions[i]
            if release:
                for event in waits:
                    stream.wait_event(event)
                for slot in before:
                    env[slot] = None
            steps[i].run(env)
            if i in self.events:
                self.events[i].record(stream)
            if release:
                for slot in record:
                    if env[slot] is not None and env[slot].is_cuda:  # a CPU scalar needs no stream record
                        env[slot].record_stream(stream)
                for slot in after:
                    env[slot] = None
        for s in sched.join:
            self.join_events[s].record(streams[s])
            caller.wait_event(self.join_events[s])
        if release:
            for slot in plan.at_end:
                env[slot] = None
            for slot in self.exe.out_slots:
                if slot is not None and self.alloc_stream.get(slot, CALLER) != CALLER and env[slot] is not None \
                        and env[slot].is_cuda:
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
