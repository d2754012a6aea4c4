"""torch.compile(model, backend="streamfuse"): Dynamo graph -> AOTAutograd aten graphs -> streamfuse.

AOTAutograd hands forward (and, when training, backward) aten graphs to the same compiler,
so backward graphs arrive the same way as forward ones.

Three things keep this path from ever failing where eager runs:
- AOTAutograd compiles under its FakeTensorMode. Planning reads only metadata; what a plan
  allocates once (split-K scratch, hoisted views) and any tuning on the GPU needs real tensors,
  so fake mode is lifted while a plan is built. Nothing reads the example inputs' data.
- Symbolic sizes: once Dynamo has seen a dimension change it marks it dynamic and hands over a
  graph with SymInt sizes. Dynamo's guards decide when that graph applies; within it, each
  concrete input signature gets its own plan, traced from the graph at those sizes and built on
  first use (at most Config.max_specializations, least recently used out).
- A graph that cannot be converted or planned runs as AOTAutograd handed it (ATen), with one
  warning naming the reason; so does a plan that fails on its first call (runtime/compiled.py).
"""

from __future__ import annotations

import dataclasses
import operator
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._subclasses.fake_tensor import unset_fake_temporarily

from streamfuse.capture.decomp import decomposition_table
from streamfuse.capture.sibling_linear import merge_sibling_linears
from streamfuse.capture.symbolic import EagerGraph, SymbolicGraph, eager_runner, is_symbolic
from streamfuse.capture.train_layout import channels_last_training
from streamfuse.config import Config
from streamfuse.ir.fold import SnapshotCache, statistics_counters
from streamfuse.ir.from_fx import graph_from_fx
from streamfuse.ir.weight_fold import fold_model_weights
from streamfuse.runtime.compiled import CompiledGraph, build
from streamfuse.runtime.fallback import failure_text
from streamfuse.runtime.gate import CallGate
from streamfuse.runtime.inputs import accelerator_of, graph_device
from streamfuse.runtime.memory import PointerCheck, on_out_of_memory, picker
from streamfuse.runtime.replay import ReplayGraph


class _Registry:
    """What the backend compiled in this process, newest last, held weakly: an entry reads None once
    its graph is gone (torch._dynamo.reset(), the compiled model deleted). A graph holds its CUDA
    graphs' pools and the buffers they hand out (a training forward's saved activations): a strong
    list kept every graph and its memory alive for the life of the process (run 63: the training
    benchmark's steady-state peak included the gradient check's graphs, about 2x eager's)."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref[Any]] = []

    def append(self, graph: Any) -> None:
        self._refs.append(weakref.ref(graph))

    def __len__(self) -> int:
        return len(self._refs)

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...
    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [r() for r in self._refs[index]]
        return self._refs[index]()

    def __iter__(self) -> Iterator[Any]:
        return iter(self[:])


compiled_graphs = _Registry()
"""What the backend compiled in this process, newest last (CompiledGraph, ReplayGraph,
StaticParamsGraph, SymbolicGraph or EagerGraph; None once collected): for explain and tests."""


def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], config: Config) -> Any:
    """A static-shape aten graph -> CompiledGraph (or EagerGraph with the reason it could not be built)."""
    try:
        graph = graph_from_fx(gm)
        with unset_fake_temporarily():
            return build(graph, config, graph_device(graph, example_inputs), eager=eager_runner(gm),
                         specialize=_retraced(gm, config))
    except Exception as exc:  # noqa: BLE001 - never fail where eager runs
        return EagerGraph(gm, f"conversion or planning failed: {failure_text(exc)}")


def _retraced(gm: torch.fx.GraphModule, config: Config) -> Any:
    """For a call whose tensors do not have the dtypes or shapes the graph's metadata promised: the
    graph traced again on (fake copies of) those tensors and planned for them. AOTAutograd's
    metadata can disagree with the kernels: under CPU bf16 autocast a float32 batch-norm's saved
    statistics are float32, while the fake kernel said bfloat16, and the backward's plan refused
    them (a training sweep, session 27). Where the retrace fails, the graph runs as AOTAutograd
    handed it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def specialize(args: tuple[Any, ...]) -> Any:
        if not all(isinstance(a, torch.Tensor) for a in args):
            return eager_runner(gm)
        try:
            with unset_fake_temporarily():
                traced = make_fx(lambda *a: gm(*a), tracing_mode="fake")(*args)
        except Exception:  # noqa: BLE001 - never fail where eager runs
            return eager_runner(gm)
        plan = compile_graph(traced, list(args), config.replace(max_specializations=0))
        return plan if isinstance(plan, CompiledGraph) else eager_runner(gm)

    return specialize


class StaticParamsGraph:
    """An inference graph whose parameters and buffers (AOTAutograd's static inputs) are bound as
    constants at the first real call, so the plan's CUDA graphs copy in only the other inputs, as
    streamfuse.compile's do (Config.backend_cuda_graphs). A call whose static arguments are not the
    same tensors as at that first call (a module's parameter replaced) runs the plan that takes
    every argument (`fallback`, built when first needed: one plan is built per graph, not two), and
    so does every call if binding failed (`reason`).

    Static inputs the graph updates in place and that a call replaced are state the caller renews,
    not parameters: transformers' static KV cache, marked static when generate() compiles the model
    itself (its CompileConfig), is a new tensor on every generate() call. The first such call binds
    the graph again with every updated static input passed as an argument instead (read and written
    where it is by the recorded graphs, runtime/graphs.py), once; the plan taking every argument
    served every later generate() call before (session 18). Optimizer steps, whose updated
    parameters and states stay the same tensors, keep them bound.

    Inference batch-norms are folded into their convolutions' weights (Config.fold_batchnorm), as
    streamfuse.compile does, so both entry points run the same plan: the folded weights are
    snapshots the plan owns (a channels_last convolution converts them once, not per call). Like
    streamfuse.compile's, these snapshots are watched: every call compares the version counters of
    the tensors they were computed from (an in-place change, e.g. an optimizer step or
    load_state_dict between evaluations, bumps them), and the first call that finds one changed
    binds the graph again with nothing folded, reading the parameters live from then on.

    A parameter whose memory was replaced (`p.data = t`, which `model.half().float()` and other
    `Module._apply` conversions do) bumps no counter, and the plan would read the old memory (a
    hoisted transpose of a Linear weight did: wrong results on the CPU, session-27 sweep; recorded
    CUDA graphs hold every bound tensor's address). Every call also compares the bound tensors' data
    pointers (a C call each, ~0.07 µs) and binds the graph again where one moved."""

    def __init__(self, gm: torch.fx.GraphModule, config: Config, static: list[int]):
        self.gm = gm
        self.config = config
        self.static = static
        self._fallback: CompiledGraph | EagerGraph | None = None
        self.compiled: CompiledGraph | None = None
        self.reason: str | None = None
        self.bound: list[torch.Tensor] = []
        self.pointers = PointerCheck([], [])
        """The bound tensors' data pointers when bound (a `.data` swap moves them)."""
        self._static_of: Callable[[Sequence[Any]], tuple[Any, ...]] = picker([])
        self._dynamic_of: Callable[[Sequence[Any]], tuple[Any, ...]] = picker([])
        """The static and the other arguments of a call, as bound (_bind)."""
        self.dynamic: list[int] = []
        self.updated = _updated_placeholders(gm)
        """Positions of the inputs the graph updates in place (copy_ into a placeholder)."""
        self.unbound_updates = False
        """The graph was bound again with its updated static inputs passed as arguments."""
        self.folded = 0
        """Batch-norms folded into the bound plan's convolution weights."""
        self.weight_folds = 0
        """Ops computed from the bound parameters alone, folded into snapshots (ir/weight_fold.py)."""
        self.watched: list[torch.Tensor] = []
        self.versions: list[int] = []
        """The folds' source tensors and their version counters when folded."""
        self.rebinds = 0
        """Times a bound tensor's memory was found replaced and the graph bound again."""
        self.live = False
        """A folded source changed in place: bound again with nothing folded (parameters read live)."""

    def run_flat(self, args: list[Any]) -> list[Any]:
        if self.compiled is None and self.reason is None:
            self._bind(args)
        # the per-call checks as C-level maps (a few hundred parameters each: run 107's host time)
        if self.compiled is not None and (all(map(operator.is_, self._static_of(args), self.bound))
                                          or self._unbind_updates(args)):
            if not self.pointers.same(args):  # args[static] are the bound tensors here
                self._rebind(args)
                if self.compiled is None:
                    return self.fallback(args).run_flat(args)
            if self.watched and [t._version for t in self.watched] != self.versions:
                self._go_live(args)
                if self.compiled is None:
                    return self.fallback(args).run_flat(args)
            return self.compiled(*self._dynamic_of(args))  # type: ignore[no-any-return]
        return self.fallback(args).run_flat(args)

    def _rebind(self, args: list[Any]) -> None:
        """A bound tensor's memory was replaced: bind again to where they are now."""
        self.rebinds += 1
        self.compiled, self.bound, self.watched, self.versions, self.folded = None, [], [], [], 0
        self._bind(args)

    def _go_live(self, args: list[Any]) -> None:
        """A folded weight's source changed in place: bind again, nothing folded (once)."""
        self.live = True
        self.compiled, self.bound, self.watched, self.versions, self.folded = None, [], [], [], 0
        self._bind(args)

    def _unbind_updates(self, args: list[Any]) -> bool:
        """Bind the graph again without its updated static inputs if only those were replaced (once)."""
        moved = {i for i, t in zip(self.static, self.bound, strict=True) if args[i] is not t}
        if self.unbound_updates or not moved <= self.updated:
            return False
        self.unbound_updates = True
        previous = self.static
        self.static = [i for i in self.static if i not in self.updated]
        self.compiled, self.bound = None, []
        self._bind(args)
        if self.compiled is None:  # binding failed: back to the plan taking every argument
            self.static = previous
            return False
        return True

    def fallback(self, args: list[Any]) -> CompiledGraph | EagerGraph:
        """The plan taking every argument (built at the first call that needs it)."""
        if self._fallback is None:
            self._fallback = compile_graph(self.gm, args, self.config)
        return self._fallback

    def _bind(self, args: list[Any]) -> None:
        placeholders = [n.name for n in self.gm.graph.nodes if n.op == "placeholder"]
        bound = [args[i] for i in self.static]
        static, gm = set(self.static), self.gm
        dynamic = [i for i in range(len(args)) if i not in static]

        count = len(args)

        def eager(*tensors: Any) -> list[Any]:  # holds the bound parameters, not the first call's inputs
            full: list[Any] = [None] * count
            for i, t in zip(self.static, bound, strict=True):
                full[i] = t
            for i, t in zip(dynamic, tensors, strict=True):
                full[i] = t
            return list(gm(*full))

        try:
            graph = graph_from_fx(gm, {placeholders[i]: t for i, t in zip(self.static, bound, strict=True)})
            self._fold(graph, bound)
            self.compiled = build(graph, self.config, graph_device(graph, args), eager=eager)
        except Exception as exc:  # noqa: BLE001 - the plan over every argument stays in use
            self.reason = f"binding the static inputs failed: {failure_text(exc)}"
            return
        self.bound, self.dynamic = bound, dynamic
        self.pointers = PointerCheck(args, self.static)
        self._static_of, self._dynamic_of = picker(self.static), picker(dynamic)

    def _fold(self, graph: Any, bound: list[Any]) -> None:
        """Fold the batch-norms and what the parameters alone compute into snapshot weights, as
        streamfuse.compile does (ir/weight_fold.fold_model_weights; no sibling convolutions merged), watched
        by version counter (class docstring), with the `num_batches_tracked` of their modules (found among
        the process's objects: a recalibration pass through the uncompiled module in train mode bumps only
        those); not where a bound tensor keeps no version counter (made under torch.inference_mode)."""
        self.weight_folds = 0
        if self.live or any(isinstance(t, torch.Tensor) and t.is_inference() for t in bound):
            return
        snapshots = SnapshotCache()
        self.folded, self.weight_folds = fold_model_weights(graph, snapshots, self.config, note=FOLD_NOTE,
                                                               merge_convolutions=False)
        self.watched = snapshots.sources()
        if self.folded or self.weight_folds:  # a train-mode forward of the module updates statistics unseen
            self.watched += statistics_counters(_live_norm_modules(), self.watched)
        self.versions = [t._version for t in self.watched]

    @property
    def stats(self) -> dict[str, Any]:
        plan = self.compiled or self._fallback
        return plan.stats if plan is not None else {}

    def explain(self, source: bool = True) -> str:
        if self.compiled is None:
            why = self.reason or "not yet called"
            rest = self._fallback.explain(source) if self._fallback is not None else ""
            return f"inference graph, parameters passed on every call ({why})\n" + rest
        bound = (f"{len(self.static)} parameters and buffers bound as constants at its first call (CUDA graphs "
                 "copy in only the other inputs)" if self.static else "no parameters or buffers (CUDA graphs copy in "
                 "its inputs)")
        if self.unbound_updates:
            bound += ("; the static inputs it updates in place were replaced by the caller, so they are passed as "
                      "arguments (bound again once)")
        if self.weight_folds:
            bound += (f"; {self.weight_folds} op(s) computed from parameters alone folded into snapshots, watched: a "
                      "parameter changed in place binds the graph again unfolded")
        if self.folded:
            bound += (f"; {self.folded} batch-norm(s) folded into convolution weights, watched: a parameter changed "
                      "in place binds the graph again unfolded")
        if self.live:
            bound += "; a folded snapshot's parameters changed in place, so it was bound again with none folded"
        return f"inference graph with {bound}\n" + self.compiled.explain(source)


def _live_norm_modules() -> list[torch.nn.Module]:
    """Every batch- and instance-norm module alive in this process, for the backend, which sees its
    graph's tensors but not the modules they belong to: one pass over the garbage collector's
    objects (~75 ms with torchvision and transformers loaded), once per bound graph that folds."""
    import gc

    from torch.nn.modules.batchnorm import _NormBase

    # type() and not isinstance: isinstance reads `__class__`, which a dead weakref.proxy raises on
    # and some deprecated module attributes warn on
    return [o for o in gc.get_objects() if issubclass(type(o), _NormBase)]


FOLD_NOTE = "a snapshot of the parameters, watched: one changed in place binds the graph again without folding"


def _updated_placeholders(gm: torch.fx.GraphModule) -> set[int]:
    """Positions of the placeholders the graph copies a new value into (its input mutations)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    position = {n: i for i, n in enumerate(placeholders)}
    return {position[n.args[0]] for n in gm.graph.nodes
            if n.op == "call_function" and n.target is torch.ops.aten.copy_.default and n.args[0] in position}


def _static_inputs() -> list[int]:
    """AOTAutograd's static inputs of the graph being compiled (parameters and buffers)."""
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    return list(getattr(meta, "static_input_indices", None) or [])


@dataclass(frozen=True)
class TrainingRole:
    """A training graph's part: "forward" (whose first `visible` outputs the caller sees: they are
    copied out of a replayed graph) or "backward"."""

    role: str
    visible: int = 0
    static: frozenset[str] = frozenset()
    """Names of the graph's inputs that are parameters or buffers (AOTAutograd's static inputs, as
    the forward's placeholders `primals_<i+1>` name them; the backward keeps those names for the ones
    it saved): read in place whatever their size (runtime/replay.py)."""


def training_graph(compiled: Any, training: TrainingRole | None) -> Any:
    """A training graph on CUDA replays CUDA graphs that read its inputs in place (runtime/replay.py)."""
    if training is None or not isinstance(compiled, CompiledGraph) or compiled.device.type != "cuda":
        return compiled
    return ReplayGraph(compiled, training.role, set(range(training.visible)), training.static)


def _training_role(role: str) -> TrainingRole:
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    static = frozenset(f"primals_{i + 1}" for i in getattr(meta, "static_input_indices", None) or [])
    if role == "backward":
        return TrainingRole(role, static=static)
    visible = getattr(meta, "num_forward_returns", None)
    # unknown: every output counts as visible, so every one is copied out (correct, slower)
    return TrainingRole(role, visible if isinstance(visible, int) else 1 << 30, static)


def _compiler(config: Config, role: str = "forward") -> Any:
    inference = role == "inference"

    def compile_aten_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        bind = inference and config.backend_cuda_graphs  # parameters bound at the first call: CUDA graphs
        static = _static_inputs() if bind else []
        training = _training_role(role) if not inference and config.backend_cuda_graphs else None
        # a training graph keeps its pool, where every stream keeps its own high-water mark
        planned = config.replace(max_streams=config.training_max_streams) if training is not None else config
        compiled: Any
        if _has_effect_tokens(gm):
            compiled = EagerGraph(gm, "the graph orders side effects with effect tokens (with_effects: torch.linalg's "
                                      "error checks, prints), which AOTAutograd passes as None")
        elif is_symbolic(gm):
            compiled = SymbolicGraph(gm, planned, static if bind else None, training)
        elif bind:
            # builds its plan at the first real call; with no parameters (an optimizer's step over
            # inputs only, a function of its arguments) it still replays CUDA graphs
            compiled = StaticParamsGraph(gm, config, static)
        else:
            compiled = training_graph(compile_graph(gm, example_inputs, planned), training)
        compiled_graphs.append(compiled)

        retry = not _mutates(gm)
        gate = CallGate(accelerator_of(example_inputs))

        def run(args: list[Any]) -> list[Any]:
            with gate:  # one call at a time, in stream order (runtime/gate.py)
                return on_out_of_memory(lambda: compiled.run_flat(args), retry=retry)  # type: ignore[no-any-return]

        run._boxed_call = True  # type: ignore[attr-defined]  # AOTAutograd passes the args list itself
        return run

    return compile_aten_graph


def _has_effect_tokens(gm: torch.fx.GraphModule) -> bool:
    """The graph threads AOTAutograd's effect tokens through `with_effects` (ops with side effects
    kept in order): at run time the token inputs are None, which a plan's input checks refuse."""
    with_effects = getattr(torch.ops.higher_order, "with_effects", None)
    return with_effects is not None and any(n.target is with_effects for n in gm.graph.nodes)


def _mutates(gm: torch.fx.GraphModule) -> bool:
    """The graph updates something in place (copy_ into an input, an optimizer's foreach updates):
    a call that failed half-way must not be run again (runtime/memory.on_out_of_memory)."""
    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is not None and schema.is_mutable:
            return True
    return False


def make_backend(config: Config | None = None) -> Any:
    """A torch.compile backend with a given Config: torch.compile(m, backend=make_backend(cfg))."""
    config = config or Config()
    # min-cut partitioning (as Inductor): the forward saves what is cheapest to keep, the backward
    # recomputes cheap pointwise ops fused into its kernels (less activation memory). Inference
    # graphs keep their input mutations (an optimizer's updates, running statistics) as copy_ nodes,
    # which the plan writes back in one launch at the end of each call (Graph.writebacks)
    aot = aot_autograd(fw_compiler=_compiler(config, "forward"), bw_compiler=_compiler(config, "backward"),
                       inference_compiler=_compiler(config, "inference"),
                       decompositions=decomposition_table(config.embedding_backward),
                       partition_fn=min_cut_rematerialization_partition,
                       keep_inference_input_mutations=True)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
        if config.train_channels_last:
            channels_last_training(gm, example_inputs)  # capture/train_layout.py
        if config.merge_sibling_linears:
            merge_sibling_linears(gm, example_inputs)  # capture/sibling_linear.py
        return aot(gm, example_inputs, **kwargs)

    return backend


MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "reduce-overhead": {},  # CUDA graphs are already on wherever they pay (Config.cuda_graphs)
    "max-autotune": {"profile_guided": True},
    "max-autotune-no-cudagraphs": {"profile_guided": True, "cuda_graphs": False, "backend_cuda_graphs": False},
}
"""torch.compile's `mode` names -> the Config settings they mean for streamfuse."""


def config_for(mode: str | None = None, options: dict[str, Any] | None = None) -> Config:
    """The Config of `torch.compile(..., backend="streamfuse", mode=..., options=...)`: `mode` one of
    torch.compile's (MODES), `options` Config fields by name (`options={"max_streams": 1}`)."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"torch.compile(backend='streamfuse') got mode={mode!r}; expected one of {', '.join(MODES)}")
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"torch.compile(backend='streamfuse') got options={options!r}; expected a dict of Config "
                         "fields, e.g. options={'max_streams': 1}")
    fields = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(options or {}) - fields)
    if unknown:
        raise ValueError(f"torch.compile(backend='streamfuse') got unknown option(s) {', '.join(map(repr, unknown))}; "
                         f"options are streamfuse.Config fields: {', '.join(sorted(fields))}")
    return Config(**(MODES[mode or "default"] | dict(options or {})))


def streamfuse_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                       options: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """The backend registered as "streamfuse": torch.compile's `mode` and `options` choose its Config
    (config_for); without them, the defaults."""
    return make_backend(config_for(mode, options))(gm, example_inputs, **kwargs)


def register() -> None:
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "streamfuse" not in _BACKENDS or _BACKENDS.get("streamfuse") is None:
        register_backend(compiler_fn=streamfuse_backend, name="streamfuse")


__all__ = ["CompiledGraph", "EagerGraph", "StaticParamsGraph", "SymbolicGraph", "compile_graph", "make_backend", "register",
           "streamfuse_backend"]
