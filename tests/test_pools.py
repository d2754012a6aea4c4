"""profile/pools.py: a private pool's growth read from a synthetic allocator history."""

from __future__ import annotations

from streamfuse.profile.pools import growth_text, pool_growth

MiB = 2**20
A, B, D = 1 << 30, 2 << 30, 3 << 30  # two segments of a graph's pool, one of the default pool
OURS = [{"filename": "/x/torch/cuda/graphs.py", "line": 1, "name": "capture"},
        {"filename": "/x/streamfuse/runtime/steps.py", "line": 72, "name": "run"}]


def _snapshot() -> dict:
    segments = [
        {"device": 0, "address": A, "total_size": 20 * MiB, "allocated_size": 10 * MiB, "stream": 5,
         "segment_pool_id": (1, 2)},
        {"device": 0, "address": B, "total_size": 30 * MiB, "allocated_size": 0, "stream": 7,
         "segment_pool_id": (1, 2)},
        {"device": 0, "address": D, "total_size": 64 * MiB, "allocated_size": 0, "stream": 5,
         "segment_pool_id": (0, 0)},
    ]
    ev = [
        {"action": "segment_alloc", "addr": D, "size": 64 * MiB, "stream": 5},
        {"action": "alloc", "addr": D, "size": 64 * MiB, "stream": 5},  # the default pool: not counted
        {"action": "segment_alloc", "addr": A, "size": 20 * MiB, "stream": 5},
        {"action": "alloc", "addr": A, "size": 10 * MiB, "stream": 5},
        {"action": "alloc", "addr": A + 10 * MiB, "size": 10 * MiB, "stream": 5},
        {"action": "free_requested", "addr": A, "size": 10 * MiB, "stream": 5},
        {"action": "free_completed", "addr": A, "size": 10 * MiB, "stream": 5},
        {"action": "free_requested", "addr": A + 10 * MiB, "size": 10 * MiB, "stream": 5},  # not yet completed
        {"action": "segment_alloc", "addr": B, "size": 30 * MiB, "stream": 7},
        {"action": "alloc", "addr": B, "size": 30 * MiB, "stream": 7, "frames": OURS},
        {"action": "free_requested", "addr": B, "size": 30 * MiB, "stream": 7},
        {"action": "free_completed", "addr": B, "size": 30 * MiB, "stream": 7},
    ]
    return {"segments": segments, "device_traces": [ev]}


def test_a_pools_growth_names_what_was_live_and_who_asked() -> None:
    (pool,) = pool_growth(_snapshot())
    assert pool.pool == (1, 2) and pool.total == 50 * MiB
    assert pool.by_stream == {5: 20 * MiB, 7: 30 * MiB}
    assert pool.peak_live == 40 * MiB  # the second 10 MiB (its free requested, not completed) and 30 MiB
    first, second = pool.growth
    assert (first.size, first.live, first.free, first.request) == (20 * MiB, 0, 0, 10 * MiB)
    assert (second.size, second.live, second.free, second.request) == (30 * MiB, 10 * MiB, 10 * MiB, 30 * MiB)
    assert second.stream == 7 and "streamfuse/runtime/steps.py:72 run" in second.where
    text = growth_text([pool])
    assert "pool (1, 2): 50 MiB" in text and "peak live 40 MiB" in text
    assert "+   30.0 MiB on stream 0x7 with 10 MiB live and 10 MiB free" in text


def test_a_history_without_completed_frees_frees_at_the_request() -> None:
    snap = _snapshot()
    snap["device_traces"] = [[e for e in snap["device_traces"][0] if e["action"] != "free_completed"]]
    (pool,) = pool_growth(snap)
    assert pool.growth[1].live == 0 and pool.peak_live == 30 * MiB


def test_a_segment_freed_before_the_pool_took_its_address_does_not_count() -> None:
    """A compile-time timing graph's pool had a segment at B, freed before the graph's pool took a
    segment at the same address: its growth and its live bytes are not the pool's."""
    snap = _snapshot()
    old_life = [
        {"action": "segment_alloc", "addr": B, "size": 32 * MiB, "stream": 9},
        {"action": "alloc", "addr": B, "size": 25 * MiB, "stream": 9},
        {"action": "alloc", "addr": B + 25 * MiB, "size": 5 * MiB, "stream": 9},
        {"action": "free_completed", "addr": B, "size": 25 * MiB, "stream": 9},
        {"action": "segment_free", "addr": B, "size": 32 * MiB, "stream": 9},  # its other block: history lost
    ]
    snap["device_traces"] = [old_life + snap["device_traces"][0]]
    (pool,) = pool_growth(snap)
    assert [g.size for g in pool.growth] == [20 * MiB, 30 * MiB]
    assert pool.peak_live == 40 * MiB and pool.growth[1].live == 10 * MiB
