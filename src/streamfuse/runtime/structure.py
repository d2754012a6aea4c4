"""What streamfuse.compile's plan was captured under: the model's parameters, buffers and
submodules, and the autocast state.

A plan reads the tensors the model held when it was compiled, and computes the function its
submodules computed then. Assigning a new object afterwards (`model.fc.weight = nn.Parameter(w)`,
tying or untying weights, `model.act = nn.Tanh()`, `register_buffer` with a new tensor) leaves the
plan reading the old ones: the results would be silently stale. torch.compile's guards catch this
for the backend; streamfuse.compile has no guards, so it watches torch's global registration hooks:
every `register_parameter`, `register_buffer` and submodule assignment of any module in the process
advances one counter (a few nanoseconds, nothing else). A compiled model compares that counter with
the one it saw at its previous call (one integer compare per call); only after a change does it walk
its model and compare the modules, parameters and buffers with the ones it was compiled with.
In-place updates (`p.copy_`, optimizer steps, `load_state_dict`) register nothing and need nothing:
the plan reads that memory. `p.data = t` keeps the object but moves its memory: the data-pointer
check (runtime/memory.PointerCheck) covers that.

Autocast is part of the captured function too (it chose each op's dtype in the trace): a model
compiled outside autocast and called inside it would return float32 where eager returns bfloat16
(and the other way round), so a call under another autocast state than the compile's runs eagerly
(runtime/model_state.ModelState._in_other_mode). Two C calls per call.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.modules import module as _module
from torch.utils.hooks import RemovableHandle

from streamfuse.ir.ops import OpKind

_registrations = 0
"""Parameters, buffers and submodules registered on any module in this process since import."""
_installed = False


def _count(*_: Any) -> None:
    """The registration hook: counts, and leaves the registered object as it is (returns None).
    Not while Dynamo traces: a forward that registers something (Hugging Face's static KV cache
    does, at every call) would have Dynamo inline the hook and guard on the counter's value, so
    every call recompiled (session 38: a Llama's two graphs became six). A registration inside a
    torch.compile'd region is then not counted; streamfuse.compile's own plans run no Python."""
    if torch.compiler.is_compiling():
        return
    global _registrations
    _registrations += 1


def _install() -> None:
    global _installed
    if not _installed:
        _module.register_module_parameter_registration_hook(_count)
        _module.register_module_buffer_registration_hook(_count)
        _module.register_module_module_registration_hook(_count)
        _installed = True


def _members(model: torch.nn.Module) -> Iterator[tuple[str, str, Any]]:
    """(kind, qualified name, object) of every submodule, parameter and buffer, tied ones under each name."""
    for name, m in model.named_modules(remove_duplicate=False):
        yield "module", name, m
    for name, p in model.named_parameters(remove_duplicate=False):
        yield "parameter", name, p
    for name, b in model.named_buffers(remove_duplicate=False):
        yield "buffer", name, b


def _hooks(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(where, forward pre-hook ids, forward hook ids): the global ones, then every submodule's."""
    found = [("global", tuple(_module._global_forward_pre_hooks), tuple(_module._global_forward_hooks))]
    for name, m in model.named_modules():
        found.append((name, tuple(m._forward_pre_hooks), tuple(m._forward_hooks)))
    return found


def _hook_counts(model: torch.nn.Module) -> tuple[int, ...]:
    """What a removed hook changes where it is cheap to look at every call: the model's own and the
    global hooks (a hook registered anywhere advances RemovableHandle.next_id)."""
    return (RemovableHandle.next_id, len(model._forward_pre_hooks), len(model._forward_hooks),
            len(_module._global_forward_pre_hooks), len(_module._global_forward_hooks))


class StructureWatch:
    """The model's submodules, parameters and buffers when it was compiled (held weakly: a replaced
    one is not kept alive by the watch), and its forward hooks: the trace ran the hooks there were
    and made them part of the plan, so a hook added after compiling would never run and a removed
    one would keep running (helper sweep, session 41). Added hooks are seen anywhere (every hook
    registration advances one counter of torch's); removed ones on the model itself and among the
    global hooks (a submodule's hook removed after compiling is not seen)."""

    def __init__(self, model: torch.nn.Module):
        _install()
        self.model = model
        self._members = [(kind, name, weakref.ref(obj)) for kind, name, obj in _members(model)]
        self._seen = _registrations
        self._hooks = _hooks(model)
        self._hook_counts = _hook_counts(model)

    def replaced(self) -> str | None:
        """None while the model holds the objects and hooks it was compiled with (the usual call:
        a few integer compares), else what was replaced first."""
        if _hook_counts(self.model) != self._hook_counts:
            self._hook_counts = _hook_counts(self.model)
            now_hooks = _hooks(self.model)
            for (where, pre, post), (where_now, pre_now, post_now) in zip(self._hooks, now_hooks, strict=False):
                if where != where_now:
                    break  # a submodule added or removed since compiling: the registration check says so
                if (pre, post) != (pre_now, post_now):
                    place = "among the global module hooks" if where == "global" else f"at {where or 'the model'!r}"
                    return f"a forward hook was added or removed {place}"
            # (a submodule added since compiling is the registration check's to report)
        if _registrations == self._seen:
            return None
        self._seen = _registrations
        now = list(_members(self.model))
        for (kind, name, ref), (kind_now, name_now, obj) in zip(self._members, now, strict=False):
            if (kind, name) != (kind_now, name_now):
                return f"a {kind_now} was added or removed at {name_now or 'the model'!r}"
            if ref() is not obj:
                return f"{kind} {name or 'the model'!r} was replaced by another object"
        if len(now) != len(self._members):
            return "a submodule, parameter or buffer was added or removed"
        return None


def autocast_state(device_type: str) -> tuple[Any, ...]:
    """(enabled, dtype) of autocast for the plan's device type; dtype None while disabled."""
    if not torch.is_autocast_enabled(device_type):
        return (False, None)
    return (True, torch.get_autocast_dtype(device_type))


def describe_autocast(state: tuple[Any, ...] | None) -> str:
    if not state or not state[0]:
        return "no autocast"
    return f"autocast to {str(state[1]).removeprefix('torch.')}"


def tf32_state() -> tuple[bool, bool] | None:
    """(TF32 allowed for matmuls, for cuDNN convolutions); None where torch cannot say (it raises when
    its legacy and new precision settings were mixed)."""
    try:
        return torch._C._get_cublas_allow_tf32(), torch._C._get_cudnn_allow_tf32()
    except RuntimeError:
        return None


def tf32_baked(graph: Any, device_type: str) -> tuple[bool, bool] | None:
    """Which TF32 permissions a plan built now bakes in: (matmuls, convolutions), each True where TF32
    is allowed now and the graph has float32 work it governs (products and attention for the first,
    convolutions for the second). Kernels generated now and CUDA graphs recorded later keep the
    choice, so a call made after that permission was withdrawn would still compute in TF32. None
    where nothing is baked (not CUDA, TF32 off, or no such float32 work)."""
    if device_type != "cuda" or (state := tf32_state()) is None or not any(state):
        return None
    products = convolutions = False
    for node in graph.nodes:
        float32 = node.dtype == torch.float32 or (node.dtype is None and any(
            getattr(a, "dtype", None) == torch.float32 for a in node.args))
        if not float32:
            continue
        if "convolution" in node.op:
            convolutions = True
        elif node.kind is OpKind.CONTRACTION or "scaled_dot_product" in node.op:
            products = True
    baked = (state[0] and products, state[1] and convolutions)
    return baked if any(baked) else None


def describe_tf32(baked: tuple[bool, bool]) -> str:
    return " and ".join(w for w, on in zip(("matmuls", "convolutions"), baked, strict=True) if on)
