"""Stream assignment (streamfuse.schedule.streams): plan invariants on random DAGs, and hand-built blocks.

Everything here is checked against independent computations (brute-force antichains, a separate
Dilworth matching, a longest-path DP) and against the happens-before relation the plan itself implies.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Hashable, Mapping

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamfuse.schedule.streams import StreamPlan, assign_streams

Edge = tuple[Hashable, Hashable]


# ---------------------------------------------------------------- independent reference computations


def happens_before(plan: StreamPlan) -> set[Edge]:
    """The ordering a GPU would guarantee: each stream in issue order, plus every wait; transitively closed."""
    graph = nx.DiGraph()
    graph.add_nodes_from(plan.order)
    last_on: dict[int, Hashable] = {}
    for kernel in plan.order:
        stream = plan.stream_of[kernel]
        if stream in last_on:
            graph.add_edge(last_on[stream], kernel)
        last_on[stream] = kernel
    graph.add_edges_from(plan.waits)
    return set(nx.transitive_closure_dag(graph).edges)


def unenforced(dag: nx.DiGraph, plan: StreamPlan) -> list[Edge]:
    hb = happens_before(plan)
    position = {kernel: i for i, kernel in enumerate(plan.order)}

    def enforced(u: Hashable, v: Hashable) -> bool:
        same_stream = plan.stream_of[u] == plan.stream_of[v] and position[u] < position[v]
        return same_stream or (u, v) in hb

    return [(u, v) for u, v in dag.edges if not enforced(u, v)]


def closure_matching_size(dag: nx.DiGraph, drop_left: set[Hashable], drop_right: set[Hashable]) -> int:
    """Maximum matching (Hopcroft-Karp) on the transitive closure's bipartite graph, minus some vertices."""
    closure = nx.transitive_closure_dag(dag)
    left = [("L", u) for u in dag.nodes if u not in drop_left]
    bipartite = nx.Graph()
    bipartite.add_nodes_from(left)
    bipartite.add_nodes_from(("R", v) for v in dag.nodes if v not in drop_right)
    bipartite.add_edges_from(
        (("L", u), ("R", v)) for u, v in closure.edges if u not in drop_left and v not in drop_right
    )
    return len(nx.bipartite.hopcroft_karp_matching(bipartite, top_nodes=left)) // 2


def reference_width(dag: nx.DiGraph) -> int:
    """Maximum antichain: brute force on small DAGs, a separate Dilworth matching on larger ones."""
    if dag.number_of_nodes() <= 14:
        return max(len(antichain) for antichain in nx.antichains(dag))
    return dag.number_of_nodes() - closure_matching_size(dag, set(), set())


def critical_path_fits_one_chain(dag: nx.DiGraph, path: list[Hashable]) -> bool:
    """Does some minimum chain cover hold `path` as (part of) one chain?

    Yes iff fixing the path's consecutive pairs in the matching still allows a maximum matching.
    """
    fixed = closure_matching_size(dag, set(path[:-1]), set(path[1:])) + len(path) - 1
    return fixed == closure_matching_size(dag, set(), set())


def path_cost(path: list[Hashable], cost: Mapping[Hashable, float] | None) -> float:
    return sum((cost or {}).get(kernel, 1.0) for kernel in path)


def max_path_cost(dag: nx.DiGraph, cost: Mapping[Hashable, float] | None) -> float:
    best: dict[Hashable, float] = {}
    for v in nx.topological_sort(dag):
        best[v] = path_cost([v], cost) + max((best[u] for u in dag.predecessors(v)), default=0.0)
    return max(best.values(), default=0.0)


def check_plan(dag: nx.DiGraph, max_streams: int, cost: Mapping[Hashable, float] | None) -> StreamPlan:
    plan = assign_streams(dag, max_streams, cost)
    nodes = set(dag.nodes)

    # (1) the issue order is a topological order holding every kernel once
    assert len(plan.order) == len(nodes) and set(plan.order) == nodes
    position = {kernel: i for i, kernel in enumerate(plan.order)}
    assert all(position[u] < position[v] for u, v in dag.edges)

    # (2) every dependency is enforced by stream order or by events
    assert unenforced(dag, plan) == []

    # (3) no wait is redundant: dropping any one leaves some dependency unenforced
    for i in range(len(plan.waits)):
        fewer = dataclasses.replace(plan, waits=plan.waits[:i] + plan.waits[i + 1 :])
        assert unenforced(dag, fewer), f"wait {plan.waits[i]} is redundant"

    # (4) waits join different streams, and come in issue order of the waiting kernel
    assert all(plan.stream_of[u] != plan.stream_of[v] for u, v in plan.waits)
    assert [position[v] for _, v in plan.waits] == sorted(position[v] for _, v in plan.waits)

    # (5), (6) stream count and width against an independent maximum antichain
    width = reference_width(dag)
    assert plan.width == width
    assert plan.streams == min(width, max_streams)

    # (7) the critical path is a source-to-sink DAG path of maximum cost
    path = plan.critical_path
    if nodes:
        assert all(dag.has_edge(u, v) for u, v in itertools.pairwise(path))
        assert dag.in_degree(path[0]) == 0 and dag.out_degree(path[-1]) == 0
    assert math.isclose(path_cost(path, cost), max_path_cost(dag, cost), rel_tol=1e-9, abs_tol=1e-9)

    # (8) stream indices are exactly 0..streams-1, and every kernel has one
    assert set(plan.stream_of) == nodes
    assert set(plan.stream_of.values()) == set(range(plan.streams))

    # (9) the critical path lies whole on stream 0 whenever some minimum chain cover allows it
    if nodes and critical_path_fits_one_chain(dag, path):
        assert {plan.stream_of[kernel] for kernel in path} == {0}
    return plan


# ---------------------------------------------------------------- random DAGs


def random_dag(rng: random.Random) -> tuple[nx.DiGraph, dict[Hashable, float] | None, int]:
    n = rng.randint(1, 30)
    density = rng.choice([0.0, 0.05, 0.1, 0.2, 0.35, 0.6, 1.0])
    # Mixed id types and a shuffled insertion order: the pass must not rely on ids being sortable.
    make_id = rng.choice([lambda i: i, lambda i: f"k{i}", lambda i: ("op", i)])
    ids = [make_id(i) for i in rng.sample(range(1000), n)]  # ids[i] -> ids[j] only for i < j: acyclic
    dag = nx.DiGraph()
    dag.add_nodes_from(rng.sample(ids, n))
    dag.add_edges_from((ids[i], ids[j]) for i in range(n) for j in range(i + 1, n) if rng.random() < density)
    kind = rng.choice(["unit", "float", "int", "partial"])
    cost: dict[Hashable, float] | None = None
    if kind == "float":
        cost = {kernel: rng.uniform(0.0, 10.0) for kernel in ids}
    elif kind == "int":  # many ties
        cost = {kernel: float(rng.randint(0, 3)) for kernel in ids}
    elif kind == "partial":  # kernels missing from cost default to 1.0
        cost = {kernel: rng.uniform(0.5, 5.0) for kernel in ids if rng.random() < 0.5}
    return dag, cost, rng.randint(1, 8)


@pytest.mark.parametrize("seed", range(300))
def test_random_dag_invariants(seed: int) -> None:
    dag, cost, max_streams = random_dag(random.Random(seed))
    check_plan(dag, max_streams, cost)


@st.composite
def small_dags(draw: st.DrawFn) -> nx.DiGraph:
    n = draw(st.integers(0, 12))
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    keep = draw(st.lists(st.booleans(), min_size=len(pairs), max_size=len(pairs)))
    dag = nx.DiGraph()
    dag.add_nodes_from(range(n))
    dag.add_edges_from(pair for pair, kept in zip(pairs, keep) if kept)
    return dag


@settings(max_examples=150, deadline=None)
@given(dag=small_dags(), max_streams=st.integers(1, 6), costs=st.lists(st.integers(0, 4), min_size=12, max_size=12))
def test_hypothesis_invariants(dag: nx.DiGraph, max_streams: int, costs: list[int]) -> None:
    check_plan(dag, max_streams, {i: float(c) for i, c in enumerate(costs)})


# ---------------------------------------------------------------- hand-built blocks


def branch_block(branches: int = 4, length: int = 3) -> nx.DiGraph:
    """source -> `branches` independent chains of `length` kernels -> sink (an Inception-style block)."""
    dag = nx.DiGraph()
    for b in range(branches):
        nx.add_path(dag, ["src", *[f"b{b}_{i}" for i in range(length)], "sink"])
    return dag


def test_four_branch_block_uses_four_streams_with_fork_and_join_events() -> None:
    dag = branch_block()
    plan = check_plan(dag, 4, None)
    assert plan.width == 4 and plan.streams == 4
    assert len(plan.waits) == 6
    assert sum(u == "src" for u, _ in plan.waits) == 3  # fork: three branches wait for the source
    assert sum(v == "sink" for _, v in plan.waits) == 3  # join: the sink waits for three branches
    # each branch is one stream
    for b in range(4):
        assert len({plan.stream_of[f"b{b}_{i}"] for i in range(3)}) == 1


@pytest.mark.parametrize("max_streams, streams", [(8, 4), (4, 4), (3, 3), (2, 2), (1, 1)])
def test_four_branch_block_respects_max_streams(max_streams: int, streams: int) -> None:
    plan = check_plan(branch_block(), max_streams, None)
    assert plan.streams == streams
    if max_streams == 1:
        assert plan.waits == []


def test_issue_order_interleaves_branches() -> None:
    plan = assign_streams(branch_block(), 4)
    # all first kernels of the branches are issued before any second kernel
    firsts = [plan.order.index(f"b{b}_0") for b in range(4)]
    seconds = [plan.order.index(f"b{b}_1") for b in range(4)]
    assert max(firsts) < min(seconds)


@pytest.mark.parametrize("max_streams", range(1, 9))
def test_chain_uses_one_stream_and_no_waits(max_streams: int) -> None:
    dag = nx.path_graph(["a", "b", "c", "d", "e"], create_using=nx.DiGraph)
    plan = check_plan(dag, max_streams, None)
    assert plan.streams == 1 and plan.waits == [] and plan.width == 1
    assert plan.order == plan.critical_path == ["a", "b", "c", "d", "e"]


def test_empty_dag() -> None:
    plan = assign_streams(nx.DiGraph())
    assert plan == StreamPlan(streams=0, stream_of={}, order=[], waits=[], critical_path=[], width=0)


def test_single_kernel() -> None:
    dag = nx.DiGraph()
    dag.add_node("only")
    plan = check_plan(dag, 4, None)
    assert plan.streams == 1 and plan.stream_of == {"only": 0} and plan.critical_path == ["only"]


def test_cycle_is_rejected() -> None:
    dag = nx.DiGraph([("a", "b"), ("b", "c"), ("c", "a")])
    with pytest.raises(ValueError, match="dag"):
        assign_streams(dag)


def test_self_loop_is_rejected() -> None:
    with pytest.raises(ValueError, match="dag"):
        assign_streams(nx.DiGraph([("a", "a")]))


@pytest.mark.parametrize("max_streams", [0, -1])
def test_bad_max_streams_is_rejected(max_streams: int) -> None:
    with pytest.raises(ValueError, match="max_streams"):
        assign_streams(branch_block(), max_streams)


def test_negative_cost_is_rejected() -> None:
    with pytest.raises(ValueError, match="cost"):
        assign_streams(branch_block(), 4, {"src": -1.0})


def test_dag_is_not_mutated() -> None:
    dag = branch_block()
    dag.nodes["src"]["weight"] = 7
    before = (list(dag.nodes(data=True)), list(dag.edges(data=True)))
    assign_streams(dag, 2, {"b1_1": 5.0})
    assert (list(dag.nodes(data=True)), list(dag.edges(data=True))) == before


@pytest.mark.parametrize("max_streams", [1, 2, 3, 4])
@pytest.mark.parametrize("heavy", range(4))
def test_expensive_branch_is_the_critical_path_on_stream_zero(heavy: int, max_streams: int) -> None:
    dag = branch_block()
    cost = {f"b{heavy}_{i}": 10.0 for i in range(3)}
    plan = check_plan(dag, max_streams, cost)
    assert plan.critical_path == ["src", *[f"b{heavy}_{i}" for i in range(3)], "sink"]
    assert all(plan.stream_of[kernel] == 0 for kernel in plan.critical_path)


def test_critical_path_keeps_its_join_on_stream_zero() -> None:
    # Without seeding the matching, the first producer would take the consumer into its chain.
    dag = nx.DiGraph([("cheap", "out"), ("heavy", "out")])
    plan = check_plan(dag, 4, {"heavy": 5.0})
    assert plan.critical_path == ["heavy", "out"]
    assert plan.stream_of == {"cheap": 1, "heavy": 0, "out": 0}
    assert plan.waits == [("cheap", "out")]


def test_critical_path_split_only_when_the_width_forces_it() -> None:
    # a -> b is critical, but b is also the only successor of c, while d follows only a:
    # keeping a, b in one chain would need three chains for a width of two.
    dag = nx.DiGraph([("a", "b"), ("c", "b"), ("a", "d")])
    cost = {"b": 10.0}
    assert not critical_path_fits_one_chain(dag, ["a", "b"])
    plan = check_plan(dag, 4, cost)
    assert plan.critical_path == ["a", "b"] and plan.streams == plan.width == 2
    assert plan.stream_of["a"] != plan.stream_of["b"]
    # with a single stream everything is on stream 0 anyway
    assert set(check_plan(dag, 1, cost).stream_of.values()) == {0}


def test_critical_path_stays_whole_across_a_skip_connection() -> None:
    # A residual-style DAG: x -> (conv chain) -> add, x -> add; plus a cheap side branch.
    dag = nx.DiGraph([("x", "c1"), ("c1", "c2"), ("c2", "add"), ("x", "add"), ("x", "side"), ("side", "add")])
    cost = {"c1": 5.0, "c2": 5.0}
    plan = check_plan(dag, 4, cost)
    assert plan.critical_path == ["x", "c1", "c2", "add"]
    assert {plan.stream_of[kernel] for kernel in plan.critical_path} == {0}
    assert plan.streams == 2 and plan.waits == [("x", "side"), ("side", "add")]


def test_launch_concurrency_counts_the_kernels_that_may_run_alongside() -> None:
    from streamfuse.schedule.plan import launch_concurrency

    dag = branch_block()  # a source, four branches of three kernels b{i}_{j}, a sink
    conc = launch_concurrency(dag, assign_streams(dag, 8).streams)  # 4: the DAG's width
    assert conc["b0_0"] == 4 and conc["b3_1"] == 4  # one kernel of each branch at a time, at most
    heads = [v for v in dag.nodes if dag.in_degree(v) == 0]
    tails = [v for v in dag.nodes if dag.out_degree(v) == 0]
    assert all(conc[v] == 1 for v in heads + tails)
    assert launch_concurrency(dag, 2)["b0_0"] == 2  # capped at the streams
    assert set(launch_concurrency(dag, 1).values()) == {1}
    chain = nx.path_graph(["a", "b", "c"], create_using=nx.DiGraph)
    assert set(launch_concurrency(chain, 4).values()) == {1}


def test_explain_lists_every_wait_that_stats_count() -> None:
    """stats["events"] counts the waits a call records (fork, kernel-to-kernel, join); explain()
    lists each of them, so the two agree (a 4-branch block once showed 8 against 3 listed)."""
    import torch

    import streamfuse
    from streamfuse.demo_models import DEMO_MODELS

    for factory in DEMO_MODELS.values():
        model, inputs = factory(torch.device("cpu"))
        with torch.no_grad():
            compiled = streamfuse.compile(model, inputs, streamfuse.Config(executor="reference"))
        listed = [line for line in compiled.explain(source=False).splitlines() if line.strip().startswith("wait:")]
        assert len(listed) == compiled.stats["events"]


def test_one_stream_issues_a_kernel_just_before_the_result_it_leads_to_is_due() -> None:
    # a backward's shape: the chain g0 -> g1 -> g2 -> g3, each gi also making a weight gradient wi
    # (read by nothing), and "zeros" (no inputs) that only the last kernel accumulates into
    dag = nx.DiGraph()
    nx.add_path(dag, ["zeros", "acc"])
    nx.add_path(dag, ["g0", "g1", "g2", "g3", "acc"])
    for i in range(4):
        dag.add_edge(f"g{i}", f"w{i}")
    one = assign_streams(dag, 1)
    assert one.order.index("zeros") == one.order.index("acc") - 1  # its buffer lives one kernel long
    assert [k for k in one.order if k[0] == "w"] == ["w0", "w1", "w2", "w3"]
    assert all(one.order.index(f"w{i}") < one.order.index(f"g{i + 1}") for i in range(3))  # each as soon as due
    several = check_plan(dag, 4, None)
    assert several.order[0] == "zeros" or several.order.index("zeros") < several.order.index("g1")  # earliest start
