"""Why a CUDA graph's memory pool is as large as it is: its growth, read from the allocator's history.

`torch.cuda.memory._record_memory_history()` records every allocation, free and new segment with
the Python stack that made it; `torch.cuda.memory._snapshot()` returns that history with the
segments as they are now. A private pool (a recorded graph's) only grows: each new segment is an
allocation that no free block of the pool on its stream could hold. `pool_growth` lists, for each
private pool, every segment it took, what was live in the pool at that moment and which frame of
ours asked for it, so that a pool far above its graph's live bytes can be told apart from
fragmentation (much free when it grew), a stream's own free blocks, or a large workspace.

Pure: works on the snapshot's dict, so it is tested without a GPU.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MiB = 2**20


@dataclass
class Growth:
    size: int
    """Bytes of the new segment."""
    stream: int
    live: int
    """Bytes allocated in the pool just before it grew (on all its streams)."""
    free: int
    """Bytes of the pool's segments not allocated just before it grew."""
    request: int
    """The allocation that made the segment (0 where the history does not show it)."""
    where: str
    """The innermost frame in streamfuse (or the innermost frame) of that allocation."""


@dataclass
class PoolGrowth:
    pool: tuple[int, int]
    total: int
    """Bytes of the pool's segments now."""
    peak_live: int
    """The most bytes allocated in the pool at once over the history."""
    by_stream: dict[int, int] = field(default_factory=dict)
    """Stream -> bytes of the pool's segments allocated on it now."""
    growth: list[Growth] = field(default_factory=list)


def _where(frames: Sequence[Mapping[str, Any]] | None) -> str:
    frames = frames or []
    ours = [f for f in frames if "streamfuse" in str(f.get("filename", ""))]
    f = (ours or list(frames) or [{}])[0]
    return f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '?')}" if f else "?"


def pool_growth(snapshot: Mapping[str, Any], device: int = 0) -> list[PoolGrowth]:
    """Each private pool of `snapshot` (torch.cuda.memory._snapshot() taken with the history on):
    its segments now, its peak of live bytes, and each segment it took with what was live then."""
    segments = sorted((s for s in snapshot.get("segments", []) if s.get("device", 0) == device),
                      key=lambda s: s["address"])
    starts = [s["address"] for s in segments]

    def segment_of(addr: int) -> Mapping[str, Any] | None:
        k = bisect.bisect_right(starts, addr) - 1
        if k < 0 or addr >= segments[k]["address"] + segments[k]["total_size"]:
            return None
        return segments[k]

    def pool_of(s: Mapping[str, Any] | None) -> tuple[int, int] | None:
        pid = tuple(s.get("segment_pool_id", (0, 0))) if s is not None else (0, 0)
        return None if pid == (0, 0) else (int(pid[0]), int(pid[1]))

    pools: dict[tuple[int, int], PoolGrowth] = {}
    for s in segments:
        pid = pool_of(s)
        if pid is None:
            continue
        p = pools.setdefault(pid, PoolGrowth(pid, 0, 0))
        p.total += s["total_size"]
        p.by_stream[s.get("stream", 0)] = p.by_stream.get(s.get("stream", 0), 0) + s["total_size"]
    traces = snapshot.get("device_traces", [])
    events = traces[device] if device < len(traces) else []
    # the memory of a segment now may have been another segment before (of a pool since freed: a
    # compile-time timing graph's): only what happened since the segment now there was allocated counts
    born = {e.get("addr", 0): k for k, e in enumerate(events) if e.get("action") == "segment_alloc"}
    live: dict[int, tuple[int, tuple[int, int]]] = {}  # addr -> (size, pool)
    live_in: dict[tuple[int, int], int] = dict.fromkeys(pools, 0)
    reserved: dict[tuple[int, int], int] = dict.fromkeys(pools, 0)
    pending: list[tuple[int, int, Growth]] = []  # new segments whose first allocation is not seen yet
    # a block stays allocated until its free completes (after the streams that used it); a history
    # without completions frees at the request
    free_action = "free_completed" if any(e.get("action") == "free_completed" for e in events) else "free_requested"
    for k, e in enumerate(events):
        action, addr, size = e.get("action"), e.get("addr", 0), e.get("size", 0)
        seg = segment_of(addr)
        pid = pool_of(seg)
        if seg is None or pid is None or pid not in pools or k < born.get(seg["address"], -1):
            continue
        if action == "segment_alloc":
            g = Growth(size, e.get("stream", 0), live_in[pid], reserved[pid] - live_in[pid], 0, _where(e.get("frames")))
            pools[pid].growth.append(g)
            reserved[pid] += size
            pending.append((addr, addr + size, g))
        elif action == "segment_free":
            reserved[pid] -= size
        elif action == "alloc":
            live[addr] = (size, pid)
            live_in[pid] += size
            pools[pid].peak_live = max(pools[pid].peak_live, live_in[pid])
            for start, end, g in pending:
                if start <= addr < end:
                    g.request, g.where = size, _where(e.get("frames"))
            pending = [t for t in pending if t[2].request == 0]
        elif action == free_action and addr in live:
            freed, owner = live.pop(addr)
            live_in[owner] -= freed
    return sorted(pools.values(), key=lambda p: -p.total)


def growth_text(pools: Sequence[PoolGrowth], top: int = 8) -> str:
    lines = []
    for p in pools:
        streams = ", ".join(f"{s:#x} {b / MiB:.0f}" for s, b in sorted(p.by_stream.items(), key=lambda t: -t[1]))
        lines.append(f"pool {p.pool}: {p.total / MiB:.0f} MiB in segments ({streams} MiB by stream), "
                     f"peak live {p.peak_live / MiB:.0f} MiB, {len(p.growth)} segment(s) taken")
        for g in sorted(p.growth, key=lambda g: -g.size)[:top]:
            lines.append(f"  +{g.size / MiB:7.1f} MiB on stream {g.stream:#x} with {g.live / MiB:.0f} MiB live and "
                         f"{g.free / MiB:.0f} MiB free in the pool, for {g.request / MiB:.1f} MiB at {g.where}")
    return "\n".join(lines)
