"""The fusion planner: greedy producer->consumer merging over the whole graph.

Candidate edges are tried largest producer first (bytes kept out of device memory, Inductor's
score_fusion order), repeatedly until nothing merges. A merge happens when legality accepts
the union and it creates no cycle between groups. Every edge left between two groups gets a
Refusal with its reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import networkx as nx

from streamfuse.config import Config
from streamfuse.fusion.geometry import (
    SPLITS,
    Resources,
    branched_inputs,
    estimate,
    recompute_refusal,
    resource_refusal,
)
from streamfuse.fusion.groups import Group, GroupKind, Plan, Refusal, read_bytes
from streamfuse.fusion.horizontal import pack_horizontal
from streamfuse.fusion.legality import KernelShape, check_group, node_refusal
from streamfuse.fusion.strategy import MatmulChoice, choose_matmuls
from streamfuse.ir.graph import Graph, Node
from streamfuse.ir.ops import OpKind


def plan_fusion(graph: Graph, config: Config, choices: Mapping[Node, MatmulChoice] | None = None,
                sm_count: int = 132) -> Plan:
    """`choices`: how each supported contraction runs (fusion/strategy.py); None asks the cost model
    with the built-in device ceilings. `sm_count` sizes reduction grids for the resource estimates."""
    ops = graph.ops()
    position = {n: i for i, n in enumerate(graph.nodes)}
    outputs = set(graph.output_nodes)
    state = _Partition(ops, position, sm_count)
    if choices is None:
        choices = choose_matmuls(graph, config)

    def refusal(n: Node) -> str | None:
        reason = node_refusal(n, config)
        if reason is None and n.kind is OpKind.CONTRACTION and choices[n].strategy != "triton":
            return f"{n.op} runs through cuBLAS ({choices[n].reason})"
        return reason

    fusible = {n: config.fuse and refusal(n) is None for n in ops}
    edges = sorted(
        ((p, c) for c in ops for p in c.input_nodes() if p in state.group_of),
        key=lambda e: (-e[0].numel * e[0].itemsize, position[e[1]]),
    )
    fuel = config.fusion_fuel
    merges = 0
    changed = True
    while changed and (fuel is None or merges < fuel):
        changed = False
        for p, c in edges:
            if fuel is not None and merges >= fuel:
                break
            if not (fusible[p] and fusible[c]) or state.group_of[p] == state.group_of[c]:
                continue
            verdict = _merge_check(state, p, c, outputs, config)
            if not isinstance(verdict, str):
                state.merge(state.group_of[p], state.group_of[c], split=verdict)
                merges += 1
                changed = True
    if config.fuse and config.sibling_reductions:
        merges += _merge_sibling_reductions(state, outputs, config)

    refusals = []
    for p, c in edges:
        if state.group_of[p] == state.group_of[c]:
            continue
        if not config.fuse:
            reason = "fusion disabled (Config.fuse=False)"
        elif not fusible[p]:
            reason = f"producer {refusal(p)}"
        elif not fusible[c]:
            reason = f"consumer {refusal(c)}"
        else:
            verdict = _merge_check(state, p, c, outputs, config)
            reason = verdict if isinstance(verdict, str) else "fusion fuel exhausted"
        refusals.append(Refusal(p, c, reason))

    groups = _build_groups(state, graph, outputs, config, refusal)
    for g in groups:
        if g.contraction is not None:
            g.note = choices[g.contraction].reason
    if config.fuse and config.horizontal_fusion:
        groups = pack_horizontal(groups, position, config)
    return Plan(graph=graph, groups=groups, refusals=refusals, merges=merges, matmul_choices=dict(choices))


class _Partition:
    """Node -> group id, with the group DAG queries the planner needs."""

    def __init__(self, ops: list[Node], position: dict[Node, int], sm_count: int):
        self.position = position
        self.sm_count = sm_count
        self.split: dict[int, int] = {}
        """Group id -> per-thread work divisor chosen when it was merged (fusion/geometry.py)."""
        self.group_of: dict[Node, int] = {n: i for i, n in enumerate(ops)}
        self.members: dict[int, list[Node]] = {i: [n] for i, n in enumerate(ops)}
        # the group DAG's edges, kept up to date by merge (the cycle check walks them thousands of
        # times: recomputing them from the members' users was most of a 16-layer Llama's planning)
        self._succ: dict[int, set[int]] = {
            i: {self.group_of[u] for u in n.users if u in self.group_of} - {i} for i, n in enumerate(ops)}
        self._pred: dict[int, set[int]] = {i: set() for i in self._succ}
        for g, succ in self._succ.items():
            for s in succ:
                self._pred[s].add(g)

    def merge(self, a: int, b: int, split: int) -> None:
        """Group b joins group a, which launches with per-thread work divided by `split`."""
        self.split[a] = split
        self.split.pop(b, None)
        for n in self.members[b]:
            self.group_of[n] = a
        self.members[a] = sorted(self.members[a] + self.members.pop(b), key=self.position.__getitem__)
        succ_b, pred_b = self._succ.pop(b), self._pred.pop(b)
        for s in succ_b:
            self._pred[s].discard(b)
            if s != a:
                self._pred[s].add(a)
        for q in pred_b:
            self._succ[q].discard(b)
            if q != a:
                self._succ[q].add(a)
        self._succ[a] = (self._succ[a] | succ_b) - {a, b}
        self._pred[a] = (self._pred[a] | pred_b) - {a, b}

    def successors(self, g: int) -> set[int]:
        return self._succ[g]

    def path_through_other(self, src: int, dst: int) -> int | None:
        """A group on a path src -> X -> dst (X not src or dst), if any: merging would make a cycle."""
        # such a path leaves src through another successor and enters dst through another
        # predecessor: without either (a chain, most merges), no walk is needed
        if not self._succ[src] - {dst} or not self._pred[dst] - {src}:
            return None
        stack = [s for s in self.successors(src) if s != dst]
        seen = set(stack)
        while stack:
            g = stack.pop()
            for s in self.successors(g):
                if s == dst:
                    return g
                if s not in seen:
                    seen.add(s)
                    stack.append(s)
        return None


def _merge_check(state: _Partition, p: Node, c: Node, outputs: set[Node], config: Config) -> str | int:
    """Why p's and c's groups cannot merge, or the per-thread work divisor (split) they merge with."""
    gp, gc = state.group_of[p], state.group_of[c]
    via = state.path_through_other(gp, gc)
    if via is not None:
        first = state.members[via][0]
        return f"merging would create a cycle through the group of %{first.name}"
    return _union_verdict(state, gp, gc, outputs, config)


def _union_verdict(state: _Partition, gp: int, gc: int, outputs: set[Node], config: Config,
                   kind: GroupKind | None = None) -> str | int:
    """Why groups gp and gc (no cycle between them) cannot be one kernel (of `kind`, where given),
    or the split they merge with."""
    union = sorted(state.members[gp] + state.members[gc], key=state.position.__getitem__)
    result = check_group(union, outputs, config)
    if isinstance(result, str):
        return result
    if kind is not None and result.kind is not kind:
        return f"the union is a {result.kind.value} kernel, not a {kind.value} one"
    if result.kind not in (GroupKind.POINTWISE, GroupKind.REDUCTION):
        return 1  # the matmul template's tile is held to the limits by the tuner instead
    recompute = recompute_refusal(union, config)
    if recompute is not None:
        return recompute
    parts = [(check_group(state.members[g], outputs, config), state.split.get(g, 1)) for g in (gp, gc)]
    # The occupancy rule compares pointwise fusions with the pointwise kernels they replace (same
    # geometry: only register pressure changes). Fused persistent reductions keep only the hard
    # limits: the seeds waive the rule where measurement shows the fusion faster, and on the H200
    # softmax and layer_norm fused into one kernel reach 94% and 90% of copy bandwidth (PERF.md,
    # runs 5-13) at occupancies this estimate puts 20-35% below the unfused kernels'.
    # A pointwise kernel over Config.pointwise_no_split_from elements or more keeps only the hard
    # limits too: dividing its per-thread work restores the estimated occupancy but not the loads in
    # flight per SM, which bound a memory-bound kernel (run 98: densenet's cat + batch-norm + ReLU at
    # batch 32 ran at 1679 GB/s split to 2 elements per thread, 3883 GB/s with 8).
    large = result.kind is GroupKind.POINTWISE and 0 < config.pointwise_no_split_from <= math.prod(result.shape)
    replaced = [(_resources(p, config, state.sm_count, split, state.members[g]), _bytes(p, state.members[g]))
                for (p, split), g in zip(parts, (gp, gc), strict=True)
                if not large and not isinstance(p, str) and p.kind is GroupKind.POINTWISE is result.kind]
    reason = None
    for split in SPLITS:  # refuse only if spreading the work over more threads cannot restore occupancy
        reason = resource_refusal(_resources(result, config, state.sm_count, split, union), replaced, config)
        if reason is None:
            return split
    return f"resources: {reason}"


def _merge_sibling_reductions(state: _Partition, outputs: set[Node], config: Config) -> int:
    """Merge reduction groups over one domain that read the same full-size input and depend on
    each other in neither direction (Config.sibling_reductions): a batch norm's backward sums the
    gradient and the gradient times the centred input per channel, two kernels that each read the
    gradient when no generated producer joins them (the gradient is a graph input, or an ATen
    convolution's backward result with no ReLU mask between; run 199: 96.7 µs for resnet50's
    first-stage shape at batch 32 in two kernels against Inductor's 69.8 in one, 79.3 in one kernel
    in run 200; resnet50 itself has a ReLU mask after every batch norm, so its step did not move).
    Larger shared inputs first; returns the merges made."""
    shapes = {g: check_group(m, outputs, config) for g, m in state.members.items()
              if any(n.kind is OpKind.REDUCTION for n in m)}
    readers: dict[Node, list[int]] = {}
    for g, shape in shapes.items():
        if isinstance(shape, KernelShape) and shape.kind is GroupKind.REDUCTION and shape.domain is not None:
            for x in shape.inputs:
                if x.shape == shape.domain.shape:
                    readers.setdefault(x, []).append(g)
    merges = 0
    for x in sorted(readers, key=lambda n: (-n.numel * n.itemsize, state.position[n])):
        merges += _merge_readers(state, readers[x], outputs, config)
    # then reductions over one domain whose full-size inputs are all results or inputs of one other
    # group (so all are in memory at once, and merging keeps none alive longer): a layer norm's
    # backward sums the gradient and the gradient times the normalised input over the batch and
    # sequence dims, two results of its row kernel, or one result and the gradient it read (run 222:
    # 48 calls of ~11 µs per BERT-base training step, two per layer norm)
    beside: dict[int, list[int]] = {}
    for g, m in list(state.members.items()):
        if not any(n.kind is OpKind.REDUCTION for n in m):
            continue
        shape = check_group(m, outputs, config)
        if not isinstance(shape, KernelShape) or shape.kind is not GroupKind.REDUCTION or shape.domain is None:
            continue
        around: set[int] | None = None
        for x in shape.inputs:
            if x.shape == shape.domain.shape:
                near = {state.group_of[u] for u in x.users if u in state.group_of} | (
                    {state.group_of[x]} if x in state.group_of else set())
                around = near if around is None else around & near
        for other in sorted((around or set()) - {g}):
            beside.setdefault(other, []).append(g)
    for other in sorted(beside):
        merges += _merge_readers(state, beside[other], outputs, config)
    return merges


def _merge_readers(state: _Partition, groups: list[int], outputs: set[Node], config: Config) -> int:
    """Merge each of `groups` (reduction groups) into the first it can join; returns the merges made."""
    merges = 0
    alive = [g for g in groups if g in state.members]
    while len(alive) > 1:
        a, rest = alive[0], []
        for b in alive[1:]:
            verdict = _sibling_verdict(state, a, b, outputs, config)
            if isinstance(verdict, str):
                rest.append(b)
            else:
                state.merge(a, b, split=verdict)
                merges += 1
        alive = rest
    return merges


def _sibling_verdict(state: _Partition, a: int, b: int, outputs: set[Node], config: Config) -> str | int:
    """`_union_verdict` for two groups with no edge between them, or why not (a path either way)."""
    for src, dst in ((a, b), (b, a)):
        if dst in state.successors(src) or state.path_through_other(src, dst) is not None:
            return "one depends on the other"
    return _union_verdict(state, a, b, outputs, config, GroupKind.REDUCTION)


def _resources(shape: KernelShape, config: Config, sm_count: int, split: int, nodes: list[Node]) -> Resources:
    reductions = sum(1 for n in shape.outputs if n.kind is OpKind.REDUCTION) or (shape.domain is not None)
    return estimate(shape.kind, list(shape.inputs), list(shape.outputs), shape.shape, shape.domain,
                    int(reductions), config, sm_count, split=split,
                    branched=branched_inputs(shape.kind, nodes, list(shape.inputs), config))


def _bytes(shape: KernelShape, nodes: list[Node]) -> float:
    return sum(read_bytes(n, nodes) for n in shape.inputs) + float(sum(n.numel * n.itemsize for n in shape.outputs))


def _build_groups(state: _Partition, graph: Graph, outputs: set[Node], config: Config,
                  refusal: Callable[[Node], str | None]) -> list[Group]:
    dag: nx.DiGraph = nx.DiGraph()
    for gid in state.members:
        dag.add_node(gid)
        for s in state.successors(gid):
            dag.add_edge(gid, s)
    first = {gid: state.position[m[0]] for gid, m in state.members.items()}
    order = list(nx.lexicographical_topological_sort(dag, key=first.__getitem__))
    groups = []
    for new_id, gid in enumerate(order):
        nodes = state.members[gid]
        groups.append(_make_group(new_id, nodes, outputs, config, refusal))
        groups[-1].split = state.split.get(gid, 1)
    return groups


def _make_group(gid: int, nodes: list[Node], outputs: set[Node], config: Config,
                refusal: Callable[[Node], str | None]) -> Group:
    head = nodes[0]
    if len(nodes) == 1 and head.kind in (OpKind.VIEW, OpKind.BROADCAST, OpKind.GETITEM):
        return _single(gid, GroupKind.ALIAS, head)
    if len(nodes) == 1 and head.kind is OpKind.CONTRACTION and refusal(head) is not None:
        group = _single(gid, GroupKind.ATEN, head)  # a product with nothing fused runs through ATen
        group.note = refusal(head) or "no epilogue fused into it: cuBLAS alone is faster"
        return group
    shape = check_group(nodes, outputs, config)
    if isinstance(shape, str):  # only a lone node lands here: merged groups passed this check
        group = _single(gid, GroupKind.ATEN, head)
        group.note = refusal(head) or shape
        return group
    return Group(gid, shape.kind, nodes, inputs=list(shape.inputs), outputs=list(shape.outputs),
                 shape=shape.shape, domain=shape.domain, contraction=shape.contraction)


def _single(gid: int, kind: GroupKind, node: Node) -> Group:
    inputs = [a for a in node.input_nodes() if a.is_tensor]
    return Group(gid, kind, [node], inputs=inputs, outputs=[node])
