"""Triton spellings of dtypes and constants, and the compute type each dtype is evaluated in."""

from __future__ import annotations

import math

import torch

INT32_LIMIT = 2**31 - 1
"""The largest offset an int32 index computes: beyond it a kernel indexes in int64."""

TL_DTYPE = {
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.float32: "tl.float32",
    torch.float64: "tl.float64",
    torch.bool: "tl.int1",
    torch.int8: "tl.int8",
    torch.uint8: "tl.uint8",
    torch.int16: "tl.int16",
    torch.int32: "tl.int32",
    torch.int64: "tl.int64",
}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision values are computed in float32 inside a kernel, rounded only on store
    (and at explicit casts), as ATen's own kernels do per op."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def literal(value: object) -> str:
    """A Python scalar as Triton source."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return 'float("nan")'
        if math.isinf(value):
            return 'float("inf")' if value > 0 else 'float("-inf")'
        return repr(value)
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) as a Triton constant")
