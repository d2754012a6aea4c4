"""streamfuse.compile's capture: nn.Module or function -> functional aten FX graph.

The model is traced once on fake tensors by make_fx over torch.func.functionalize, with our
decomposition table (functional aten graph, parameters and buffers as leading placeholders):
2-3x faster than AOTAutograd's export, which runs the model twice (a metadata pass, then the
trace; bert-base on CPU: 0.45 s against 1.1-1.6 s). Where that does not apply, AOTAutograd's
export, then torch.export and `run_decompositions`. Parameters and buffers are bound to the
module's own tensors, so in-place weight updates stay visible.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import is_fake
from torch.export.graph_signature import InputKind, OutputKind

from streamfuse.capture.decomp import decomposition_table, export_decomposition_table


class _FunctionModule(torch.nn.Module):
    def __init__(self, fn: Callable[..., Any]):
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


@dataclass
class Captured:
    gm: torch.fx.GraphModule
    bound: dict[str, torch.Tensor]
    """Placeholder name -> parameter, buffer or constant tensor."""
    out_spec: pytree.TreeSpec
    input_names: list[str]
    mutated: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    literals: frozenset[str] = frozenset()
    """Placeholders in `bound` holding tensors the trace made (torch.export's lifted constants), not
    the model's state: the graph may copy them (ir/from_fx.py, snapshots)."""
    how: str = "one trace"
    """Which capture path made the graph: "one trace", or "torch.export" with why the first did not apply."""


def parameter_names(fn: Callable[..., Any], count: int) -> list[str]:
    """Names of the first `count` positional parameters of fn (args_i where it has none)."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params[:count]]
    return names + [f"args_{i}" for i in range(len(names), count)]


class KeywordInputs(torch.nn.Module):
    """A model compiled on keyword example inputs (`{"input_ids": ids, "attention_mask": mask}`):
    called with the tensors in that order, or by those names, it calls the model with keywords.
    For parameters that come after others the caller leaves out (GPT-2's attention_mask follows
    past_key_values)."""

    def __init__(self, model: Callable[..., Any], names: list[str]):
        super().__init__()
        self.model = model
        self.keyword_names = names

    def forward(self, *args: Any, **named: Any) -> Any:
        if len(args) > len(self.keyword_names):
            raise TypeError(f"expected at most {len(self.keyword_names)} inputs ({', '.join(self.keyword_names)}), "
                            f"got {len(args)}")
        return self.model(**dict(zip(self.keyword_names, args)), **named)


def keyword_model(model: Callable[..., Any], example_inputs: dict[Any, Any]) -> tuple[KeywordInputs, tuple[Any, ...]]:
    """`model` taking `example_inputs`' keys as keywords, and the example tensors in that order."""
    for key, value in example_inputs.items():
        if not isinstance(key, str):
            raise ValueError(f"example_inputs keys must be the model's parameter names (str), got {key!r}")
    return KeywordInputs(model, list(example_inputs)), tuple(example_inputs.values())


def non_tensor_input(example_inputs: Any) -> str | None:
    """Names the first example input that is not a tensor, or None. Such inputs are compiled through
    the backend, where Dynamo guards them at every call: a list, tuple or dict of tensors (a list of
    images), another pytree of tensors (transformers' DynamicCache fed back for the next decode step),
    a Python number, flag or None (`output_hidden_states=True`, timm's `pre_logits=True`)."""
    items = example_inputs.items() if isinstance(example_inputs, dict) else \
        enumerate(example_inputs) if isinstance(example_inputs, (tuple, list)) else ()
    for key, value in items:
        if isinstance(value, torch.Tensor):
            continue
        leaves = pytree.tree_leaves(value)
        if leaves != [value] and all(isinstance(t, torch.Tensor) for t in leaves):
            return f"example_inputs[{key!r}] is a {type(value).__name__} of {len(leaves)} tensor(s)"
        return f"example_inputs[{key!r}] is a {type(value).__name__}, not a tensor"
    return None


def normalize_inputs(example_inputs: Any) -> tuple[torch.Tensor, ...]:
    """A tensor, or a tuple/list of tensors -> tuple; anything else is a ValueError."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        for i, t in enumerate(example_inputs):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"example_inputs[{i}] must be a torch.Tensor, got {type(t).__name__}")
        return tuple(example_inputs)
    raise ValueError("example_inputs must be a tensor, a tuple of tensors or a dict of keyword tensors, got "
                     f"{type(example_inputs).__name__}")


def capture(model: torch.nn.Module | Callable[..., Any], example_inputs: Sequence[torch.Tensor]) -> Captured:
    """`model` traced on `example_inputs` into a functional aten graph lowered with our table.

    One trace (AOTAutograd's export on fake tensors, under no_grad: streamfuse.compile runs
    inference) where it applies; torch.export followed by run_decompositions, two traces, where it
    does not (a model returning non-tensor leaves, say)."""
    if not callable(model):
        raise ValueError(f"model must be an nn.Module or a callable, got {type(model).__name__}")
    module = model if isinstance(model, torch.nn.Module) else _FunctionModule(model)
    names = getattr(module, "keyword_names", None) or \
        parameter_names(module.forward if module is model else model, len(example_inputs))
    example_inputs = _distinct(example_inputs)
    live = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers(remove_duplicate=False))
    try:
        with _quiet_tracing_logs():
            return _capture_paths(module, tuple(example_inputs), live, names)
    except _CacheOutput as exc:
        # a Hugging Face causal LM returning its DynamicCache: transformers' own pytree support for
        # it (the one its torch.export integration registers) makes the cache's tensors graph outputs
        # and the call's result a DynamicCache again; without it, the reason goes to the fallback
        if not _hf_cache_registered():
            raise RuntimeError(str(exc)) from exc
        with _quiet_tracing_logs():
            return _capture_paths(module, tuple(example_inputs), live, names)


_TRACING_LOGGERS = ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes", "torch._export",
                    "torch.export")


@contextlib.contextmanager
def _quiet_tracing_logs() -> Iterator[None]:
    """torch's tracing loggers silenced while we trace: a model that cannot be traced (a wrong
    feature size, data-dependent control flow) made fake_tensor log each failed op's traceback at
    error level (553 lines for one Linear called with the wrong width), before our one warning or
    error that says the same."""
    loggers = [logging.getLogger(name) for name in _TRACING_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _capture_paths(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], live: dict[str, torch.Tensor],
                   names: list[str]) -> Captured:
    """The capture paths in order: make_fx over functionalize, AOTAutograd's export, torch.export."""
    try:
        with _state_kept(module):  # after each path: a failed trace must not leave traced tensors behind
            return _capture_functional(module, tuple(example_inputs), names)
    except _NotOneTrace as first:
        try:
            with _state_kept(module):
                captured = _capture_one_trace(module, tuple(example_inputs), live, names)
            captured.how = f"AOTAutograd export (make_fx did not apply: {_first_line(first)})"
            return captured
        except _NotOneTrace as exc:
            with _state_kept(module):
                captured = _capture_export(module, tuple(example_inputs), live, names)
            captured.how = f"torch.export (one trace did not apply: {_first_line(exc)})"
            return captured


def _distinct(example_inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Example inputs that share memory with an earlier one, copied: one tensor passed for two
    arguments (`(x, x)`, nn.MultiheadAttention's `(q, q, q)`) would be traced as one input, or down
    a path chosen by `key is query`, and later calls with different tensors would compute the wrong
    function. Calls may still pass aliased tensors: the graph does not write its inputs."""
    seen: set[int] = set()
    result = []
    for t in example_inputs:
        try:
            ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        except (RuntimeError, NotImplementedError):  # a tensor without real storage (fake, meta)
            ptr = 0
        result.append(t.clone() if ptr and ptr in seen else t)
        seen.add(ptr)
    return tuple(result)


@contextlib.contextmanager
def _state_kept(module: torch.nn.Module) -> Iterator[None]:
    """Every submodule's parameters, buffers and tensor attributes put back as they were, whatever
    the traces did.

    The traces swap the model's tensors for traced ones (torch.func.functional_call, torch.export)
    and swap them back by name. A submodule registered under two parents (timm's CoaT shares one
    positional-encoding convolution between blocks) is reached by two names, and torch's restore
    (`_reparametrize_module`, tie_weights) put the first name's original back, then the traced
    tensor saved under the second: the user's model was left holding a functionalized fake tensor
    instead of its Parameter, and every later trace of it (a new batch size, torch.compile) failed
    inside functorch (a CPU sweep of timm, session 26). A forward that caches a tensor in a plain
    attribute (`self.cache = ...`, a position table built for the current length) stored a traced
    tensor there: eager calls afterwards computed with it, or raised."""
    # (table, its entries now, whether it is the module's own __dict__: there only tensors the trace
    # made are undone, since a forward may legitimately change its plain attributes)
    kept = [(table, dict(table), table is owner.__dict__) for owner in module.modules()
            for table in (owner._parameters, owner._buffers, owner.__dict__)]
    try:
        yield
    finally:
        for table, before, plain in kept:
            for name, value in list(table.items()):
                if name not in before:
                    if _traced(value):
                        del table[name]
                elif value is not before[name] and (not plain or _traced(value)):
                    table[name] = before[name]
            if not plain:
                table.update({name: value for name, value in before.items() if name not in table})


def _traced(value: Any) -> bool:
    """A tensor the trace made (fake, or functorch's wrapper of one), never a model's own."""
    return isinstance(value, torch.Tensor) and (is_fake(value) or torch._C._functorch.is_functorch_wrapped_tensor(value))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


class _CacheOutput(RuntimeError):
    """torch.export found a transformers cache object among the model's outputs."""


def _hf_cache_registered() -> bool:
    """Registers transformers' pytree flattening of DynamicCache (its torch.export support) once;
    False where that cannot be done (an older transformers, or already registered and still
    failing, or a cache class it does not cover)."""
    global _HF_CACHE_DONE
    if _HF_CACHE_DONE:
        return False
    _HF_CACHE_DONE = True
    try:
        from transformers.cache_utils import EncoderDecoderCache
        from transformers.integrations.executorch import register_dynamic_cache_export_support
        register_dynamic_cache_export_support()
    except Exception:  # noqa: BLE001 - an older or newer transformers without it: the fallback says why
        return False
    if EncoderDecoderCache not in pytree.SUPPORTED_NODES:  # seq2seq models (T5, BART, Whisper): two DynamicCaches
        pytree.register_pytree_node(
            EncoderDecoderCache, lambda cache: ([cache.self_attention_cache, cache.cross_attention_cache], None),
            lambda caches, _: EncoderDecoderCache(*caches),
            serialized_type_name=f"{EncoderDecoderCache.__module__}.{EncoderDecoderCache.__name__}")
    return True


_HF_CACHE_DONE = False


class _NotOneTrace(Exception):
    """The one-trace capture does not apply to this model (the export path takes it)."""


class _FlatOutputs(torch.nn.Module):
    """`inner` with its outputs flattened to a tuple of tensors (the structure kept in `out_spec`)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.out_spec: pytree.TreeSpec | None = None

    def forward(self, *args: Any) -> tuple[torch.Tensor, ...]:
        leaves, self.out_spec = pytree.tree_flatten(self.inner(*args))
        if not all(isinstance(v, torch.Tensor) for v in leaves):
            raise _NotOneTrace("the model returns values other than tensors")
        return tuple(leaves)


def _capture_functional(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], names: list[str]) -> Captured:
    """One fake-tensor trace: make_fx over functionalize(functional_call(module)). Tied weights are
    one placeholder (functional_call ties them); in-place updates of buffers (batch-norm statistics
    in training mode) come out of functionalize as copy_ into the buffer's placeholder, which become
    extra outputs written back by the runtime (`Captured.mutated`)."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module
    from torch.fx.experimental.proxy_tensor import make_fx

    state = dict(module.named_parameters()) | dict(module.named_buffers())
    keys = list(state)
    spec: list[pytree.TreeSpec] = []

    def run(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        result = torch.func.functional_call(module, dict(zip(keys, args[:len(keys)], strict=True)),
                                            tuple(args[len(keys):]))
        leaves, out_spec = pytree.tree_flatten(result)
        if not all(isinstance(v, torch.Tensor) for v in leaves):
            raise _NotOneTrace("the model returns values other than tensors")
        spec.append(out_spec)
        return tuple(leaves)

    try:
        # a lazy GraphModule: its Python code is generated only if something calls it; the plan reads
        # the graph alone (swin_t: ~0.05 s of a 1.7 s compile on the CPU: two code generations of ~2,000 nodes)
        with torch.no_grad(), warnings.catch_warnings(), _compiling(), _use_lazy_graph_module(True):
            warnings.simplefilter("ignore", FutureWarning)
            gm = make_fx(torch.func.functionalize(run, remove="mutations"), decomposition_table=decomposition_table(),
                         tracing_mode="fake", _allow_non_fake_inputs=True)(*state.values(), *inputs)
    except _NotOneTrace:
        raise
    except Exception as exc:  # noqa: BLE001 - e.g. data-dependent control flow: the next path tries
        raise _NotOneTrace(f"{type(exc).__name__}: {exc}") from exc
    _functional_views(gm)
    for node in gm.graph.nodes:
        if _writes_arguments(node):
            # functionalize left an op writing its arguments: AOTAutograd's export turns it into its
            # functional form (the runtime must not replay a write, e.g. while a CUDA graph warms up)
            raise _NotOneTrace(f"{node.target} writes to its arguments")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    owner = dict(zip(placeholders, keys))  # the state's placeholders; the rest are the user's inputs
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    results = list(output.args[0])
    mutated: list[tuple[int, torch.Tensor]] = []
    parameters = {name for name, _ in module.named_parameters()}
    for node in [n for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default]:
        target = node.args[0]
        if not (isinstance(target, torch.fx.Node) and target.op == "placeholder"):
            # functionalize leaves the writes of some composite ops (circular padding's copies into
            # slices of the padded tensor it made): the graph would drop them as dead code
            raise _NotOneTrace(f"{node.name} writes into a view of a tensor the trace made")
        key = owner.get(target)
        if key is None or key in parameters:
            raise NotImplementedError("the model modifies one of its inputs or parameters in place; streamfuse.compile "
                                      "does not support that (torch.compile(backend='streamfuse') does)")
        mutated.append((len(results), state[key]))
        results.append(node.args[1])
        node.replace_all_uses_with(node.args[1])
        gm.graph.erase_node(node)
    output.args = (tuple(results),)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    bound = {n.name: state[key] for n, key in owner.items()}
    return Captured(gm=gm, bound=bound, out_spec=spec[-1], input_names=names, mutated=mutated)


def _functional_views(gm: torch.fx.GraphModule) -> None:
    """An in-place view op (`as_strided_`, `transpose_`: a new shape for the same memory) whose
    argument nothing else reads becomes its out-of-place view: no one can tell the difference, and
    the trace stays on this path (convnext's and swin's pooling left `mean -> as_strided_`, which sent
    them through AOTAutograd's export: a second trace, the slowest part of their compile)."""
    for node in list(gm.graph.nodes):
        target = node.target
        if not (isinstance(target, torch._ops.OpOverload) and torch.Tag.inplace_view in target.tags):
            continue
        base = node.args[0] if node.args else None
        if not (isinstance(base, torch.fx.Node) and base.op != "placeholder" and list(base.users) == [node]):
            continue
        packet = getattr(torch.ops.aten, target._schema.name.split("::")[-1].rstrip("_"), None)
        functional = getattr(packet, target._overloadname, None) if packet is not None else None
        if not isinstance(functional, torch._ops.OpOverload) or \
                [a.name for a in functional._schema.arguments] != [a.name for a in target._schema.arguments]:
            continue
        node.target = functional
    gm.graph.lint()


def _writes_arguments(node: torch.fx.Node) -> bool:
    """An op that modifies one of its arguments in place: by its schema, or training batch-norm,
    whose schema does not say that it updates the running statistics."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target is torch.ops.aten.copy_.default:
        return False
    if target is torch.ops.aten.native_batch_norm.default:
        training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training")
        running_mean = node.args[3] if len(node.args) > 3 else node.kwargs.get("running_mean")
        return bool(training) and running_mean is not None
    return target._schema.is_mutable


def _compiling() -> contextlib.AbstractContextManager[Any]:
    """torch.compiler.is_compiling() is True while we trace, as under torch.export's non-strict
    trace: libraries skip data-dependent checks then (transformers' mask helpers test
    `(mask == 0).all()` unless they see a compiler)."""
    try:
        from torch._export.utils import _compiling_state_context
    except ImportError:  # a torch without it: such checks send the model to the next path
        return contextlib.nullcontext()
    return _compiling_state_context()


def _capture_one_trace(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], live: dict[str, torch.Tensor],
                       names: list[str]) -> Captured:
    from torch._functorch.aot_autograd import aot_export_module

    flat = _FlatOutputs(module)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            gm, sig = aot_export_module(flat, inputs, trace_joint=False, decompositions=decomposition_table())
    except _NotOneTrace:
        raise
    except Exception as exc:  # noqa: BLE001 - e.g. a graph break Python tracing cannot take: try export
        raise _NotOneTrace(str(exc)) from exc
    if sig.user_inputs_to_mutate or sig.parameters_to_mutate:
        raise NotImplementedError("the model modifies one of its inputs or parameters in place; streamfuse.compile "
                                  "does not support that (torch.compile(backend='streamfuse') does)")
    assert flat.out_spec is not None
    bound = {name: live[fqn.removeprefix("inner.")]
             for name, fqn in (sig.inputs_to_parameters | sig.inputs_to_buffers).items()}
    (results,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
    mutated = [(i, live[sig.buffers_to_mutate[r.name].removeprefix("inner.")])
               for i, r in enumerate(results) if r.name in sig.buffers_to_mutate]
    return Captured(gm=gm, bound=bound, out_spec=flat.out_spec, input_names=names, mutated=mutated)


@contextlib.contextmanager
def _without_partial_graph() -> Iterator[None]:
    """torch.export prints the partial FX graph of a trace that failed (at a data-dependent branch: the
    whole model's ops so far, hundreds of lines) to stderr, once per wrapper layer (twice in torch
    2.13), before it raises. streamfuse goes on through the backend and says why in one warning, so
    that print is dropped; anything else written to stderr meanwhile is passed on."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stderr(buffer):
            yield
    except BaseException as exc:
        text, partial = buffer.getvalue(), getattr(exc, "partial_fx_graph", None)
        sys.stderr.write(text.replace(f"{partial}\n", "") if partial is not None else text)
        raise
    sys.stderr.write(buffer.getvalue())


def _capture_export(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], live: dict[str, torch.Tensor],
                    names: list[str]) -> Captured:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch-internal pytree deprecations
        try:
            with _without_partial_graph():
                ep = torch.export.export(module, inputs, strict=False)
        except RuntimeError as exc:
            cache = re.search(r"<class '([\w.]*Cache)'> in output", str(exc))
            if cache is None:
                raise
            raise _CacheOutput(f"the model returns a {cache.group(1)} (Hugging Face's past_key_values), which "
                               "a compiled graph cannot build: set model.config.use_cache = False, or compile a "
                               "wrapper that returns the logits; torch.compile(model, backend='streamfuse') "
                               "takes the model as it is") from exc
        ep = ep.run_decompositions(export_decomposition_table())
    bound: dict[str, torch.Tensor] = {}
    literals: set[str] = set()
    for spec in ep.graph_signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            bound[spec.arg.name] = live.get(spec.target, ep.state_dict.get(spec.target))  # type: ignore[arg-type]
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            bound[spec.arg.name] = ep.constants[spec.target]  # type: ignore[index]
            literals.add(spec.arg.name)
        elif spec.kind != InputKind.USER_INPUT:
            raise NotImplementedError(f"export input kind {spec.kind} is not supported")
    mutated = []
    for i, spec in enumerate(ep.graph_signature.output_specs):
        if spec.kind == OutputKind.BUFFER_MUTATION:
            mutated.append((i, live[spec.target]))  # type: ignore[index]
        elif spec.kind == OutputKind.USER_INPUT_MUTATION:
            raise NotImplementedError("the model modifies one of its inputs in place; streamfuse.compile "
                                      "does not support input mutation (torch.compile(backend='streamfuse') does)")
        elif spec.kind != OutputKind.USER_OUTPUT:
            raise NotImplementedError(f"export output kind {spec.kind} is not supported")
    return Captured(gm=ep.graph_module, bound=bound, out_spec=ep.call_spec.out_spec, input_names=names,
                    mutated=mutated, literals=frozenset(literals))
