"""CompiledGraph: the callable streamfuse hands back.

On CUDA (with Config.cuda_graphs) a call picks the graph for its batch bucket, copies the inputs
into that graph's static buffers and replays it; a graph is recorded on first use of its bucket
(least recently used evicted beyond Config.max_graphs, and the least recently replayed graphs of
any model dropped beyond Config.graph_memory_fraction of the device's memory: runtime/memory.py).
A call that runs out of device memory drops the recorded graphs and runs again. Padding up to a bucket happens only where
ir/batch.py proves the rows independent along dim 0; otherwise the compiled shape alone is
accepted. Elsewhere (CPU, cuda_graphs=False, or a capture that failed) the plan runs step by step
on its streams.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from streamfuse.config import Config
from streamfuse.ir.batch import batch_rows, padded_outputs
from streamfuse.ir.graph import Graph
from streamfuse.profile.timing import recording
from streamfuse.runtime.buckets import BatchBuckets
from streamfuse.runtime.executable import Executable, build_executable
from streamfuse.runtime.fallback import failure_text, warn_fallback
from streamfuse.runtime.gate import CallGate
from streamfuse.runtime.graph_cost import copy_nodes_pay, graph_skip_reason, host_rng_reason
from streamfuse.runtime.graphs import MAX_MOVES, GraphRunner, InputsMoved
from streamfuse.runtime.inputs import BadInput, InputMismatch
from streamfuse.runtime.memory import LEDGER, graph_memory_limit, on_out_of_memory
from streamfuse.runtime.model_state import ModelState
from streamfuse.runtime.structure import autocast_state, tf32_state

Recapture = Callable[[list[torch.Tensor]], Executable]
Specialize = Callable[[tuple[torch.Tensor, ...]], Any]
"""Inputs of a new shape or dtype -> a compiled model for them (CompiledGraph or EagerFallback)."""


@dataclass
class CallSpec:
    """How user-facing arguments and results map to the graph's flat inputs and outputs."""

    out_spec: pytree.TreeSpec | None = None
    """Rebuild the model's output structure; None returns the flat list."""
    mutated: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """(flat output index, tensor): results that update a buffer in place, as eager would."""
    input_names: list[str] | None = None
    """Names for error messages (the model's parameter names); None uses the graph's."""


def build(graph: Graph, config: Config, device: torch.device, call: CallSpec | None = None,
          recapture: Recapture | None = None, specialize: Specialize | None = None,
          eager: Callable[..., Any] | None = None, batch_check: Callable[[int], list[int | None]] | None = None
          ) -> CompiledGraph:
    return CompiledGraph(build_executable(graph, config, device), call or CallSpec(), recapture, specialize, eager,
                         batch_check)


class CompiledGraph(ModelState, BatchBuckets):
    """A captured, planned and generated graph. Call it like the model it came from."""

    def __init__(self, base: Executable, call: CallSpec, recapture: Recapture | None = None,
                 specialize: Specialize | None = None, eager: Callable[..., Any] | None = None,
                 batch_check: Callable[[int], list[int | None]] | None = None):
        self.base = base
        self.batch_check = batch_check
        """Traces the model at other batch sizes and raises where it is not the same function of the
        batch (ir/batch.py differs_beyond_batch); run once, at the first call of another batch,
        before any padding (buckets built later compare again in `recapture`)."""
        self.eager = eager
        """The model itself (or the graph handed to the backend): what runs if the plan fails on its
        first call with anything but bad input."""
        self.eager_reason: str | None = None
        """Why calls run `eager` instead of the plan, or None."""
        self._proven = eager is None
        self.call = call
        self.recapture = recapture
        self.specialize = specialize if base.config.max_specializations > 0 else None
        """Builds the model for inputs whose shapes (beyond a padded batch) or dtypes differ."""
        self.specializations: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        """Input signature -> the model compiled for it, least recently used first."""
        self.specializations_built = 0
        """Specializations compiled so far, evicted ones included: the number of extra compilations."""
        self.specialization_overflow = False
        """Config.max_specializations_built was reached: further new shapes run eagerly."""
        self.compile_s: float | None = None
        """Seconds the compile of this plan took (set by streamfuse.compile)."""
        self.capture_path: str | None = None
        """How streamfuse.compile captured the model (capture/export.py), None on the backend path."""
        self.first_call_s: float | None = None
        """Seconds the first call took: Triton compiles the kernels and the CUDA graph is recorded."""
        self.config = base.config
        self.graph_failure: str | None = None
        """Why CUDA-graph capture failed (the calls then run on streams), or None."""
        self.graph_skip: str | None = graph_skip_reason(base) if base.config.cuda_graphs else None
        """Why CUDA graphs are not used although enabled (they would not pay off), or None."""
        self.use_graphs = (base.config.cuda_graphs and base.device.type == "cuda" and base.executor == "triton"
                           and self.graph_skip is None)
        analysis = batch_rows(base.graph)
        self.base_batch = base.graph.inputs[0].shape[0] if base.graph.inputs and base.graph.inputs[0].shape else 0
        self.batch_reason: str | None = analysis if isinstance(analysis, str) else None
        if self.batch_reason is None and recapture is None:
            self.batch_reason = "this graph cannot be captured again at another batch size"
        self._variants: dict[int, Executable] = {self.base_batch: base}
        self._slices: dict[int, list[int | None]] = {
            self.base_batch: padded_outputs(base.graph, analysis) if not isinstance(analysis, str)
            else [None] * len(base.graph.outputs)}
        self._runners: OrderedDict[int, GraphRunner] = OrderedDict()
        self._ran: set[int] = {self.base_batch}
        """Batch buckets whose plan has run once without graphs (the compiled batch's first call is
        `_first_calls`'s to guard)."""
        self._mutated_index = {m for m, _ in call.mutated}
        self._user_outputs = base.graph.user_outputs if base.graph.writebacks else None
        """With writebacks (Graph.writebacks), the outputs a caller sees: the others were copied into inputs."""
        self._leaf_output = call.out_spec is not None and call.out_spec.num_leaves == 1 and \
            call.out_spec.num_nodes == 1
        self._sizes = call.out_spec is not None and holds_sizes(call.out_spec)
        """A torch.Size among the outputs, rebuilt as a plain tuple by tree_unflatten (restore_sizes)."""
        self._init_model_state()
        self.weights_watch: Any = None
        """streamfuse.compile's folded weights (ir/fold.SnapshotWatch): computed again in place, before
        the call, when a parameter they came from changed in place; None where nothing was folded."""
        self.inputs_moved = 0
        """Calls whose inputs updated in place had moved from where the graph read them (runtime/graphs.py)."""
        self.gate = CallGate(base.device)
        """Calls take turns across threads and wait for the previous call's stream (runtime/gate.py)."""

    # -- the pieces of the base plan, for introspection -------------------------------
    @property
    def graph(self) -> Graph:
        return self.base.graph

    @property
    def plan(self) -> Any:
        return self.base.plan

    @property
    def steps(self) -> list[Any]:
        return self.base.steps

    @property
    def sources(self) -> dict[int, Any]:
        return self.base.sources

    @property
    def executor(self) -> str:
        return self.base.executor

    @property
    def device(self) -> torch.device:
        return self.base.device

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise TypeError(f"a {type(self).__name__} cannot be copied: its kernels, buffers and CUDA graphs are bound "
                        "to this process and to the model it was compiled from. Copy the model and compile the "
                        "copy: streamfuse.compile(copy.deepcopy(model), example_inputs)")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(f"a {type(self).__name__} cannot be pickled or copied: its kernels, buffers and CUDA graphs "
                        "are bound to this process. Save the model (its state_dict) and call streamfuse.compile "
                        "again after loading it")

    # -- calling ------------------------------------------------------------------------
    def __call__(self, *inputs: Any, **named: Any) -> Any:
        if named:
            inputs = self._by_position(inputs, named)
        with self.gate:  # one call at a time, in stream order (runtime/gate.py)
            if self.base.device.type == "cuda":
                return on_out_of_memory(lambda: self._entry(inputs), self.base.device,
                                        retry=not self.base.graph.writebacks)
            return self._entry(inputs)

    def _by_position(self, inputs: tuple[Any, ...], named: dict[str, Any]) -> tuple[Any, ...]:
        """Keyword arguments placed at the positions of the model's parameters of those names (the
        compiled inputs are the first len(example_inputs) positional parameters)."""
        names = self.call.input_names or [n.name for n in self.base.graph.inputs]
        slots: list[Any] = list(inputs) + [_MISSING] * max(0, len(names) - len(inputs))
        for key, value in named.items():
            if key not in names:
                raise TypeError(f"unexpected keyword argument {key!r}: the compiled model takes "
                                f"{', '.join(names)} (the parameters its example_inputs were given for); to "
                                f"pass {key!r}, compile with it in example_inputs (a dict of keyword arguments "
                                f"works: streamfuse.compile(model, {{{', '.join(f'{n!r}: ...' for n in [*names, key])}}}))")
            at = names.index(key)
            if slots[at] is not _MISSING:
                raise TypeError(f"got multiple values for argument {key!r}")
            slots[at] = value
        missing = [names[i] for i, v in enumerate(slots) if v is _MISSING]
        if missing:
            raise TypeError(f"missing argument(s) {', '.join(map(repr, missing))}: the model was compiled with "
                            f"example inputs for {', '.join(names)}")
        return tuple(slots)

    def _follow_torch_seed(self) -> None:
        if self.base.rng is not None:
            for exe in self._variants.values():
                exe.follow_torch_seed()

    def _entry(self, inputs: tuple[Any, ...]) -> Any:
        self._follow_torch_seed()
        if self.mode_source is not None and self.mode_source.training != self.compiled_training:
            return self._in_other_mode(inputs)
        if self.autocast is not None and (now := autocast_state(self.base.device.type)) != self.autocast:
            return self._in_other_mode(inputs, now)
        if self.tf32_baked is not None and self._tf32_withdrawn(tf32_state()):
            return self.eager(*inputs)  # type: ignore[misc]
        if self.bound_pointers is not None and not self.bound_pointers.same(self.bound_tensors):
            self._replaced("a parameter or buffer was given new memory after compiling (`.data =`, a dtype or "
                           "device round trip)")
        if self.structure is not None and (what := self.structure.replaced()) is not None:
            self._replaced(f"after compiling, {what}")
        if self.eager_reason is not None and self._proven:
            return self.eager(*inputs)  # type: ignore[misc]
        if not self._grad_warned and torch.is_grad_enabled():
            self._warn_if_grad_wanted(inputs)
        if self._proven:
            return self._call(inputs)
        return self._first_calls(self._call, inputs)

    def _first_calls(self, call: Callable[[Any], Any], inputs: Any) -> Any:
        """Until a call succeeds, a failure of the plan (a kernel that does not compile, an op that
        fails on the runtime layout) is caught: the model then runs eagerly from now on, with one
        warning naming the reason. Bad input still raises."""
        if self.eager_reason is not None:
            return self.eager(*inputs)  # type: ignore[misc]
        start = time.perf_counter()
        try:
            with self.base.restored_on_failure(inputs):
                out = call(inputs)
        except (BadInput, torch.OutOfMemoryError):
            raise  # out of memory: the entry point drops recorded graphs and calls again (runtime/memory.py)
        except Exception as exc:  # noqa: BLE001 - never fail where eager runs
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            # where eager fails too, the input is bad (a wrong feature size, say): eager's error is
            # raised and the plan stays for the next call; only a plan that fails where eager runs
            # sends the model to eager for good
            out = self.eager(*inputs)  # type: ignore[misc]
            self.eager_reason = f"the compiled plan failed on its first call: {failure_text(exc)}"
            warn_fallback("the model", self.eager_reason)
            return out
        self._proven = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.first_call_s = time.perf_counter() - start
        return out

    def _call(self, inputs: tuple[Any, ...]) -> Any:
        if self.weights_watch is not None:
            self.weights_watch.check()
        if self.base.scalar_inputs:
            inputs = tuple(self.base.device_scalars(inputs))
        try:
            if self.use_graphs and self.graph_failure is None and not _capturing():
                flat = self._replay(inputs)
            elif self.batch_reason is None:
                flat = self._run_bucketed(list(inputs))
            else:
                checked = list(inputs)
                self._check_batch(checked)  # the exact shapes, dtypes and device; errors say why the batch is fixed
                flat = self.base.run(self.base.contiguous(checked))
        except InputMismatch:
            if self.specialize is None:
                raise
            return self._specialization(inputs)(*inputs)
        if self._user_outputs is not None:
            flat = flat[: self._user_outputs]
        for index, target in self.call.mutated:
            target.copy_(flat[index])
        if self.call.out_spec is None:
            return flat
        if self._mutated_index:
            flat = [v for i, v in enumerate(flat) if i not in self._mutated_index]
        if self._leaf_output:
            return flat[0]
        value = pytree.tree_unflatten(flat, self.call.out_spec)
        return restore_sizes(value, self.call.out_spec) if self._sizes else value

    def run_flat(self, inputs: list[Any], follow_seed: bool = True) -> list[Any]:
        """Run the compiled shape step by step on its streams (no CUDA graph); flat in, flat out.
        `follow_seed=False`: the caller already drew this call's dropout base (ReplayGraph), so a call
        draws once from torch's generator whichever path runs it."""
        if self.weights_watch is not None:
            self.weights_watch.check()
        if follow_seed:
            self._follow_torch_seed()
        try:
            if not self._proven:
                return self._first_calls(lambda args: self._run_flat(list(args)), inputs)
            return self._run_flat(inputs)
        except InputMismatch:
            if self.specialize is None:
                raise
            found = self._specialization(inputs)
            return found.run_flat(list(inputs)) if isinstance(found, CompiledGraph) else found(*inputs)

    def _run_flat(self, inputs: list[Any]) -> list[Any]:
        inputs = self.base.device_scalars(inputs)
        if self.config.check_inputs:
            inputs = self.base.check_inputs(inputs, self.call.input_names)
        flat = self.base.run(inputs)
        return flat if self._user_outputs is None else flat[: self._user_outputs]

    def _replay(self, inputs: tuple[Any, ...]) -> list[Any]:
        batch = self._check_batch(inputs)
        padded = batch if batch in self._variants else self._bucket(batch)
        runner = self._runners.get(padded)
        if runner is None:
            runner = self._record(padded, inputs)
            if runner is None:  # capture failed: run on streams from now on
                return self._without_graph(inputs, padded)
        else:
            self._runners.move_to_end(padded)
            LEDGER.touch(self, padded)
        try:
            return runner(inputs, batch)
        except InputsMoved:
            # an input the graph updates in place is somewhere else now (a new KV cache): record the
            # graph again, for its new place, or with copies once that happened MAX_MOVES times
            self.inputs_moved += 1
            self.drop_graph(padded)
            runner = self._record(padded, inputs)
            if runner is None:
                return self._without_graph(inputs, padded)
            return runner(inputs, batch)

    def _without_graph(self, inputs: Sequence[Any], padded: int) -> list[Any]:
        """The call as `_call` runs it without graphs, after the recording for bucket `padded` failed:
        padded to its bucket where the batch may change (the compiled plan takes its own batch only: run
        at batch 3 with Config.check_inputs off it returned (4, 16) for (3, 16); on, the call raised
        InputMismatch or compiled a specialization for a batch its bucket serves). A bucket's plan that
        had never run and fails here too failed itself, not its capture (ATen's group norm rejecting
        the view a batch-1 reshape leaves): the batch is fixed (_bucket_failed), and graphs stay on
        for the plans that run (graph_failure had turned them off for every batch)."""
        if self.batch_reason is None:
            first_run = padded not in self._ran
            try:
                return self._run_bucketed(list(inputs))
            except InputMismatch:
                if first_run and padded not in self._variants:  # _bucket_failed dropped the bucket's plan
                    self.graph_failure = None
                raise
        return self._run_flat(list(inputs))

    def _specialization(self, inputs: Sequence[Any]) -> Any:
        """The model compiled for these inputs' shapes and dtypes: built on first use, at most
        Config.max_specializations kept (least recently used out)."""
        key = tuple((tuple(t.shape), t.dtype, t.device) for t in inputs)
        found = self.specializations.get(key)
        if found is not None:
            self.specializations.move_to_end(key)
            return found
        if self.specializations_built >= self.config.max_specializations_built and self.eager is not None:
            if not self.specialization_overflow:
                self.specialization_overflow = True
                warn_fallback("a call with a shape not compiled yet", (
                    f"{self.specializations_built} specializations were compiled already "
                    f"(Config.max_specializations_built); the {len(self.specializations)} kept still serve their shapes"))
            return self.eager
        found = self.specialize(tuple(inputs))  # type: ignore[misc]
        self.specializations_built += 1
        self.specializations[key] = found
        while len(self.specializations) > self.config.max_specializations:
            self.specializations.popitem(last=False)
        return found

    def _record(self, padded: int, inputs: Sequence[Any]) -> GraphRunner | None:
        try:
            runner = GraphRunner(self._variants[padded], self._slices[padded],
                                 self.config.reuse_outputs, self.config.output_sets,
                                 self.config.input_copy_node and copy_nodes_pay(self._copied_inputs()),
                                 inputs=inputs, read_in_place=self.inputs_moved < MAX_MOVES)
        except Exception as exc:  # noqa: BLE001 - any capture failure falls back to stream execution
            torch.cuda.synchronize(self.device)
            _settle_generators(self.device)
            if isinstance(exc, torch.OutOfMemoryError):
                raise  # not a reason to give graphs up: the entry point makes room and calls again
            self.graph_failure = f"{type(exc).__name__}: {exc}"
            return None
        rng = host_rng_reason(self._variants[padded])
        if rng is not None:  # a random kernel failed to compile in the recording's warm-up
            self.graph_skip, self.use_graphs = rng, False
            return None
        self._runners[padded] = runner
        self._note_tf32(self._variants[padded].graph)
        while len(self._runners) > self.config.max_graphs:
            self._runners.popitem(last=False)
        LEDGER.add(self, padded, self.device, graph_memory_limit(self.device, self.config.graph_memory_fraction))
        return runner

    def _copied_inputs(self) -> int:
        """Inputs a recorded graph copies in on each call: all but those it updates in place, which
        it reads where they are (runtime/graphs.py) until they moved MAX_MOVES times."""
        inputs = self.base.graph.inputs
        return len(inputs) - (len(self.base.graph.written_inputs) if self.inputs_moved < MAX_MOVES else 0)

    def inputs_read_in_place(self) -> int | None:
        """How many inputs it updates in place the recorded graphs read where they are (the fewest
        over the graphs), or None before a graph is recorded (explain)."""
        return min((len(r.in_place) for r in self._runners.values()), default=None)

    def graph_bytes(self, key: int) -> int | None:
        """What the graph recorded for batch bucket `key` keeps (runtime/memory.GraphLedger), or None."""
        runner = self._runners.get(key)
        return runner.reserved_bytes if runner is not None else None

    def weights_changed(self) -> None:
        """Compute again every copy the plan keeps of the model's weights (batch-norms folded into
        convolutions, what the weights alone compute: Config.fold_weights, channels_last copies of
        convolution filters), from their current values. The plan sees in-place changes by their
        version counters; call this after a change that bumps none: through `.data`
        (`p.data.mul_(2)`, an EMA written through `.data`). Recorded CUDA graphs read the copies where
        they are, so they see the new values."""
        if self.weights_watch is not None:
            self.weights_watch.cache.refresh()
        for exe in self._variants.values():
            for step in exe.converted_weights:
                step.refresh(force=True)

    def drop_graph(self, key: int) -> None:
        """Forget the graph of batch bucket `key`: its next call records it again."""
        self._runners.pop(key, None)

    # -- introspection ------------------------------------------------------------------
    def recorded_graphs(self) -> dict[int, torch.cuda.CUDAGraph]:
        """Padded batch -> its recorded CUDA graph (replaying one runs just the kernels: profiling)."""
        return {batch: runner.graph for batch, runner in self._runners.items()}

    @property
    def stats(self) -> dict[str, Any]:
        groups = self.base.plan.groups
        generated = [g for g in groups if g.kind.generated and g.id not in self.base.through_torch]
        return {
            "source_ops": self.base.graph.source_ops,
            "kernels": self.base.launches,
            "generated_kernels": len(generated),
            "aten_kernels": self.base.launches - len(generated),
            "fused_groups": sum(1 for g in generated if len(g.nodes) > 1),
            "refused_fusions": len(self.base.plan.refusals),
            "streams": self.base.schedule.streams,
            "events": self.base.schedule.events + self.base.release_waits,
            "graphs": len(self._runners),
            "graph_instances": sum(r.instances for r in self._runners.values()),
            "outputs_copied": sum(r.outputs_copied for r in self._runners.values()),
            "inputs_moved": self.inputs_moved,
            "graph_mib": round(sum(r.reserved_bytes for r in self._runners.values()) / 2**20, 1),
            "specializations": len(self.specializations),
            "specializations_built": self.specializations_built,
            "compile_s": self.compile_s,
            "first_call_s": self.first_call_s,
            "capture_path": self.capture_path,
            "compile_stages_s": {k: round(v, 3) for k, v in self.base.compile_times.items()},
            "executor": self.base.executor,
            "device": str(self.base.device),
        }

    def input_copy(self) -> str:
        """Where the recorded graphs copy a call's inputs, in words (explain)."""
        if not self.config.input_copy_node:
            return "before the replay (Config.input_copy_node=False)"
        n = self._copied_inputs()
        if not copy_nodes_pay(n):
            return (f"before the replay: one batched copy of {n} inputs costs less than {n} copy-node updates"
                    if n else "no inputs")
        failures = {r.copy_node_failure for r in self._runners.values() if r.copy_node_failure}
        if failures:
            return "before the replay: " + "; ".join(sorted(failures))
        return ("inside the graph: a memcpy node per input, pointed at the caller's tensors"
                if self._runners else "inside the graph, once one is recorded")

    def explain(self, source: bool = True) -> str:
        from streamfuse.runtime.explain import explain_plan

        return explain_plan(self, source=source)

    def __repr__(self) -> str:
        s = self.stats
        return (f"CompiledGraph({s['source_ops']} ops -> {s['kernels']} kernels on {s['streams']} streams, "
                f"{s['generated_kernels']} generated, executor={s['executor']}, device={s['device']})")


_MISSING = object()
"""A compiled input no positional or keyword argument gave."""

def _settle_generators(device: torch.device) -> None:
    """A capture that fails can leave torch's CUDA generators in their capturing state (the end of
    capture never ran), after which the next torch.randn on the device raises "Offset increment
    outside graph capture" (PERF.md run 24). One trivial capture runs their begin and end again."""
    try:
        graph = torch.cuda.CUDAGraph()
        with recording(graph, thread_local=False):
            torch.zeros(1, device=device).add_(1)
    except Exception:  # noqa: BLE001 - best effort; the failure reason is already recorded
        torch.cuda.synchronize(device)


def _capturing() -> bool:
    """Inside someone else's CUDA-graph capture our graph cannot replay: its kernels are captured instead."""
    return torch._C._cuda_isCurrentStreamCapturing()


def _child_specs(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    # `children()` where torch has it; the older `children_specs` warns of deprecation on newer torch
    return list(spec.children()) if hasattr(type(spec), "children") else list(spec.children_specs)


def holds_sizes(spec: pytree.TreeSpec) -> bool:
    """Whether an output structure holds a torch.Size, which pytree flattens to its ints and rebuilds
    as a plain tuple (restore_sizes puts the type back)."""
    return spec.type is torch.Size or any(holds_sizes(c) for c in _child_specs(spec))


def restore_sizes(value: Any, spec: pytree.TreeSpec) -> Any:
    """`pytree.tree_unflatten`'s result with every torch.Size of the structure a torch.Size again, as
    the model returned it (a shape among the outputs: `.numel()` works on it)."""
    if spec.type is torch.Size:
        return torch.Size(value)
    node = pytree.SUPPORTED_NODES.get(spec.type)
    if node is None or not holds_sizes(spec):
        return value
    children, context = node.flatten_fn(value)
    return node.unflatten_fn([restore_sizes(v, c) for v, c in zip(children, _child_specs(spec), strict=True)], context)
