"""Ops that depend on no input, parameter or buffer are evaluated once at compile time
(ir/constant_fold.py): a shifted-window mask built from zeros and literals, a roll's index. The
answers stay eager's; parameters stay live; what a caller gets back is never a shared constant."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import streamfuse
from streamfuse.capture import backend as backend_module


class ShiftedWindow(nn.Module):
    """swin's pattern in small: a mask built each call from zeros and slice assignments of Python
    numbers, a cyclic shift (torch.roll), masked attention scores, a projection."""

    def __init__(self, size: int = 6, window: int = 3, shift: int = 1, dim: int = 5) -> None:
        super().__init__()
        self.size, self.window, self.shift = size, window, shift
        self.proj = nn.Linear(dim, dim)

    def mask(self, device: torch.device) -> torch.Tensor:
        s, w, sh = self.size, self.window, self.shift
        img = torch.zeros((s, s), device=device)
        count = 0
        for h in ((0, -w), (-w, -sh), (-sh, None)):
            for v in ((0, -w), (-w, -sh), (-sh, None)):
                img[h[0]:h[1], v[0]:v[1]] = count
                count += 1
        windows = img.view(s // w, w, s // w, w).permute(0, 2, 1, 3).reshape(-1, w * w)
        diff = windows.unsqueeze(1) - windows.unsqueeze(2)
        return diff.masked_fill(diff != 0, -100.0).masked_fill(diff == 0, 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, size, size, dim]
        b, s, _, d = x.shape
        w = self.window
        x = torch.roll(x, shifts=(-self.shift, -self.shift), dims=(1, 2))
        win = x.view(b, s // w, w, s // w, w, d).permute(0, 1, 3, 2, 4, 5).reshape(b, -1, w * w, d)
        scores = win @ win.transpose(-1, -2) + self.mask(x.device)
        out = F.softmax(scores, dim=-1) @ win
        return self.proj(out)


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return ShiftedWindow().to(device).eval()


def _folded_notes(compiled) -> list[str]:  # type: ignore[no-untyped-def]
    return [n for n in compiled.base.graph.notes if "evaluated once at compile time" in n]


def test_the_mask_and_the_roll_index_are_computed_once(config, device) -> None:  # type: ignore[no-untyped-def]
    model = _model(device)
    x = torch.randn(2, 6, 6, 5, device=device)
    with torch.no_grad():
        want = model(x)
        folded = streamfuse.compile(model, (x,), config)
        plain = streamfuse.compile(model, (x,), config.replace(fold_constants=False))
        torch.testing.assert_close(folded(x), want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(plain(x), want, rtol=1e-4, atol=1e-5)
        x2 = torch.randn(3, 6, 6, 5, device=device)  # another batch: its own capture, folded too
        torch.testing.assert_close(folded(x2), model(x2), rtol=1e-4, atol=1e-5)
    assert _folded_notes(folded) and not _folded_notes(plain)
    ops = [n.op for n in folded.base.graph.nodes]
    assert not any(op in ops for op in ("aten.slice_scatter.default", "aten.arange.start_step",
                                        "aten.lift_fresh_copy.default", "aten.fmod.Scalar",
                                        "aten.index_select.default"))  # the roll: a cat of two slices
    assert ops.count("aten.cat.default") >= 2
    assert "aten.fmod.Scalar" in [n.op for n in plain.base.graph.nodes]  # the mask, computed at every call
    assert folded.stats["kernels"] < plain.stats["kernels"]
    explained = folded.explain()
    assert "evaluated once at compile time" in explained and "read as a cat of two slices" in explained


def test_a_roll_by_any_shift_and_a_zero_pad(config, device) -> None:  # type: ignore[no-untyped-def]
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = F.pad(torch.roll(x, shifts=(2, -3), dims=(1, 3)), (0, 0, 0, 0)) * 2.0
        return torch.roll(y, shifts=1, dims=0) + torch.roll(x, shifts=5, dims=2)  # 5 of 5: no shift

    x = torch.randn(3, 5, 5, 7, device=device)
    compiled = streamfuse.compile(fn, (x,), config)
    torch.testing.assert_close(compiled(x), fn(x))
    ops = [n.op for n in compiled.base.graph.nodes]
    assert "aten.index_select.default" not in ops and "aten.constant_pad_nd.default" not in ops


def test_parameters_stay_live(config, device) -> None:  # type: ignore[no-untyped-def]
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))
            self.register_buffer("offset", torch.arange(3, dtype=torch.float32))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale.exp() + (self.offset * 2 + torch.arange(3, device=x.device))

    model = Scaled().to(device).eval()
    x = torch.randn(4, 3, device=device)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config)
        torch.testing.assert_close(compiled(x), model(x))
        model.scale.add_(0.25)  # changed in place after the compile: read live, as without folding
        model.offset.mul_(3.0)
        torch.testing.assert_close(compiled(x), model(x))


def test_a_returned_constant_is_computed_afresh(config, device) -> None:  # type: ignore[no-untyped-def]
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids = torch.arange(6, device=x.device) * 2
        return x + ids.view(2, 3).float(), ids, ids.view(3, 2)

    x = torch.randn(2, 3, device=device)
    compiled = streamfuse.compile(fn, (x,), config)
    first = compiled(x)
    first[1].fill_(-7)  # the caller owns what it gets
    first[2].zero_()
    for got, want in zip(compiled(x), fn(x), strict=True):
        torch.testing.assert_close(got, want)


def test_the_size_limit_leaves_large_results_to_run(config, device) -> None:  # type: ignore[no-untyped-def]
    model = _model(device)
    x = torch.randn(2, 6, 6, 5, device=device)
    with torch.no_grad():
        small = streamfuse.compile(model, (x,), config.replace(fold_constants_max_bytes=16))
        torch.testing.assert_close(small(x), model(x), rtol=1e-4, atol=1e-5)
    ops = [n.op for n in small.base.graph.nodes]
    assert "aten.fmod.Scalar" in ops  # the 6x6 mask (144 bytes) is over the limit: computed at every call


def test_both_entry_points_and_training(config, device) -> None:  # type: ignore[no-untyped-def]
    model = _model(device)
    x = torch.randn(2, 6, 6, 5, device=device)
    kept: list = []  # type: ignore[type-arg]
    register = backend_module.compiled_graphs.append
    backend_module.compiled_graphs.append = lambda g: (kept.append(g), register(g))  # type: ignore[method-assign]
    try:
        opt = torch.compile(model, backend=streamfuse.make_backend(config), dynamic=False)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)
        model.train()
        torch._dynamo.reset()
        opt = torch.compile(model, backend=streamfuse.make_backend(config), dynamic=False)
        xs = x.clone().requires_grad_(True)
        opt(xs).square().sum().backward()
        got = [xs.grad] + [p.grad for p in model.parameters()]
        model.zero_grad()
        xe = x.clone().requires_grad_(True)
        model(xe).square().sum().backward()
        for g, e in zip(got, [xe.grad] + [p.grad for p in model.parameters()], strict=True):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
    finally:
        backend_module.compiled_graphs.append = register  # type: ignore[method-assign]
        torch._dynamo.reset()
    notes = [n for g in kept for n in getattr(getattr(g, "compiled", None) or g, "explain", lambda: "")().splitlines()
             if "evaluated once at compile time" in n]
    assert notes, "the backend's graphs folded nothing"


def test_a_full_read_by_a_kernel_stays_in_the_kernel(config, device) -> None:  # type: ignore[no-untyped-def]
    """torch.full (and pointwise ops on it) costs nothing computed where it is read; folded, it would
    be loaded from memory on every call instead."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        bias = torch.full((4, 5), 2.0, device=x.device) * 3.0
        return x + bias + torch.arange(5, device=x.device)

    x = torch.randn(4, 5, device=device)
    compiled = streamfuse.compile(fn, (x,), config)
    torch.testing.assert_close(compiled(x), fn(x))
    ops = [n.op for n in compiled.base.graph.nodes]
    assert "aten.full.default" in ops and "aten.arange.start_step" not in ops
    folded = [n for n in compiled.base.graph.constants if n.name.endswith("_const")]
    assert [n.shape for n in folded] == [(5,)]  # the arange's result only


def test_folds_real_values_under_fake_tensor_mode(config) -> None:  # type: ignore[no-untyped-def]
    """The backend's compiler may run inside AOTAutograd's FakeTensorMode: what it folds must still be
    real data (a fake `arange` constant cannot run)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x: torch.Tensor) -> tuple[torch.Tensor]:
        pos = torch.arange(6) % 4
        return (x * (pos >= 2) + torch.roll(x, 2, 1),)

    x = torch.randn(3, 6)
    gm = make_fx(f)(x)
    compiler = backend_module._compiler(config)
    with FakeTensorMode() as mode:
        run = compiler(gm, [mode.from_tensor(x)])
    compiled = backend_module.compiled_graphs[-1]
    assert _folded_notes(compiled)
    assert not any(isinstance(t, FakeTensor) for t in compiled.base.graph.constants.values())
    (out,) = run([x])
    torch.testing.assert_close(out, f(x)[0])


class _RelativeIndices(nn.Module):
    """ConViT's pattern: relative position indices built each call with factories that name no device
    (so on the CPU, whatever the model's device), filled by slice assignment and moved with
    `.to(device)` before they meet the activations."""

    def __init__(self, side: int = 3, dim: int = 6) -> None:
        super().__init__()
        self.side = side
        self.proj = nn.Linear(3, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, side * side, dim]
        n = self.side * self.side
        ind = torch.arange(self.side).view(1, -1) - torch.arange(self.side).view(-1, 1)
        rel = torch.zeros(1, n, n, 3)
        rel[:, :, :, 0] = ind.repeat(self.side, self.side).unsqueeze(0)
        rel[:, :, :, 1] = ind.repeat_interleave(self.side, 0).repeat_interleave(self.side, 1).unsqueeze(0)
        rel[:, :, :, 2] = rel[:, :, :, 0] ** 2 + rel[:, :, :, 1] ** 2
        bias = self.proj(rel.to(x.device)).mean(-1)  # [1, n, n]
        return torch.softmax(x @ x.transpose(-1, -2) + bias, -1) @ x


def test_cpu_side_indices_of_a_model_on_the_device(config, device) -> None:  # type: ignore[no-untyped-def]
    """Tensors folded from CPU factories are moved to the graph's device once (runtime/inputs.py
    move_cpu_snapshots): on a GPU a kernel reading them in host memory failed to launch and its group
    ran eagerly (ConViT, run 182). Both entry points and a training step through the backend match
    eager, with no fallback."""
    import warnings

    torch.manual_seed(0)
    model = _RelativeIndices().to(device)
    x = torch.randn(2, 9, 6, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", streamfuse.StreamfuseFallbackWarning)
        with torch.no_grad():
            compiled = streamfuse.compile(model, (x,), config)
            torch.testing.assert_close(compiled(x), model(x))
        torch._dynamo.reset()
        fast = torch.compile(model, backend=streamfuse.make_backend(config))
        xr = x.clone().requires_grad_()
        fast(xr).pow(2).sum().backward()
        want = x.clone().requires_grad_()
        grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        model.zero_grad()
        model(want).pow(2).sum().backward()
        torch.testing.assert_close(xr.grad, want.grad)
        for got, p in zip(grads, model.parameters(), strict=True):
            torch.testing.assert_close(got, p.grad)


def test_folded_cpu_constants_follow_the_graph_device(config) -> None:  # type: ignore[no-untyped-def]
    """The move itself, on a CPU-compiled graph sent to another device ("meta" stands in for a GPU):
    every snapshot constant moves, except those an output returns or views."""
    from streamfuse.ir.constant_fold import returned_nodes
    from streamfuse.runtime.inputs import move_cpu_snapshots

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ind = (torch.arange(4).view(1, -1) - torch.arange(4).view(-1, 1)).float()
        return x @ ind, torch.arange(4).view(2, 2)

    x = torch.randn(3, 4)
    compiled = streamfuse.compile(fn, (x,), config)
    graph = compiled.base.graph
    moved = [n for n in graph.constants if n in graph.snapshots and n not in returned_nodes(graph)]
    assert moved, "nothing was folded into a snapshot"
    move_cpu_snapshots(graph, torch.device("meta"))
    for n, value in graph.constants.items():
        if n in graph.snapshots:
            assert value.device.type == ("meta" if n in moved else "cpu"), n.name
