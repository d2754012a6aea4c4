"""schedule/release.py: a buffer read on other streams goes back to the allocator only where every
allocation that can reuse it (a later launch on its own stream) is ordered after those reads.

The checker is independent of the planner: reachability over the launches' stream order and waits
(networkx), not vector clocks."""

from __future__ import annotations

import random

import networkx as nx
import pytest

from streamfuse.schedule.release import ReleasePlan, plan_releases

CALLER = -1
END = "end"


def _schedule(seed: int) -> dict:
    """A random DAG in issue order 0..n-1 over the caller's and 3 side streams; every cross-stream
    edge is a wait (as in a schedule, where waits come from data edges). Each step makes one slot;
    slots 1000+ are inputs of the caller's stream."""
    rng = random.Random(seed)
    n = rng.randint(2, 30)
    stream = {i: rng.choice([CALLER, CALLER, 1, 2, 3]) for i in range(n)}
    launching = {i for i in range(n) if rng.random() > 0.1}
    readers: dict[int, list[int]] = {}
    waits: dict[int, list[int]] = {}
    for v in range(n):
        for u in rng.sample(range(v), min(v, rng.randint(0, 3))):
            readers.setdefault(u, []).append(v)
            if u in launching and v in launching and stream[u] != stream[v]:
                waits.setdefault(v, []).append(u)
        if rng.random() < 0.3:
            readers.setdefault(1000 + v, []).append(v)
    alloc = {i: stream[i] for i in range(n)} | {s: CALLER for s in readers if s >= 1000}
    nbytes = {s: rng.choice([10, 1 << 20, 1 << 24]) for s in alloc}
    last: dict[int, int] = {}
    for s, rs in readers.items():
        last[s] = max(rs)
    releases: list[list[int]] = [[] for _ in range(n)]
    for s, i in last.items():
        if rng.random() < 0.9:  # the others stay alive (graph outputs, inputs not donated)
            releases[i].append(s)
    return {"order": list(range(n)), "stream": stream, "launching": launching, "waits": waits,
                "joined": rng.sample([1, 2, 3], rng.randint(0, 3)), "caller": CALLER, "readers": readers, "alloc": alloc, "nbytes": nbytes,
                "releases": releases, "min_bytes": rng.choice([0, 1 << 20, 1 << 30])}


def _happens_before(sched: dict, plan: ReleasePlan) -> nx.DiGraph:
    g = nx.DiGraph()
    last_on: dict[int, int] = {}
    for i in sched["order"]:
        if i not in sched["launching"]:
            continue
        g.add_node(i)
        s = sched["stream"][i]
        if s in last_on:
            g.add_edge(last_on[s], i)
        last_on[s] = i
        for w in list(sched["waits"].get(i, ())) + plan.waits.get(i, []):
            assert w in sched["launching"] and sched["order"].index(w) < sched["order"].index(i)
            g.add_edge(w, i)
    g.add_node(END)
    for s, i in last_on.items():
        if s == sched["caller"] or s in sched["joined"]:
            g.add_edge(i, END)
    return g


def _check(sched: dict, plan: ReleasePlan) -> None:
    order, stream, launching = sched["order"], sched["stream"], sched["launching"]
    pos = {i: k for k, i in enumerate(order)}
    g = _happens_before(sched, plan)
    where: dict[int, tuple[str, int]] = {}
    for kind, lists in (("before", plan.before), ("after", plan.after)):
        for i, slots in lists.items():
            for s in slots:
                assert s not in where, f"slot {s} released twice"
                where[s] = (kind, i)
    for s in plan.at_end:
        assert s not in where
        where[s] = ("end", -1)
    released = {s for rel in sched["releases"] for s in rel}
    assert set(where) == released
    recorded = {s for slots in plan.record.values() for s in slots}
    for s, (kind, i) in where.items():
        a = sched["alloc"][s]
        readers = sched["readers"][s]
        # never before a reader is issued
        point = len(order) if kind == "end" else pos[i] - (1 if kind == "before" else 0)
        assert all(pos[r] <= point for r in readers), f"slot {s} released before its last reader"
        if kind == "before":
            assert stream[i] == a and i in launching
        cross = [r for r in readers if r in launching and stream[r] != a]
        if s in recorded:  # the fallback: every reading stream is marked
            assert {r for r, slots in plan.record.items() if s in slots} == set(cross)
            continue
        if kind == "end":
            assert a == sched["caller"]
            reusers: list = [END]
        else:
            reusers = [j for j in order if j in launching and stream[j] == a and pos[j] > point]
        for r in cross:
            for j in reusers:
                assert nx.has_path(g, r, j), f"slot {s}: reader {r} not ordered before reuse at {j}"


@pytest.mark.parametrize("seed", range(300))
def test_random_schedules_release_only_after_every_reader(seed: int) -> None:
    sched = _schedule(seed)
    plan = plan_releases(**sched)
    _check(sched, plan)


def _weight_gradients(n: int, nbytes: int, min_bytes: int) -> tuple[dict, ReleasePlan]:
    """A backward's shape: the input-gradient chain on the caller's stream (step 2k makes gradient
    slot 2k), each weight gradient on stream 1 (step 2k+1) reading that gradient; no step of the
    chain needs a weight gradient, so the schedule joins stream 1 only at the end."""
    order = list(range(2 * n))
    stream = {i: CALLER if i % 2 == 0 else 1 for i in order}
    readers = {2 * k: [2 * k + 1] + ([2 * k + 2] if k + 1 < n else []) for k in range(n)}
    releases: list[list[int]] = [[] for _ in order]
    for s, rs in readers.items():
        releases[max(rs)].append(s)
    sched = {"order": order, "stream": stream, "launching": set(order), "waits": {}, "joined": [1], "caller": CALLER,
                 "readers": readers, "alloc": {s: CALLER for s in readers}, "nbytes": dict.fromkeys(readers, nbytes),
                 "releases": releases, "min_bytes": min_bytes}
    plan = plan_releases(**sched)
    _check(sched, plan)
    return sched, plan


def test_weight_gradient_stream_releases_the_chain_gradients_as_it_goes() -> None:
    sched, plan = _weight_gradients(8, 1 << 22, 1 << 20)
    early = [s for slots in plan.before.values() for s in slots]
    assert len(early) >= 6  # all but the last few go back before the end of the run
    assert not plan.record  # none held by record_stream
    # the chain waits for a weight gradient only once stream 1 moved on to the next one
    for j, ws in plan.waits.items():
        for w in ws:
            assert stream_step_after(sched, w) < j


def stream_step_after(sched: dict, r: int) -> int:
    return next(i for i in sched["order"] if i > r and sched["stream"][i] == sched["stream"][r])


def test_small_buffers_are_not_worth_a_wait() -> None:
    _, plan = _weight_gradients(8, 1 << 10, 1 << 20)
    assert not plan.waits and not plan.before
    assert sorted(plan.at_end) == list(range(0, 16, 2))  # the caller's: after the end-of-run join


def test_a_join_that_already_orders_the_reads_adds_no_wait() -> None:
    # fork/join: x (step 0, caller) read by branches 1, 2, 3 on streams 1-3; the concat (step 4,
    # caller) waits for all three and is x's last reader
    sched = {"order": [0, 1, 2, 3, 4], "stream": {0: CALLER, 1: 1, 2: 2, 3: 3, 4: CALLER}, "launching": {0, 1, 2, 3, 4},
                 "waits": {1: [0], 2: [0], 3: [0], 4: [1, 2, 3]}, "joined": [], "caller": CALLER,
                 "readers": {0: [1, 2, 3, 4], 1: [4], 2: [4], 3: [4]}, "alloc": {0: CALLER, 1: 1, 2: 2, 3: 3},
                 "nbytes": dict.fromkeys(range(4), 1 << 24), "releases": [[], [], [], [], [0, 1, 2, 3]], "min_bytes": 0}
    plan = plan_releases(**sched)
    _check(sched, plan)
    assert not plan.waits
    assert sorted(plan.after[4]) == [0, 1, 2, 3]
    # x at once; the branches' outputs are blocks of streams that issue nothing later in the run, so
    # they keep record_stream for the caller's (a later run's reuse is ordered by nothing else)
    assert plan.record == {4: [1, 2, 3]}


def test_a_later_branch_on_the_same_stream_releases_the_earlier_ones_output() -> None:
    # two fork/joins in a row on streams 1 and the caller's: stream 1's second branch (step 4)
    # waits for the first concat (step 2), which read stream 1's first output (slot 1)
    sched = {"order": [0, 1, 2, 3, 4, 5], "stream": {0: CALLER, 1: 1, 2: CALLER, 3: CALLER, 4: 1, 5: CALLER},
                 "launching": set(range(6)), "waits": {1: [0], 2: [1], 4: [2], 5: [4]}, "joined": [], "caller": CALLER,
                 "readers": {0: [1, 2], 1: [2], 2: [3, 4], 3: [5], 4: [5]}, "alloc": {0: CALLER, 1: 1, 2: CALLER, 3: CALLER, 4: 1},
                 "nbytes": dict.fromkeys(range(5), 1 << 24), "releases": [[], [], [0, 1], [], [2], [3, 4]], "min_bytes": 1 << 30}
    plan = plan_releases(**sched)
    _check(sched, plan)
    assert not plan.waits
    assert plan.before[4] == [1]
    assert plan.record == {5: [4]}



def test_config_rejects_bad_stream_memory_settings() -> None:
    from streamfuse.config import Config

    with pytest.raises(ValueError, match="stream_release_bytes"):
        Config(stream_release_bytes=-1)
    with pytest.raises(ValueError, match="training_max_streams"):
        Config(training_max_streams=0)
    assert Config().with_settings(["training_max_streams=4", "stream_release_bytes=0"]).training_max_streams == 4


class _FakeEvent:
    def __init__(self, log: list) -> None:
        self.log = log

    def record(self, stream: object) -> None:
        self.log.append(("record", id(self), stream))


class _FakeStream:
    log: list = []

    def __init__(self, device: object = None, priority: int = 0) -> None:
        pass

    def wait_event(self, event: _FakeEvent) -> None:
        _FakeStream.log.append(("wait", id(event), self))


def test_stream_runner_on_fake_streams_issues_every_step_and_the_plans_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's host path (GPU-only otherwise) on stand-in streams and events: the same results
    as the plain run, every event waited on recorded earlier, and the added waits issued."""
    import contextlib

    import torch

    import streamfuse
    from streamfuse.config import Config
    from streamfuse.runtime.streams import StreamRunner

    def branches(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # `a` is read by a side chain that nothing on the caller's stream waits for (like a
        # backward's weight gradients): its release needs an added wait
        a = x @ w
        side = (((a * 2).sin() @ w).cos() @ w).tanh() @ w
        main = ((((a @ w).relu() @ w).sigmoid() @ w).exp() @ w)
        return side, main

    x, w = torch.randn(64, 64), torch.randn(64, 64)
    exe = streamfuse.compile(branches, (x, w), Config(executor="reference", stream_release_bytes=0)).base
    assert exe.schedule.streams > 1
    log: list = []
    _FakeStream.log = log
    caller = _FakeStream()
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: _FakeEvent(log))
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: caller)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: None)
    runner = StreamRunner(exe, exe.schedule, torch.device("cpu"))
    plan = runner.release_plan(runner.release)
    assert plan.added_waits > 0 and plan.before  # the shape exercises the added waits
    env: list = [None] * len(exe.graph.nodes)
    for s, t in zip(exe.input_slots, [x, w], strict=True):
        env[s] = t
    for s, t in exe.constants:
        env[s] = t
    with torch.no_grad():
        runner.run(env, release=True)
    got = [env[s] for s in exe.out_slots]
    want = exe.run([x, w], one_stream=True)
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e)
    recorded = set()
    for kind, event, _ in log:
        if kind == "record":
            recorded.add(event)
        else:
            assert event in recorded, "a stream waited on an event not recorded yet"
    waits = sum(kind == "wait" for kind, _, _ in log)
    assert waits == exe.schedule.events + plan.added_waits
    released = {s for slots in [*plan.before.values(), *plan.after.values(), plan.at_end] for s in slots}
    assert released and all(env[s] is None for s in released)


def test_one_added_wait_per_step_and_reading_stream() -> None:
    """Two large buffers of the caller's stream, read on stream 1 by its first and second launch:
    the caller's next launch needs only a wait for the second (stream order covers the first)."""
    # 0, 1 on the caller's stream make slots 0 and 1; 2 (reads 0), 3 (reads 1) and 4 on stream 1;
    # 5 on the caller's stream reads neither
    order = [0, 1, 2, 3, 4, 5]
    stream = {0: CALLER, 1: CALLER, 2: 1, 3: 1, 4: 1, 5: CALLER}
    readers = {0: [2], 1: [3]}
    releases = [[], [], [0], [1], [], []]
    plan = plan_releases(order, stream, set(order), {2: [0], 3: [1]}, [1], CALLER, readers,
                         {0: CALLER, 1: CALLER}, {0: 8 << 20, 1: 8 << 20}, releases, 1 << 20)
    assert plan.waits == {5: [3]} and plan.record_events == {3}
    assert sorted(plan.before[5]) == [0, 1]
