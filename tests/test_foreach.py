"""Optimizer multi-tensor ops (`_foreach_*`) decomposed per element (capture/foreach.py), and an
optimizer step compiled through the backend against eager's."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import streamfuse
import streamfuse.capture.backend as backend_module
from streamfuse.capture.foreach import foreach_decompositions

SHAPES = [(4, 5), (3,), (2, 3, 2)]


def _example(arg: Any, gen: torch.Generator) -> Any:
    """A value for one schema argument: tensors in (0.2, 0.9), inside every op's domain."""
    kind = str(arg.type)
    if kind == "List[Tensor]":
        return [torch.rand(s, generator=gen) * 0.7 + 0.2 for s in SHAPES]
    if kind == "Tensor":
        return torch.rand(len(SHAPES), generator=gen) * 0.7 + 0.2 if arg.name == "scalars" else torch.tensor(0.3)
    if kind == "List[number]" or kind == "List[Scalar]":
        return [0.5, 1.5, 2.0]
    if kind in ("number", "Scalar"):
        return 0.7 if arg.name != "ord" else 2
    if kind == "bool":
        return False
    if kind.startswith("Optional") or kind.endswith("?"):
        return None
    raise AssertionError(f"no example for {arg.name}: {kind}")


@pytest.mark.parametrize("overload", sorted(foreach_decompositions(), key=str), ids=str)
def test_each_decomposition_matches_the_foreach_op(overload: Any) -> None:
    gen = torch.Generator().manual_seed(0)
    args = [_example(a, gen) for a in overload._schema.arguments if not a.is_out and not a.kwarg_only]
    kwargs = {a.name: _example(a, gen) for a in overload._schema.arguments if a.kwarg_only and not a.is_out}
    want = overload(*args, **kwargs)
    got = foreach_decompositions()[overload](*args, **kwargs)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m, i=i: f"element {i}: {m}")


def test_the_optimizer_ops_are_decomposed() -> None:
    table = foreach_decompositions()
    aten = torch.ops.aten
    for op in (aten._foreach_add.List, aten._foreach_mul.Scalar, aten._foreach_lerp.Scalar, aten._foreach_addcmul.Scalar,
               aten._foreach_addcdiv.ScalarList, aten._foreach_sqrt.default, aten._foreach_div.ScalarList,
               aten._foreach_addcdiv.Tensor):
        assert op in table, op


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, foreach=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
}


def _params(device: torch.device) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32,), (16, 16, 3), (7,)] * 3
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device)
    return params


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_step_through_the_backend_updates_in_place_like_eager(name: str, config: streamfuse.Config,
                                                                         device: torch.device) -> None:
    """The step's multi-tensor ops become generated kernels, and its in-place updates of parameters
    and states are written back inside the plan (Graph.writebacks): every step applied exactly once,
    also on the GPU, where recording the CUDA graph runs the plan for real."""
    torch._dynamo.reset()
    params, ref = _params(device), _params(device)
    opt, opt_ref = OPTIMIZERS[name](params), OPTIMIZERS[name](ref)
    first = len(backend_module.compiled_graphs)
    step = torch.compile(opt.step, backend=streamfuse.make_backend(config))
    for k in range(5):
        step()
        opt_ref.step()
        for i, (p, r) in enumerate(zip(params, ref, strict=True)):
            # a few float32 ulps: the compiled step computes its bias corrections in float32 tensors
            # (eager in Python floats), as Inductor's does (benchmarks/optimizer.py)
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6, msg=lambda m, i=i, k=k: f"step {k}, param {i}: {m}")
            for key, value in opt_ref.state[r].items():
                # the compiled step keeps Adam's step count on the parameters' device (torch.compile makes
                # optimizers capturable), eager on the CPU
                torch.testing.assert_close(opt.state[p][key].to(value.device), value, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, i=i, key=key: f"state {key} of param {i}: {m}")
    graphs = backend_module.compiled_graphs[first:]
    assert graphs, "the step was not compiled through the backend"
    plan = graphs[-1].compiled if hasattr(graphs[-1], "compiled") else graphs[-1]
    if getattr(plan, "_fallback", None) is not None and plan.compiled is None:
        plan = plan._fallback
    graph = plan.base.graph
    assert graph.writebacks, "the updates were not written back inside the plan"
    assert not any("_foreach" in n.op for n in graph.nodes), [n.op for n in graph.nodes if "_foreach" in n.op]


def test_batch_norm_running_statistics_under_no_grad(config: streamfuse.Config, device: torch.device) -> None:
    """A training-mode batch-norm called without autograd: its running statistics are updated in
    place inside the inference graph (written back), once per call, as eager does."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).to(device).train()
    eager = __import__("copy").deepcopy(model)
    compiled = torch.compile(model, backend=streamfuse.make_backend(config))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for k in range(4):
            x = torch.randn(2, 3, 10, 10, generator=gen).to(device)
            torch.testing.assert_close(compiled(x), eager(x), rtol=1e-4, atol=1e-5)
            for (name, b), (_, c) in zip(model.named_buffers(), eager.named_buffers(), strict=True):
                torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=lambda m, name=name, k=k: f"call {k}, {name}: {m}")
