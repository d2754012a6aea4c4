"""streamfuse: make PyTorch models faster on NVIDIA GPUs by fusing ops into generated Triton kernels.

    compiled = streamfuse.compile(model, example_inputs)
    out = compiled(*inputs)
    print(compiled.explain())

or `torch.compile(model, backend="streamfuse")`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from streamfuse.capture.backend import make_backend, register, streamfuse_backend
from streamfuse.config import Config
from streamfuse.fusion.resources import occupancy
from streamfuse.profile.api import predict
from streamfuse.profile.api import profile as _profile
from streamfuse.runtime.compiled import CallSpec, CompiledGraph
from streamfuse.runtime.fallback import BackendFallback, EagerFallback, StreamfuseFallbackWarning
from streamfuse.runtime.memory import PointerCheck
from streamfuse.runtime.parallel import ParallelModels, parallel

__version__ = "0.1.0"
backend = streamfuse_backend


def compile(
    model: torch.nn.Module | Callable[..., Any],
    example_inputs: Any,
    config: Config | None = None,
) -> CompiledGraph | EagerFallback | BackendFallback:
    """Capture `model` (or a torch.export ExportedProgram's module) on `example_inputs`, fuse,
    generate kernels; returns a CompiledGraph that takes tensors like `example_inputs` (positional,
    or by the model's parameter names) and returns what model returns. `example_inputs`: a tensor,
    a tuple of tensors (the first positional parameters), or a dict of tensors by parameter name
    (`{"input_ids": ids, "attention_mask": mask}`: the compiled model then takes them in that order
    or by those names); an input that is not a tensor (a list of images, a DynamicCache, a flag such
    as `output_hidden_states=True`) sends the model through the backend (below). A call with other
    shapes or dtypes gets a plan of its own (Config.max_specializations). A model that cannot be captured
    as one graph runs through `torch.compile(model, backend="streamfuse")` instead (a BackendFallback:
    Dynamo splits it where it must), and one that fails there too, or in planning, runs eagerly (an
    EagerFallback); each warns once, naming the reason."""
    if config is not None and not isinstance(config, Config):
        raise ValueError(f"config must be a streamfuse.Config, got {type(config).__name__}")
    if isinstance(model, torch.export.ExportedProgram):  # cannot be called itself; its module can
        model = model.module()
    if isinstance(model, torch.jit.ScriptModule | torch.jit.ScriptFunction):
        raise ValueError(f"model is a TorchScript {type(model).__name__} (torch.jit.script or torch.jit.trace), which "
                         "neither streamfuse nor torch.compile can capture; pass the original nn.Module or function")
    if not callable(model):
        raise ValueError(f"model must be an nn.Module or a callable, got {type(model).__name__}")
    from streamfuse.capture.export import keyword_model, non_tensor_input, normalize_inputs

    other = non_tensor_input(example_inputs)
    if other is not None:  # a list of images (torchvision's detection models), a KV cache, a flag, ...
        return BackendFallback(model, f"{other}: such inputs go through Dynamo, which guards them at every call",
                               config or Config())
    if isinstance(example_inputs, dict):
        model, example_inputs = keyword_model(model, example_inputs)
    return _compile_for(model, normalize_inputs(example_inputs), config or Config(), through_backend=True)


def _compile_for(model: Any, inputs: tuple[torch.Tensor, ...], config: Config,
                 through_backend: bool = False) -> CompiledGraph | EagerFallback | BackendFallback:
    """`through_backend`: a model whose capture fails goes through the torch.compile backend (the
    entry point); a specialization of a compiled model (a new shape) runs eagerly instead."""
    from streamfuse.runtime.fallback import failure_text

    start = time.perf_counter()
    try:
        compiled = _build(model, inputs, config)
    except Exception as exc:  # noqa: BLE001 - a model eager runs never fails to "compile"
        reason = f"capture or planning failed: {failure_text(exc)}"
        return BackendFallback(model, reason, config) if through_backend else EagerFallback(model, reason)
    compiled.compile_s = time.perf_counter() - start
    return compiled


def _build(model: Any, inputs: tuple[torch.Tensor, ...], config: Config) -> CompiledGraph:
    from streamfuse.capture.export import Captured, KeywordInputs, capture
    from streamfuse.ir.batch import batch_rows, batch_signature, batch_sized, differs_beyond_batch, padded_outputs
    from streamfuse.ir.fold import SnapshotCache, watchable
    from streamfuse.ir.from_fx import graph_from_fx
    from streamfuse.ir.graph import Graph
    from streamfuse.ir.weight_fold import fold_model_weights
    from streamfuse.runtime.compiled import build
    from streamfuse.runtime.executable import build_executable
    from streamfuse.runtime.inputs import graph_device
    from streamfuse.runtime.structure import StructureWatch, autocast_state, tf32_baked

    snapshots = SnapshotCache()

    def convert(cap: Captured) -> Graph:
        """Captured -> Graph, its weights folded (ir/weight_fold.fold_model_weights); every batch
        bucket shares one snapshot of the folded and stacked weights."""
        graph = graph_from_fx(cap.gm, cap.bound, cap.literals)
        if watchable(cap.bound.values()):  # else no snapshot: it could not follow the weights
            fold_model_weights(graph, snapshots, config)
        return graph

    start = time.perf_counter()
    captured = capture(model, inputs)
    graph = convert(captured)
    device = graph_device(graph, inputs)
    capture_s = time.perf_counter() - start

    signature = batch_signature(graph)  # before build_executable rewrites the graph for its device
    base_batch = inputs[0].shape[0] if inputs and inputs[0].dim() > 0 else 0

    traced: dict[int, Graph] = {}
    """Graphs batch_check traced, for the bucket capture that may follow at the same batch."""
    signatures: dict[int, list[Any]] = {base_batch: signature} if base_batch >= 2 else {}
    """Signatures of the captures at batch sizes of at least 2 (a trace at batch 1 may drop size-1 views)."""

    def traced_at(batch: int) -> Graph:
        traced[batch] = convert(capture(model, tuple(torch.zeros((batch,) + t.shape[1:], dtype=t.dtype,
                                                                 device=t.device) for t in inputs)))
        signatures.setdefault(batch, batch_signature(traced[batch]))
        return traced[batch]

    def compare(sig: list[Any], batch: int, other: Graph, other_batch: int) -> frozenset[Any]:
        """Raises where `other` is not the graph at `batch` with the batch changed; else the nodes
        of `other` whose dim 0 follows the batch."""
        traced_sig = signatures.get(other_batch)  # a graph traced_at made: its signature is taken
        other_sig = traced_sig if traced_sig is not None and traced.get(other_batch) is other else \
            batch_signature(other)
        reason = differs_beyond_batch(sig, other_sig, batch, other_batch)
        if reason is not None:
            raise ValueError(f"the model is not the same function of the batch: {reason}")
        return batch_sized(sig, other, other_sig)

    def at_batch(examples: list[torch.Tensor]) -> Graph:
        """The same model captured at another batch size, compared with a capture at a third batch
        size of at least 2 (the compiled one where it is); its outputs' padding read from the graph
        as captured, before the device's rewrites fold what was made with the batch's size."""
        batch = examples[0].shape[0]
        other = traced.get(batch) or convert(capture(model, tuple(examples)))
        reference = next((b for b in signatures if b != batch), None)
        if batch >= 2 and reference is not None:
            analysis = batch_rows(other, compare(signatures[reference], reference, other, batch))
            if isinstance(analysis, str):
                raise ValueError(f"batch {batch} cannot be padded: {analysis}")
            other.padded_outputs = padded_outputs(other, analysis)
        traced.pop(batch, None)
        return other

    def batch_check(batch: int) -> list[int | None]:
        """Once, before any padding: the model traced at two batch sizes of at least 2 differs only
        where the batch is a size (ir/batch.py: a batch size the trace made a number is a
        ValueError). Returns the outputs' padding (ir/batch.padded_outputs) of the graph as captured,
        for the compiled plan, which serves the smaller batches of its bucket padded."""
        if base_batch >= 2:
            other = batch if batch >= 2 else base_batch + 1
            graph = traced_at(other)
            follows = compare(signature, base_batch, graph, other)
        else:
            first = max(batch, 2)
            graph = traced_at(first + 1)
            follows = compare(batch_signature(traced_at(first)), first, graph, first + 1)
        analysis = batch_rows(graph, follows)
        if isinstance(analysis, str):
            raise ValueError(f"the batch cannot be padded: {analysis}")
        return padded_outputs(graph, analysis)

    def recapture(examples: list[torch.Tensor]) -> Any:
        """The same model captured at another batch size (a batch bucket)."""
        return build_executable(at_batch(examples), config, device)

    def specialize(examples: tuple[torch.Tensor, ...]) -> CompiledGraph | EagerFallback:
        """The same model compiled for inputs of other shapes or dtypes."""
        return _compile_for(model, examples, config.replace(max_specializations=0))

    call = CallSpec(out_spec=captured.out_spec, mutated=captured.mutated, input_names=captured.input_names)
    compiled = build(graph, config, device, call, recapture=None if captured.mutated else recapture,
                     specialize=specialize, eager=model, batch_check=batch_check)
    user_model = model.model if isinstance(model, KeywordInputs) else model
    compiled.weights_watch = snapshots.watch(user_model)
    compiled.bound_tensors = [t for name, t in captured.bound.items()
                              if name not in captured.literals and isinstance(t, torch.Tensor) and not t.is_meta]
    compiled.bound_pointers = PointerCheck(compiled.bound_tensors, list(range(len(compiled.bound_tensors))))
    if isinstance(user_model, torch.nn.Module):
        compiled.mode_source, compiled.compiled_training = user_model, user_model.training
        compiled.structure = StructureWatch(user_model)
    compiled.autocast = autocast_state(device.type)
    compiled.tracks_tf32, compiled.tf32_baked = True, tf32_baked(compiled.base.graph, device.type)
    compiled.base.compile_times = {"capture": capture_s, **compiled.base.compile_times}
    compiled.capture_path = captured.how
    return compiled


register()

profile = _profile  # the function shadows the subpackage's attribute on purpose: streamfuse.profile()

__all__ = [
    "BackendFallback", "CompiledGraph", "Config", "EagerFallback", "ParallelModels", "StreamfuseFallbackWarning", "backend", "compile", "make_backend", "occupancy", "parallel",
    "predict", "profile",
]
