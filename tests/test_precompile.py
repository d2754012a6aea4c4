"""The kernels compiled ahead of the first call (runtime/precompile.py) are specialized the way the
launches are: otherwise the first call compiles every kernel again, one after another (seen on the
H200: GoogLeNet's first call took 81 s after an 31 s precompile, session 13)."""

from __future__ import annotations

from typing import Any

import torch
from helpers import randn

import streamfuse
from streamfuse.demo_models import MultiBranchConv
from streamfuse.runtime.precompile import runtime_layouts, warmup_args
from streamfuse.runtime.steps import KernelStep, launch_key


def _mock_key(args: list[Any]) -> tuple[Any, ...]:
    """launch_key of warmup arguments: a dtype stands for a 16-byte-aligned tensor."""
    return tuple(True if isinstance(a, torch.dtype) else launch_key([a])[0] for a in args)


def test_warmup_arguments_specialize_like_the_launches(config, device, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = MultiBranchConv(16).eval().to(device)
    x = randn(1, 16, 12, 12, device=device)
    # channels_last convolutions whose results only generated kernels read: their strides differ
    # from the traced (NCHW) ones
    cfg = config.replace(conv_layout="channels_last", executor="triton", cuda_graphs=False)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), cfg)
    steps = compiled.base.steps
    layouts = runtime_layouts(steps)
    assert layouts, "the test needs a convolution whose channels_last result is handed on"
    seen: dict[int, list[Any]] = {}
    original = KernelStep._launch

    def record(self: KernelStep, args: list[Any]) -> Any:
        seen[id(self)] = list(args)  # inputs, strides, outputs, rng, scratch: as launched
        return original(self, args)

    monkeypatch.setattr(KernelStep, "_launch", record)
    with torch.no_grad():
        compiled(x)
    kernels = [s for s in steps if isinstance(s, KernelStep)]
    assert kernels and all(id(s) in seen for s in kernels)
    for s in kernels:
        actual = seen[id(s)]
        assert launch_key(actual) == _mock_key(warmup_args(s, layouts)), s.source.fn_name
