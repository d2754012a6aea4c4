"""When a buffer read on other streams than its own may go back to the caching allocator. Pure.

PyTorch's caching allocator hands a freed block out again only to allocations on the stream it was
allocated on. A buffer read on another stream used to be marked there with `record_stream`, which
makes the allocator wait for that stream before reusing it; but during CUDA-graph capture it cannot
record events, so it holds every such block until the capture ends. A training backward whose
weight-gradient kernels run beside the input-gradient chain reads most of its incoming gradients
and saved activations on a side stream, so its graph kept nearly all of them at once (PERF.md,
session 34).

The device order of a stream schedule is known in advance: a step runs after the steps before it
on its stream and after those its waits name, transitively. A buffer allocated on stream A may
therefore be released, with no `record_stream`, just before a later step j on A is issued once
every reader on another stream is ordered before j: every allocation that can reuse the block is
issued on A at j or later. Where no such step exists, one is made: the first step on A issued after
each reading stream has issued a later step (so the reader is probably done) waits for the reader,
for buffers of at least `min_bytes`. A buffer of the caller's stream may also be released after
the end-of-run join when that join covers its readers. Any other buffer keeps the old treatment:
`record_stream` on each reading stream, released after its last reader.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

Clock = dict[int, int]
"""Stream -> how many of its launches are ordered before a point (a vector clock)."""


@dataclass
class ReleasePlan:
    before: dict[int, list[int]] = field(default_factory=dict)
    """Step -> slots released just before it is issued (after its waits)."""
    after: dict[int, list[int]] = field(default_factory=dict)
    """Step -> slots released just after it is issued."""
    record: dict[int, list[int]] = field(default_factory=dict)
    """Step -> slots it reads that are marked with record_stream on its stream (the fallback)."""
    at_end: list[int] = field(default_factory=list)
    """Slots released after the caller's stream joined the others."""
    waits: dict[int, list[int]] = field(default_factory=dict)
    """Step -> steps whose events its stream waits on to release memory (added to the schedule's)."""
    record_events: set[int] = field(default_factory=set)
    """Steps after which an event is recorded for `waits`."""

    @property
    def added_waits(self) -> int:
        return sum(len(w) for w in self.waits.values())


def _merge(into: Clock, other: Mapping[int, int]) -> None:
    for s, n in other.items():
        if into.get(s, 0) < n:
            into[s] = n


def _covered(clock: Mapping[int, int], need: Mapping[int, tuple[int, int]]) -> bool:
    return all(clock.get(s, 0) >= n for s, (n, _) in need.items())


def plan_releases(order: Sequence[int], stream: Mapping[int, int], launching: Collection[int],
                  waits: Mapping[int, Sequence[int]], joined: Collection[int], caller: int,
                  readers: Mapping[int, Sequence[int]], alloc: Mapping[int, int],
                  nbytes: Mapping[int, int], releases: Sequence[Sequence[int]], min_bytes: int) -> ReleasePlan:
    """`order`: steps in issue order; `stream`: step -> stream it is issued on (`caller` for the
    caller's); `launching`: steps that launch device work (the others only make views on the host);
    `waits`: the schedule's step -> steps its stream waits for; `joined`: streams the caller's stream
    waits for at the end; `readers`: slot -> steps reading it; `alloc`: slot -> stream its memory
    was allocated on; `releases[i]`: slots whose last reader in issue order is step i."""
    plan = ReleasePlan()
    issued: dict[int, int] = {}  # stream -> launches issued so far
    seq: dict[int, int] = {}  # launching step -> its position on its stream (from 1)
    clock_after: dict[int, Clock] = {}
    current: dict[int, Clock] = {}  # stream -> clock after its last issued launch
    pending: list[tuple[int, int, dict[int, tuple[int, int]]]] = []  # (slot, alloc stream, need)
    fallback: dict[int, int] = {}  # slot -> step after which it is released (record_stream kept)

    def ready(need: Mapping[int, tuple[int, int]]) -> bool:
        return all(issued.get(s, 0) > n for s, (n, _) in need.items())

    for i in order:
        if i in launching:
            s = stream[i]
            clock = dict(current.get(s, {}))
            for w in waits.get(i, ()):
                _merge(clock, clock_after[w])
            still: list[tuple[int, int, dict[int, tuple[int, int]]]] = []
            for slot, a, need in pending:
                if a != s:
                    still.append((slot, a, need))
                    continue
                if not _covered(clock, need):
                    if nbytes.get(slot, 0) < min_bytes or not ready(need):
                        still.append((slot, a, need))
                        continue
                    for r_stream, (n, r) in need.items():
                        if clock.get(r_stream, 0) < n:
                            plan.waits.setdefault(i, []).append(r)
                            _merge(clock, clock_after[r])
                plan.before.setdefault(i, []).append(slot)
            pending = still
            issued[s] = issued.get(s, 0) + 1
            seq[i] = issued[s]
            clock[s] = issued[s]
            clock_after[i] = clock
            current[s] = clock
        for slot in releases[i]:
            a = alloc.get(slot, caller)
            need: dict[int, tuple[int, int]] = {}
            for r in readers.get(slot, ()):
                if r in launching and stream[r] != a and need.get(stream[r], (0, -1))[0] < seq[r]:
                    need[stream[r]] = (seq[r], r)
            if not need or _covered(current.get(a, {}), need):
                plan.after.setdefault(i, []).append(slot)
            else:
                pending.append((slot, a, need))
                fallback[slot] = i
    end = dict(current.get(caller, {}))
    for s in joined:
        _merge(end, current.get(s, {}))
    for slot, a, need in pending:
        if a == caller and _covered(end, need):
            plan.at_end.append(slot)
            continue
        plan.after.setdefault(fallback[slot], []).append(slot)
        for r in readers.get(slot, ()):
            if r in launching and stream[r] != a:
                plan.record.setdefault(r, []).append(slot)
    # one wait per step and reading stream is enough: the latest launch on that stream follows the rest
    for i, w in plan.waits.items():
        latest = {stream[r]: r for r in sorted(w, key=seq.__getitem__)}  # the last one per stream stays
        plan.waits[i] = sorted(latest.values())
    plan.record_events = {r for w in plan.waits.values() for r in w}
    return plan
