"""streamfuse.compile's capture: nn.Module or function -> aten FX graph via torch.export.

torch.export runs AOTAutograd underneath (functionalized aten graph, parameters and buffers
lifted to placeholders); `run_decompositions` lowers it with our table. Parameters and
buffers are bound to the module's own tensors, so in-place weight updates stay visible.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind, OutputKind

from streamfuse.capture.decomp import decomposition_table


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


def parameter_names(fn: Callable[..., Any], count: int) -> list[str]:
    """Names of the first `count` positional parameters of fn (args_i where it has none)."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params[:count]]
    return names + [f"args_{i}" for i in range(len(names), count)]


def normalize_inputs(example_inputs: Any) -> tuple[torch.Tensor, ...]:
    """A tensor, or a tuple/list of tensors -> tuple; anything else is a ValueError."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        for i, t in enumerate(example_inputs):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"example_inputs[{i}] must be a torch.Tensor, got {type(t).__name__}")
        return tuple(example_inputs)
    raise ValueError(f"example_inputs must be a tensor or a tuple of tensors, got {type(example_inputs).__name__}")


def capture(model: torch.nn.Module | Callable[..., Any], example_inputs: Sequence[torch.Tensor]) -> Captured:
    if not callable(model):
        raise ValueError(f"model must be an nn.Module or a callable, got {type(model).__name__}")
    module = model if isinstance(model, torch.nn.Module) else _FunctionModule(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch-internal pytree deprecations
        ep = torch.export.export(module, tuple(example_inputs), strict=False)
        ep = ep.run_decompositions(decomposition_table())
    live = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers(remove_duplicate=False))
    bound: dict[str, torch.Tensor] = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            bound[spec.arg.name] = live.get(spec.target, ep.state_dict.get(spec.target))  # type: ignore[arg-type]
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            bound[spec.arg.name] = ep.constants[spec.target]  # type: ignore[index]
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
    names = parameter_names(module.forward if module is model else model, len(example_inputs))
    return Captured(gm=ep.graph_module, bound=bound, out_spec=ep.call_spec.out_spec, input_names=names,
                    mutated=mutated)
