"""CompiledGraph: the callable streamfuse hands back, and `build`, which makes one from a Graph.

`build` is the flat driver of the pipeline after capture, read top to bottom:
plan fusion -> generate and load kernels -> lay out steps -> precompute buffer lifetimes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from streamfuse.codegen.kernel import KernelSource, generate
from streamfuse.config import Config
from streamfuse.fusion.groups import GroupKind, Plan
from streamfuse.fusion.planner import plan_fusion
from streamfuse.ir.graph import Graph, Node
from streamfuse.runtime.steps import KernelStep, NodeStep, Step, make_kernel_step

DEFAULT_SM_COUNT = 132  # H200; used for planning when no GPU is present


@dataclass
class CallSpec:
    """How user-facing arguments and results map to the graph's flat inputs and outputs."""

    out_spec: pytree.TreeSpec | None = None
    """Rebuild the model's output structure; None returns the flat list."""
    mutated: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """(flat output index, tensor): results that update a buffer in place, as eager would."""
    input_names: list[str] | None = None
    """Names for error messages (the model's parameter names); None uses the graph's."""


def resolve_executor(config: Config, device: torch.device) -> str:
    if config.executor != "auto":
        if config.executor == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("Config.executor='triton' on CPU tensors needs TRITON_INTERPRET=1 set before "
                             "triton is imported; use executor='reference' or 'auto'")
        return config.executor
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return "triton"
    return "reference"


def graph_device(graph: Graph, example_inputs: Sequence[Any]) -> torch.device:
    for t in list(example_inputs) + list(graph.constants.values()):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def build(graph: Graph, config: Config, device: torch.device, call: CallSpec | None = None) -> CompiledGraph:
    executor = resolve_executor(config, device)
    sm_count = (torch.cuda.get_device_properties(device).multi_processor_count
                if device.type == "cuda" else DEFAULT_SM_COUNT)
    target = "cuda" if device.type == "cuda" else "interpret"
    # 1. which nodes share a kernel, and why others do not
    plan = plan_fusion(graph, config)
    # 2. Triton source for each generated group (always, so explain() shows it on any machine)
    sources = {g.id: generate(g, config, target, sm_count) for g in plan.groups if g.kind.generated}
    # 3. one step per group; generated kernels are compiled (cached by content hash) when used
    slot = {n: i for i, n in enumerate(graph.nodes)}
    steps: list[Step] = []
    for g in plan.groups:
        if g.kind.generated and executor == "triton":
            from streamfuse.codegen.cache import load_kernel

            kernel = load_kernel(sources[g.id].fn_name, sources[g.id].source, config.cache_dir)
            steps.append(make_kernel_step(g, sources[g.id], kernel, slot, device))
        else:
            steps.append(NodeStep(g, slot))
    return CompiledGraph(graph, plan, steps, sources, config, device, executor, call or CallSpec())


class CompiledGraph:
    """A captured, planned and generated graph. Call it like the model it came from."""

    def __init__(self, graph: Graph, plan: Plan, steps: list[Step], sources: dict[int, KernelSource],
                 config: Config, device: torch.device, executor: str, call: CallSpec):
        self.graph = graph
        self.plan = plan
        self.steps = steps
        self.sources = sources
        self.config = config
        self.device = device
        self.executor = executor
        self.call = call
        self._slot = {n: i for i, n in enumerate(graph.nodes)}
        self._input_slots = [self._slot[n] for n in graph.inputs]
        self._constants = [(self._slot[n], t) for n, t in graph.constants.items()]
        self._release = self._release_lists()
        self._out_slots = [self._slot[o] if isinstance(o, Node) else None for o in graph.outputs]

    # -- calling ------------------------------------------------------------------------
    def __call__(self, *inputs: Any) -> Any:
        flat = self.run_flat(list(inputs))
        for index, target in self.call.mutated:
            target.copy_(flat[index])
        if self.call.out_spec is None:
            return flat
        mutated = {m for m, _ in self.call.mutated}
        user = [v for i, v in enumerate(flat) if i not in mutated]
        return pytree.tree_unflatten(user, self.call.out_spec)

    def run_flat(self, inputs: list[Any]) -> list[Any]:
        """Run on the graph's flat inputs; returns the flat outputs (the backend's convention)."""
        if self.config.check_inputs:
            inputs = self._check(inputs)
        env: list[Any] = [None] * len(self.graph.nodes)
        for s, t in zip(self._input_slots, inputs, strict=True):
            env[s] = t
        for s, t in self._constants:
            env[s] = t
        for step, release in zip(self.steps, self._release, strict=True):
            step.run(env)
            for s in release:
                env[s] = None
        return [env[s] if s is not None else o for s, o in zip(self._out_slots, self.graph.outputs, strict=True)]

    def _check(self, inputs: list[Any]) -> list[Any]:
        expected = self.graph.inputs
        if len(inputs) != len(expected):
            raise ValueError(f"expected {len(expected)} input tensor(s), got {len(inputs)}")
        checked = inputs
        for i, (t, node) in enumerate(zip(inputs, expected, strict=True)):
            if (not isinstance(t, torch.Tensor) or t.shape != node.shape or t.dtype != node.dtype
                    or t.device != self.device):
                self._raise_bad_input(i, t, node)
            if not t.is_contiguous() and _is_contiguous(node):
                checked = list(checked) if checked is inputs else checked
                checked[i] = t.contiguous()  # documented copy: the plan was traced with a contiguous input
        return checked

    def _raise_bad_input(self, i: int, t: Any, node: Node) -> None:
        name = (self.call.input_names or [n.name for n in self.graph.inputs])[i]
        where = f"input {i} ({name})"
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where}: expected a {node.dtype} tensor of shape {tuple(node.shape)} on "
                             f"{self.device}, got {type(t).__name__}")
        if tuple(t.shape) != node.shape:
            raise ValueError(f"{where}: expected shape {tuple(node.shape)}, got {tuple(t.shape)}"
                             " (shapes are fixed at compile time; compile again for a new shape)")
        if t.dtype != node.dtype:
            raise ValueError(f"{where}: expected dtype {node.dtype}, got {t.dtype}")
        raise ValueError(f"{where}: expected device {self.device}, got {t.device}")

    def _release_lists(self) -> list[list[int]]:
        """After step i, the slots whose last reader is step i (never graph outputs or inputs)."""
        last: dict[int, int] = {}
        for i, step in enumerate(self.steps):
            for node in step.group.nodes:
                last[self._slot[node]] = max(last.get(self._slot[node], i), i)
                for a in node.input_nodes():
                    last[self._slot[a]] = i
        keep = {self._slot[o] for o in self.graph.output_nodes}
        keep |= set(self._input_slots) | {s for s, _ in self._constants}
        release: list[list[int]] = [[] for _ in self.steps]
        for s, i in last.items():
            if s not in keep:
                release[i].append(s)
        return release

    # -- introspection ------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, Any]:
        groups = self.plan.groups
        generated = [g for g in groups if g.kind.generated]
        return {
            "source_ops": self.graph.source_ops,
            "kernels": sum(g.launches for g in groups),
            "generated_kernels": len(generated),
            "aten_kernels": sum(1 for g in groups if g.kind is GroupKind.ATEN),
            "fused_groups": sum(1 for g in generated if len(g.nodes) > 1),
            "refused_fusions": len(self.plan.refusals),
            "executor": self.executor,
            "device": str(self.device),
        }

    def explain(self, source: bool = True) -> str:
        from streamfuse.runtime.explain import explain_plan

        return explain_plan(self, source=source)

    def __repr__(self) -> str:
        s = self.stats
        return (f"CompiledGraph({s['source_ops']} ops -> {s['kernels']} kernels, "
                f"{s['generated_kernels']} generated, executor={self.executor}, device={self.device})")


def _is_contiguous(node: Node) -> bool:
    from streamfuse.ir.indexing import contiguous_strides

    return all(st == c for st, c, size in zip(node.strides, contiguous_strides(node.shape), node.shape, strict=True)
               if size != 1)


__all__ = ["CallSpec", "CompiledGraph", "KernelStep", "NodeStep", "build", "graph_device"]
