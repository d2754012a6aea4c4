"""Graphs with symbolic sizes through the backend: once Dynamo has seen a dimension change it hands
over a graph with SymInt sizes, and each concrete input signature under it gets its own plan,
traced from the graph at those sizes and built on first use (SymbolicGraph); and the graphs that
run as AOTAutograd handed them (EagerGraph). Split from capture/backend.py, which builds both."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from streamfuse.config import Config
from streamfuse.runtime.fallback import failure_text, warn_fallback
from streamfuse.runtime.memory import picker

if TYPE_CHECKING:
    from streamfuse.capture.backend import TrainingRole


def is_symbolic(gm: torch.fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt | torch.SymFloat | torch.SymBool):
            return True
        if isinstance(val, torch.Tensor) and any(not isinstance(s, int) for s in (*val.shape, *val.stride())):
            return True
    return False


def eager_runner(gm: torch.fx.GraphModule) -> Any:
    def run(*args: Any) -> list[Any]:
        return list(gm(*args))

    return run


class EagerGraph:
    """A graph the backend could not compile: it runs as AOTAutograd handed it."""

    def __init__(self, gm: torch.fx.GraphModule, reason: str):
        self.gm = gm
        self.reason = reason
        warn_fallback("a graph handed to the streamfuse backend", reason)
        self._run = eager_runner(gm)

    def run_flat(self, args: list[Any]) -> list[Any]:
        return self._run(*args)

    def explain(self, source: bool = True) -> str:
        return f"this graph runs eagerly (ATen): {self.reason}\n"


class SymbolicGraph:
    """A graph with symbolic sizes: one CompiledGraph per concrete input signature, each traced from
    the graph at those sizes (make_fx on fake tensors, so no data is read) and built on first use."""

    def __init__(self, gm: torch.fx.GraphModule, config: Config, static: list[int] | None = None,
                 training: TrainingRole | None = None):
        self.gm = gm
        self.config = config
        self.training = training
        """A training graph's role: each concrete plan replays CUDA graphs reading inputs in place."""
        self.static = static
        """AOTAutograd's static inputs (parameters, buffers) of an inference graph, possibly none: each
        concrete plan binds them at its first call (StaticParamsGraph), so it replays CUDA graphs.
        None for a training graph, or with Config.backend_cuda_graphs off."""
        self.plans: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self.built = 0
        """Plans built so far (evicted ones included): the number of compilations."""
        self.overflow: EagerGraph | None = None
        """Runs new shapes once Config.max_specializations_built plans were built."""
        self._keyed: Callable[[Sequence[Any]], tuple[Any, ...]] | None = None
        self._tensors: Callable[[Sequence[Any]], tuple[Any, ...]] | None = None
        """The arguments a plan is chosen by, and the tensor arguments (_positions, at the first call)."""

    def _positions(self, args: list[Any]) -> tuple[Callable[[Sequence[Any]], tuple[Any, ...]],
                                                    Callable[[Sequence[Any]], tuple[Any, ...]]]:
        """Which arguments choose the plan: the tensors whose placeholder has a symbolic size or
        stride, and every non-tensor argument (a SymInt's value). A tensor the graph holds at fixed
        sizes (every parameter and buffer) is guarded by Dynamo to keep its dtype, device, sizes and
        strides, and keying it cost ~0.5 µs per argument per call: 160 µs on a CPU for googlenet's 289
        arguments, at every call this graph serves (4.4 µs now; session 49). Types are fixed per
        graph, so the positions are too."""
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        vals = [n.meta.get("val", n.meta.get("example_value")) for n in placeholders]
        if len(vals) != len(args):
            vals = [None] * len(args)  # no metadata to trust: key every argument
        keyed = [i for i, (a, v) in enumerate(zip(args, vals, strict=True))
                 if not isinstance(a, torch.Tensor) or not isinstance(v, torch.Tensor) or _symbolic(v)]
        self._keyed = picker(keyed)
        self._tensors = picker([i for i, a in enumerate(args) if isinstance(a, torch.Tensor)])
        return self._keyed, self._tensors

    def run_flat(self, args: list[Any]) -> list[Any]:
        keyed, tensors = self._keyed, self._tensors
        if keyed is None or tensors is None:
            keyed, tensors = self._positions(args)
        key = tuple((tuple(a.shape), tuple(a.stride()), a.dtype, a.device) if isinstance(a, torch.Tensor) else a
                    for a in keyed(args))
        plan = self.plans.get(key)
        if plan is None and self.built >= self.config.max_specializations_built:
            if self.overflow is None:
                self.overflow = EagerGraph(self.gm, f"{self.built} concrete plans were compiled already "
                                                    "(Config.max_specializations_built): new shapes run eagerly")
            return self.overflow.run_flat(args)
        if plan is None:
            plan = self._specialize(args)
            self.plans[key] = plan
            while len(self.plans) > max(1, self.config.max_specializations):
                self.plans.popitem(last=False)
        else:
            self.plans.move_to_end(key)
        return plan.run_flat(list(tensors(args)))

    def _specialize(self, args: list[Any]) -> Any:
        from torch.fx.experimental.proxy_tensor import make_fx

        from streamfuse.capture.backend import StaticParamsGraph, compile_graph, training_graph

        self.built += 1
        tensor_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

        def at_these_sizes(*tensors: torch.Tensor) -> Any:
            full = list(args)
            for i, t in zip(tensor_at, tensors, strict=True):
                full[i] = t
            return self.gm(*full)

        tensors = [args[i] for i in tensor_at]
        try:
            with unset_fake_temporarily():
                traced = make_fx(at_these_sizes, tracing_mode="fake")(*tensors)
        except Exception as exc:  # noqa: BLE001 - trace failure: this signature runs eagerly
            return _TensorArgs(EagerGraph(self.gm, f"tracing at concrete sizes failed: {failure_text(exc)}"),
                               args, tensor_at)
        if self.static is not None:
            return StaticParamsGraph(traced, self.config, [tensor_at.index(i) for i in self.static if i in tensor_at])
        return training_graph(compile_graph(traced, tensors, self.config), _renamed(self.training, self.gm, traced,
                                                                                     tensor_at))

    def explain(self, source: bool = True) -> str:
        parts = [f"graph with symbolic sizes: {len(self.plans)} concrete plan(s) kept, {self.built} built"
                 + (" (Config.max_specializations_built reached: new shapes run eagerly)" if self.overflow else "")]
        parts += [p.explain(source) for p in self.plans.values()]
        return "\n".join(parts)


def _renamed(training: TrainingRole | None, gm: torch.fx.GraphModule, traced: torch.fx.GraphModule,
             tensor_at: list[int]) -> TrainingRole | None:
    """The role's static inputs under the names the graph traced at concrete sizes gives them: make_fx
    names its placeholders `arg<k>_1`, one per tensor argument, where AOTAutograd's were `primals_<i+1>`
    over every argument, sizes included. Matched by name, none was static: every parameter under
    64 KiB was copied in at each replay once a batch changed (a helper's emulated training graphs)."""
    if training is None or not training.static:
        return training
    before = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    after = [n.name for n in traced.graph.nodes if n.op == "placeholder"]
    if len(after) != len(tensor_at):
        return training  # not one placeholder per tensor: nothing to match by position (correct, slower)
    static = frozenset(name for i, name in zip(tensor_at, after, strict=True) if before[i] in training.static)
    return dataclasses.replace(training, static=static)


def _symbolic(value: torch.Tensor) -> bool:
    """A placeholder's (fake) tensor has a symbolic size, stride or storage offset (is_symbolic's test
    for sizes and strides, and the offset too: a plan is keyed by it where it can change)."""
    try:
        return any(not isinstance(d, int) for d in (*value.shape, *value.stride(), value.storage_offset()))
    except Exception:  # noqa: BLE001 - a layout without strides: key it
        return True


class _TensorArgs:
    """Runs an EagerGraph of the symbolic graph from the tensor arguments alone (the sizes fixed)."""

    def __init__(self, inner: EagerGraph, args: list[Any], tensor_at: list[int]):
        self.inner, self.args, self.tensor_at = inner, list(args), tensor_at

    def run_flat(self, tensors: list[Any]) -> list[Any]:
        full = list(self.args)
        for i, t in zip(self.tensor_at, tensors, strict=True):
            full[i] = t
        return self.inner.run_flat(full)

    def explain(self, source: bool = True) -> str:
        return self.inner.explain(source)
