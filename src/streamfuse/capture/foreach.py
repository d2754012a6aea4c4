"""Decompositions of the `_foreach_*` ops (optimizers' multi-tensor updates) into one ordinary op
per list element, so an optimizer step is pointwise ops the fusion planner can fuse vertically
(one kernel per parameter's update chain) and pack horizontally (small parameters share launches).

Built from the ops' schemas, not written per op: `_foreach_X.overload(list args, ...)` becomes
`aten.X(element i of each list argument, the other arguments)`, calling the per-tensor op through
its overload packet (so `_foreach_add.Scalar` resolves to the add that takes a scalar). Arguments
that are keyword-only in the per-tensor op are passed by its names (addcmul's `value`). Three
shapes of op differ and are spelled out: a tensor of per-element scalars (`_foreach_addcmul.Tensor`,
`_foreach_addcdiv.Tensor`), `_foreach_norm` (linalg_vector_norm) and `_foreach_max` (max over all
elements). Ops without a per-tensor counterpart (`_foreach_mm`, `_foreach_powsum`) stay whole.
tests/test_foreach.py checks every decomposition against the foreach op itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten

_SPECIAL: dict[str, Callable[..., Any]] = {
    "norm": lambda x, ord=2, dtype=None: aten.linalg_vector_norm(x, ord, dtype=dtype),
    "max": lambda x: aten.max(x),
}
_SKIP = {"mm", "powsum"}
_SCALAR_FORMS = {"maximum": "clamp_min", "minimum": "clamp_max"}
"""Per-tensor ops that take no scalar: the op that does, for `_foreach_X.Scalar` / `.ScalarList`."""


def _per_element_scalars(name: str) -> Callable[..., Any] | None:
    """addcmul / addcdiv with a tensor holding one scalar per list element."""
    if name == "addcmul":
        return lambda x, a, b, s: aten.add(x, aten.mul(aten.mul(a, b), s))
    if name == "addcdiv":
        return lambda x, a, b, s: aten.add(x, aten.mul(aten.div(a, b), s))
    return None


def _decomposition(overload: torch._ops.OpOverload, name: str) -> Callable[..., Any] | None:
    schema = overload._schema
    args = [a for a in schema.arguments if not a.is_out]
    is_list = [isinstance(a.type, torch.ListType) for a in args]
    if not any(is_list):
        return None
    tensor_scalars = next((k for k, a in enumerate(args) if a.name == "scalars" and not is_list[k]
                           and a.type.isSubtypeOf(torch._C.TensorType.get())), None)
    if name in _SPECIAL:
        per: Callable[..., Any] = _SPECIAL[name]
        kw_names: list[str] = []
        positional = len(args)
    elif tensor_scalars is not None:
        found = _per_element_scalars(name)
        if found is None:
            return None
        per, kw_names, positional = found, [], len(args)
    else:
        scalar_other = len(args) > 1 and not args[1].type.isSubtypeOf(torch._C.TensorType.get()) and \
            "Tensor" not in str(args[1].type)
        packet = getattr(aten, _SCALAR_FORMS.get(name, name) if scalar_other else name, None)
        if packet is None:
            return None
        schemas = [getattr(packet, o)._schema for o in packet.overloads()]
        schemas = [sc for sc in schemas if not any(a.is_out for a in sc.arguments)] or schemas
        # foreach positional arguments beyond what any overload takes positionally are keyword-only
        # there (addcmul's value), in order
        positional = max(sum(1 for a in sc.arguments if not a.kwarg_only) for sc in schemas)
        kw_names = [a.name for a in schemas[0].arguments if a.kwarg_only]
        per = packet
    names = [a.name for a in args]
    defaults = [a.default_value if a.has_default_value() else None for a in args]

    def decompose(*call_args: Any, **call_kwargs: Any) -> list[Any]:
        values = list(call_args) + [call_kwargs.get(n, d) for n, d in zip(names[len(call_args):],
                                                                           defaults[len(call_args):], strict=True)]
        count = next(len(v) for v, listed in zip(values, is_list, strict=True) if listed)
        results = []
        for i in range(count):
            element = [v[i] if listed else (aten.select(v, 0, i) if k == tensor_scalars else v)
                       for k, (v, listed) in enumerate(zip(values, is_list, strict=True))]
            pos = [v for v, a in zip(element, args, strict=True) if not a.kwarg_only]
            kwargs = {a.name: v for v, a in zip(element, args, strict=True) if a.kwarg_only}
            extra, pos = pos[positional:], pos[:positional]
            kwargs |= dict(zip(kw_names, extra, strict=False))
            results.append(per(*pos, **kwargs))
        return results

    return decompose


@functools.cache
def foreach_decompositions() -> dict[Any, Callable[..., Any]]:
    """OpOverload -> its per-element decomposition, for every functional `_foreach_*` overload."""
    table: dict[Any, Callable[..., Any]] = {}
    for full in torch._C._dispatch_get_all_op_names():
        if not full.startswith("aten::_foreach_"):
            continue
        op_name, _, overload_name = full.removeprefix("aten::").partition(".")
        if op_name.endswith("_") or overload_name.endswith("out") or overload_name == "out":
            continue
        name = op_name.removeprefix("_foreach_")
        if name in _SKIP:
            continue
        overload = getattr(getattr(aten, op_name), overload_name or "default", None)
        if overload is None:
            continue
        decomposition = _decomposition(overload, name)
        if decomposition is not None:
            table[overload] = decomposition
    return table
