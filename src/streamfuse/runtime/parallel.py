"""streamfuse.parallel: several independent models run concurrently, on their own streams, in
one CUDA graph (multi-model serving, multi-stream video pipelines).

The models' graphs are joined into one graph with no edges between them; the stream scheduler then
sees each model as an independent branch, and the whole schedule is captured once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from streamfuse.config import Config
from streamfuse.runtime.compiled import CallSpec, CompiledGraph, build


class ParallelModels:
    """Call with one tuple of inputs per model (or one tensor for a single-input model); returns
    a list with each model's output."""

    def __init__(self, compiled: CompiledGraph, counts: list[tuple[int, int]], specs: list[pytree.TreeSpec]):
        self.compiled = compiled
        self._counts = counts
        self._specs = specs

    def __call__(self, *per_model: Any) -> list[Any]:
        if len(per_model) != len(self._counts):
            raise ValueError(f"expected inputs for {len(self._counts)} models, got {len(per_model)}")
        flat: list[Any] = []
        for i, (item, (n_in, _)) in enumerate(zip(per_model, self._counts, strict=True)):
            group = (item,) if isinstance(item, torch.Tensor) else tuple(item)
            if len(group) != n_in:
                raise ValueError(f"model {i}: expected {n_in} input tensor(s), got {len(group)}")
            flat += group
        outs = self.compiled(*flat)
        result, at = [], 0
        for (_, n_out), spec in zip(self._counts, self._specs, strict=True):
            result.append(pytree.tree_unflatten(outs[at: at + n_out], spec))
            at += n_out
        return result

    @property
    def stats(self) -> dict[str, Any]:
        return self.compiled.stats

    def explain(self, source: bool = True) -> str:
        return self.compiled.explain(source=source)


def parallel(models: Sequence[tuple[torch.nn.Module | Callable[..., Any], Any]],
             config: Config | None = None) -> ParallelModels:
    from streamfuse.capture.export import capture, normalize_inputs
    from streamfuse.ir.fold import SnapshotCache, watchable
    from streamfuse.ir.from_fx import graph_from_fx
    from streamfuse.ir.graph import disjoint_union
    from streamfuse.ir.weight_fold import fold_model_weights
    from streamfuse.runtime.inputs import graph_device

    if not models:
        raise ValueError("models must be a non-empty list of (model, example_inputs) pairs")
    config = config or Config()
    snapshots = SnapshotCache()  # the same model passed twice shares one copy of its folded weights
    graphs, counts, specs, names = [], [], [], []
    for i, pair in enumerate(models):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise ValueError(f"models[{i}] must be a (model, example_inputs) pair")
        model, example = pair
        inputs = normalize_inputs(example)
        captured = capture(model, inputs)
        if captured.mutated:
            raise ValueError(f"models[{i}] updates buffers in place (training-mode batch-norm?): "
                             "streamfuse.parallel takes inference models")
        graph = graph_from_fx(captured.gm, captured.bound, captured.literals)
        if watchable(captured.bound.values()):  # else no snapshot: it could not follow the weights
            fold_model_weights(graph, snapshots, config)
        graphs.append(graph)
        counts.append((len(graph.inputs), len(graph.outputs)))
        specs.append(captured.out_spec)
        names += [f"models[{i}] {name}" for name in captured.input_names]
    device = graph_device(graphs[0], normalize_inputs(models[0][1]))
    merged = disjoint_union(graphs, [f"m{i}_" for i in range(len(graphs))])
    compiled = build(merged, config, device, CallSpec(out_spec=None, input_names=names), recapture=None)
    compiled.weights_watch = snapshots.watch(*(pair[0] for pair in models))
    return ParallelModels(compiled, counts, specs)
