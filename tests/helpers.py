"""Shared test helpers: random inputs, fp64 references, dtype tolerances."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

import streamfuse
from streamfuse import Config

# (rtol, atol) against a float64 reference of the same function on the same (rounded) inputs
TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float64: (1e-10, 1e-10),
}


def randn(*shape: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
          positive: bool = False, seed: int | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed if seed is not None else hash(shape) % 2**31)
    t = torch.randn(shape, generator=gen, dtype=torch.float64)
    if positive:
        t = t.abs() + 0.1
    return t.to(device=device, dtype=dtype)


def flat(x: Any) -> list[Any]:
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in flat(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in flat(v)]
    return [x]


def reference(fn: Callable[..., Any], inputs: Sequence[torch.Tensor]) -> list[Any]:
    """fn on float64 copies of the floating inputs, results cast back to eager's dtypes."""
    eager = flat(fn(*inputs))
    wide = [t.double() if t.is_floating_point() else t for t in inputs]
    wide_fn = copy.deepcopy(fn).double() if isinstance(fn, torch.nn.Module) else fn
    try:
        ref = flat(wide_fn(*wide))
    except RuntimeError:  # fn closes over float32 tensors: compare with eager at its own dtype
        ref = eager
    return [r.to(e.dtype) if isinstance(r, torch.Tensor) else r for r, e in zip(ref, eager, strict=True)]


def assert_close_to_reference(out: Any, fn: Callable[..., Any], inputs: Sequence[torch.Tensor],
                              scale: float = 1.0) -> None:
    outs, refs = flat(out), reference(fn, inputs)
    assert len(outs) == len(refs), f"{len(outs)} outputs, eager has {len(refs)}"
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        assert isinstance(o, torch.Tensor), f"output {i} is {type(o)}"
        assert o.shape == r.shape, f"output {i}: shape {tuple(o.shape)} != {tuple(r.shape)}"
        assert o.dtype == r.dtype, f"output {i}: dtype {o.dtype} != {r.dtype}"
        if not r.is_floating_point():
            assert torch.equal(o.cpu(), r.cpu()), f"output {i} differs"
            continue
        rtol, atol = TOLERANCE[r.dtype]
        torch.testing.assert_close(o.double().cpu(), r.double().cpu(), rtol=rtol * scale, atol=atol * scale,
                                   msg=lambda m, i=i: f"output {i}: {m}")


def compile_and_check(fn: Callable[..., Any], inputs: Sequence[torch.Tensor], config: Config,
                      scale: float = 1.0) -> streamfuse.CompiledGraph:
    compiled = streamfuse.compile(fn, tuple(inputs), config)
    out = compiled(*inputs)
    assert_close_to_reference(out, fn, inputs, scale)
    return compiled
