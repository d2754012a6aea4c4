"""Stream assignment: spread a kernel DAG over a few CUDA streams with the fewest cross-stream waits.

Adapted from Nimble (Kwon et al., NeurIPS 2020):

1. the critical path is the longest source-to-sink path by kernel cost;
2. a minimum chain cover of the DAG (Dilworth: as many chains as the widest antichain) comes from a
   maximum matching on the bipartite graph of the transitive closure; the matching is seeded with
   the critical path's consecutive pairs, which it keeps whenever some maximum matching does, so
   the critical path is split over chains only where the DAG's width forces it;
3. chains are merged onto k = min(width, max_streams) streams; the critical chain gets stream 0,
   which the runtime creates with high priority;
4. the host issues every kernel in one topological order, so a stream wait can never deadlock;
5. a wait (event record after u, stream wait before v) is emitted only for a cross-stream dependency
   that stream order and earlier waits do not already imply, tracked with vector clocks.

Pure: networkx only, no torch or CUDA, so the pass is testable (and explainable) anywhere.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import networkx as nx

Kernel = Hashable
Chain = list[Kernel]


@dataclass(frozen=True)
class StreamPlan:
    streams: int  # streams used: min(width, max_streams), or 0 for an empty DAG
    stream_of: dict[Kernel, int]  # kernel -> stream in [0, streams); stream 0: high priority, critical path
    order: list[Kernel]  # issue order (topological); each stream runs its kernels in this order
    waits: list[tuple[Kernel, Kernel]]  # (u, v): v's stream waits on an event recorded right after u
    critical_path: list[Kernel]  # a longest source-to-sink path by summed kernel cost
    width: int  # maximum antichain size: the DAG's maximum logical concurrency


def assign_streams(dag: nx.DiGraph, max_streams: int = 4, cost: Mapping[Kernel, float] | None = None) -> StreamPlan:
    """Plan streams and waits for `dag` (edge u -> v: v reads what u wrote). `dag` is not modified.

    `cost` is a per-kernel estimate (e.g. microseconds); kernels it does not name cost 1.0.
    Raises ValueError for a cyclic `dag`, `max_streams` < 1 or a negative / non-finite cost.
    """
    _check_inputs(dag, max_streams)
    costs = _node_costs(dag, cost)
    if not costs:
        return StreamPlan(streams=0, stream_of={}, order=[], waits=[], critical_path=[], width=0)
    # Ties are always broken by first-seen position in dag.nodes: kernel ids need not be orderable,
    # and the same graph must always give the same plan (plans end up in caches and explain output).
    index = {node: i for i, node in enumerate(dag.nodes)}
    topo = list(nx.lexicographical_topological_sort(dag, key=index.__getitem__))
    critical = _critical_path(dag, topo, costs, index)
    chains = _chain_cover(dag, topo, critical)
    streams = min(len(chains), max_streams)
    stream_of = _merge_chains(chains, critical, costs, streams)
    order = _issue_order(dag, topo, costs, index, just_in_time=streams == 1)
    waits = _waits(dag, order, stream_of, streams)
    return StreamPlan(streams, stream_of, order, waits, critical, width=len(chains))


def _check_inputs(dag: nx.DiGraph, max_streams: int) -> None:
    if not isinstance(dag, nx.DiGraph):
        raise TypeError(f"dag: expected a networkx.DiGraph, got {type(dag).__name__}")
    if isinstance(max_streams, bool) or not isinstance(max_streams, int):
        raise TypeError(f"max_streams: expected an int >= 1, got {max_streams!r}")
    if max_streams < 1:
        raise ValueError(f"max_streams: expected an int >= 1, got {max_streams}")
    if not nx.is_directed_acyclic_graph(dag):
        cycle = [u for u, _ in nx.find_cycle(dag)]
        raise ValueError(f"dag: expected a directed acyclic graph, found the cycle {cycle!r}")


def _node_costs(dag: nx.DiGraph, cost: Mapping[Kernel, float] | None) -> dict[Kernel, float]:
    given: Mapping[Kernel, float] = {} if cost is None else cost
    costs = {node: float(given.get(node, 1.0)) for node in dag.nodes}
    for node, value in costs.items():
        # A negative cost would make "longest path" and "earliest start" meaningless.
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"cost: expected finite non-negative costs, got {value!r} for kernel {node!r}")
    return costs


def _critical_path(
    dag: nx.DiGraph, topo: Sequence[Kernel], costs: Mapping[Kernel, float], index: Mapping[Kernel, int]
) -> list[Kernel]:
    """Longest path by node cost, by DP over a topological order (costs live on nodes, not edges)."""
    finish: dict[Kernel, float] = {}  # cost of the heaviest path ending at (and including) the kernel
    best_pred: dict[Kernel, Kernel | None] = {}
    for v in topo:
        preds = sorted(dag.predecessors(v), key=index.__getitem__)
        best = max(preds, key=finish.__getitem__, default=None)  # max keeps the first of equals
        best_pred[v] = best
        finish[v] = costs[v] + (finish[best] if best is not None else 0.0)
    # Costs are >= 0, so some sink attains the maximum; ending at a sink keeps the path source-to-sink.
    sinks = [v for v in topo if dag.out_degree(v) == 0]
    node: Kernel | None = max(sorted(sinks, key=index.__getitem__), key=finish.__getitem__)
    path: list[Kernel] = []
    while node is not None:
        path.append(node)
        node = best_pred[node]
    return path[::-1]


def _chain_cover(dag: nx.DiGraph, topo: Sequence[Kernel], critical: Sequence[Kernel]) -> list[Chain]:
    """Minimum chain cover (width chains) from a maximum matching on the transitive closure.

    A matched pair (u, v) means v follows u in u's chain; u may reach v through kernels on other
    chains. Unmatched left vertices end chains, so #chains = n - |matching| = width (König/Dilworth).
    """
    position = {node: i for i, node in enumerate(topo)}
    # The closure is n^2 bits, not n^2 set entries: kernel graphs run to thousands of nodes.
    reach = [0] * len(topo)  # bit j of reach[i]: topo[i] reaches topo[j]
    for i in reversed(range(len(topo))):
        for w in dag.successors(topo[i]):
            reach[i] |= (1 << position[w]) | reach[position[w]]
    adjacency: dict[Kernel, list[Kernel]] = {}

    def closure_successors(u: Kernel) -> list[Kernel]:
        # Built lazily (most kernels never need theirs), lowest topological position first:
        # nearest successors first, so chains tend to follow real edges rather than long skips.
        if u not in adjacency:
            bits = bin(reach[position[u]])[:1:-1]  # character j is bit j
            adjacency[u] = [topo[j] for j, bit in enumerate(bits) if bit == "1"]
        return adjacency[u]

    next_of: dict[Kernel, Kernel] = {}  # matching, left side -> right side
    prev_of: dict[Kernel, Kernel] = {}  # matching, right side -> left side
    for u, v in itertools.pairwise(critical):  # seed: the critical path as one chain
        next_of[u], prev_of[v] = v, u
    # Phase 1 grows the matching without moving a critical pair; phase 2 lifts that restriction to
    # reach a maximum matching, so the critical path is only split where the width demands it.
    # (Kuhn: a vertex with no augmenting path now never gets one later, so one try per phase is enough.)
    for locked in (set(critical[:-1]), set()):
        for root in topo:
            if root not in next_of:
                _augment(root, closure_successors, next_of, prev_of, locked)

    heads = [node for node in topo if node not in prev_of]
    chains: list[Chain] = []
    for head in heads:
        chain = [head]
        while chain[-1] in next_of:
            chain.append(next_of[chain[-1]])
        chains.append(chain)
    return chains


def _augment(
    root: Kernel,
    successors: Callable[[Kernel], Sequence[Kernel]],
    next_of: dict[Kernel, Kernel],
    prev_of: dict[Kernel, Kernel],
    locked: set[Kernel],
) -> bool:
    """Breadth-first search for an augmenting path from the unmatched left vertex `root`; flip it if found.

    BFS (not recursive DFS) so that deep DAGs cannot hit Python's recursion limit, and so that
    short augmenting paths, which disturb fewer existing chains, are found first.
    """
    parent: dict[Kernel, Kernel] = {}  # right vertex -> the left vertex it was reached from
    queue = deque([root])
    while queue:
        left = queue.popleft()
        for right in successors(left):
            owner = prev_of.get(right)
            if right in parent or (owner is not None and owner in locked):
                continue
            parent[right] = left
            if owner is not None:
                queue.append(owner)
                continue
            while True:  # free right vertex: flip the alternating path back to root
                left = parent[right]
                displaced = next_of.get(left)
                next_of[left], prev_of[right] = right, left
                if displaced is None:
                    return True
                right = displaced
    return False


def _merge_chains(
    chains: Sequence[Chain], critical: Sequence[Kernel], costs: Mapping[Kernel, float], streams: int
) -> dict[Kernel, int]:
    """Critical chain -> stream 0; other chains longest-first onto the least-loaded of streams 1..k-1."""
    on_critical = set(critical)

    def critical_weight(i: int) -> tuple[float, int]:
        # The count breaks ties between zero-cost kernels.
        members = [node for node in chains[i] if node in on_critical]
        return sum(costs[node] for node in members), len(members)

    first = max(range(len(chains)), key=critical_weight)
    rest = sorted((i for i in range(len(chains)) if i != first), key=lambda i: -sum(costs[n] for n in chains[i]))
    # Stream 0 is kept for the critical path so that other work cannot queue in front of it.
    targets = range(1, streams) if streams > 1 else range(1)
    load = [0.0] * streams
    used = [0] * streams
    stream_of = dict.fromkeys(chains[first], 0)
    for i in rest:
        # Empty streams first, so that all k streams get work even when costs are zero.
        s = min(targets, key=lambda t: (used[t] > 0, load[t], t))
        stream_of.update(dict.fromkeys(chains[i], s))
        load[s] += sum(costs[node] for node in chains[i])
        used[s] += 1
    return stream_of


def _issue_order(
    dag: nx.DiGraph, topo: Sequence[Kernel], costs: Mapping[Kernel, float], index: Mapping[Kernel, int],
    just_in_time: bool = False,
) -> list[Kernel]:
    """Topological order by earliest start time, which interleaves independent branches.

    A stream runs its kernels in issue order, so issuing a whole branch before its siblings would
    hold back the other streams' first kernels behind the host.

    `just_in_time` (one stream, where the order decides only how long buffers live): each kernel
    is issued as late as the earliest result it leads to is due, a result nothing reads being due
    at its own earliest start. A kernel that needs nothing but is read late (a backward's zeros
    that an embedding's gradient is accumulated into, 89 MiB for BERT-base) is then issued just
    before its reader instead of first, where its buffer was held through the whole graph.
    """
    start: dict[Kernel, float] = {}
    for v in topo:
        start[v] = max((start[u] + costs[u] for u in dag.predecessors(v)), default=0.0)
    if not just_in_time:
        return list(nx.lexicographical_topological_sort(dag, key=lambda node: (start[node], index[node])))
    due: dict[Kernel, tuple[float, int]] = {}
    for v in reversed(topo):
        due[v] = min((due[c] for c in dag.successors(v)), default=(start[v], index[v]))
    # among kernels due together, the one furthest along first: a kernel needing nothing goes last
    return list(nx.lexicographical_topological_sort(dag, key=lambda node: (due[node], -start[node], index[node])))


def _waits(
    dag: nx.DiGraph, order: Sequence[Kernel], stream_of: Mapping[Kernel, int], streams: int
) -> list[tuple[Kernel, Kernel]]:
    """Cross-stream waits that nothing else implies, found with vector clocks, in issue order of v.

    clock[s][t] = how many of stream t's kernels stream s's tail is known to run after. An event
    recorded right after u carries the clock of u's stream at that moment (`snapshot[u]`).
    Every wait kept is necessary: v's only happens-before inputs are the previous kernel on its
    stream and its waits, neither of which covers a kept candidate, so dropping it loses (u, v).
    """
    clock = [[0] * streams for _ in range(streams)]
    seq: dict[Kernel, int] = {}  # 1-based position of a kernel within its stream
    snapshot: dict[Kernel, tuple[int, ...]] = {}
    issued = {node: i for i, node in enumerate(order)}
    waits: list[tuple[Kernel, Kernel]] = []

    def covers(known: Sequence[int], u: Kernel) -> bool:
        return known[stream_of[u]] >= seq[u]

    for v in order:
        s = stream_of[v]
        mine = clock[s]
        candidates = [u for u in dag.predecessors(v) if stream_of[u] != s and not covers(mine, u)]
        # Drop u if another candidate's event already implies it. Two distinct candidates cannot
        # cover each other (happens-before is a partial order), so the result does not depend on order.
        needed = [u for u in candidates if not any(w != u and covers(snapshot[w], u) for w in candidates)]
        for u in sorted(needed, key=issued.__getitem__):
            waits.append((u, v))
            mine = [max(a, b) for a, b in zip(mine, snapshot[u])]
        mine[s] += 1
        seq[v] = mine[s]
        snapshot[v] = tuple(mine)
        clock[s] = mine
    return waits
