"""ir/weight_fold.py: what a model computes from its parameters and buffers alone is evaluated once,
kept as a watched snapshot, and computed again in place when a source changes in place."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

import streamfuse
from streamfuse.capture.backend import compiled_graphs

FOLD_NOTE = "computed from parameters and buffers alone"


def _close(out: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    err = float((out.double() - ref.double()).abs().max()) / max(float(ref.double().abs().max()), 1e-6)
    assert err <= tol, f"relative error {err:.2e}"


def _ops(compiled: Any) -> list[str]:
    return [n.op for g in compiled.plan.groups for n in g.nodes]


def _notes(compiled: Any) -> list[str]:
    return [n for n in compiled.graph.notes if FOLD_NOTE in n]


class _Normalised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = parametrizations.weight_norm(nn.Conv2d(3, 8, 3, padding=1))
        self.mid = parametrizations.spectral_norm(nn.Linear(8, 8))
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(F.gelu(self.conv(x)).mean((2, 3)))))


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    model = _Normalised().to(device).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def test_normalised_weights_are_computed_once_and_follow_in_place_updates(config: Any, device: torch.device) -> None:
    model = _model(device)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1)).to(device)
    folded = streamfuse.compile(model, (x,), config)
    plain = streamfuse.compile(model, (x,), config.replace(fold_weights=False))
    assert _notes(folded) and not _notes(plain)
    assert "aten.linalg_vector_norm.default" in _ops(plain)  # weight_norm's norm, per call
    assert "aten.linalg_vector_norm.default" not in _ops(folded), folded.explain(source=False)
    assert folded.stats["kernels"] < plain.stats["kernels"]
    with torch.no_grad():
        _close(folded(x), model(x))
        # an optimizer-like step on the parametrizations' tensors: the snapshots are computed again
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
        want = model(x)
        _close(folded(x), want)
        _close(plain(x), want)
        assert folded.weights_watch is not None and folded.weights_watch.refreshes == 1
        state = {k: v + 0.05 for k, v in model.state_dict().items()}
        model.load_state_dict(state)
        _close(folded(x), model(x))


def test_the_backend_folds_and_binds_again_unfolded_after_a_change(config: Any, device: torch.device) -> None:
    model = _model(device)
    x = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(2)).to(device)
    torch._dynamo.reset()
    fast = torch.compile(model, backend=streamfuse.make_backend(config))
    with torch.no_grad():
        _close(fast(x), model(x))
        graph = compiled_graphs[-1]
        assert graph.weight_folds > 0 and "folded into snapshots" in graph.explain(source=False)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
        _close(fast(x), model(x))
        assert graph.live and graph.weight_folds == 0


def test_weights_cast_under_autocast_once(config: Any, device: torch.device) -> None:
    """Every call under autocast casts each float32 weight of a Linear to the autocast dtype; folded,
    the plan casts only the activation."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)).to(device).eval()
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(3)).to(device)
    dtype = torch.bfloat16

    def autocast() -> Any:  # left between calls: autocast caches a weight's cast within one region
        return torch.autocast(device.type, dtype=dtype)

    with autocast():
        folded = streamfuse.compile(model, (x,), config)
        plain = streamfuse.compile(model, (x,), config.replace(fold_weights=False))
    weights = {id(p) for p in model.parameters()}
    assert not any(id(t) in weights for t in folded.graph.constants.values()), "a weight is still cast per call"
    assert any(id(t) in weights for t in plain.graph.constants.values())
    assert _notes(folded)
    for step in range(2):
        with autocast(), torch.no_grad():
            want = model(x)
            _close(folded(x), want, 2e-2)
            _close(plain(x), want, 2e-2)
        with torch.no_grad():
            model[0].weight.mul_(-1.5)  # a large change: stale snapshots would be far off
    torch._dynamo.reset()
    fast = torch.compile(model, backend=streamfuse.make_backend(config))
    with autocast(), torch.no_grad():
        _close(fast(x), model(x), 2e-2)
    assert compiled_graphs[-1].weight_folds > 0


class _Counter(nn.Module):
    """A buffer the forward updates in place, and a table derived from it: never a snapshot."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return F.embedding(idx, self.table * self.calls)


def test_a_buffer_the_graph_writes_is_not_folded(config: Any, device: torch.device) -> None:
    model = _Counter().to(device)
    ref = copy.deepcopy(model)
    idx = torch.tensor([[1, 3, 5], [2, 4, 9]], device=device)
    compiled = streamfuse.compile(model, (idx,), config)
    assert not _notes(compiled)
    with torch.no_grad():
        for _ in range(3):
            _close(compiled(idx), ref(idx))
    assert float(model.calls) == float(ref.calls)


class _Tables(nn.Module):
    """Position tables from a parameter at literal positions (GPT-2's, T5's), one of them returned."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(16, 8)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(x.shape[1], device=x.device)
        table = self.pos(positions)
        return x + table * self.scale, self.pos.weight * 2  # the second: computed afresh, the caller owns it


def test_position_tables_fold_and_outputs_stay_fresh(config: Any, device: torch.device) -> None:
    torch.manual_seed(0)
    model = _Tables().to(device).eval()
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(4)).to(device)
    compiled = streamfuse.compile(model, (x,), config)
    assert _notes(compiled)
    assert not any("embedding" in op for op in _ops(compiled)), compiled.explain(source=False)
    with torch.no_grad():
        out, doubled = compiled(x)
        want, want_doubled = model(x)
        _close(out, want)
        _close(doubled, want_doubled)
        doubled.zero_()  # the caller's tensor: the next call computes it again
        _close(compiled(x)[1], want_doubled)
        model.pos.weight.add_(1.0)
        _close(compiled(x)[0], model(x)[0])


class _SharedTable(nn.Module):
    """Each of three blocks gathers the same position table, as T5's layers each take the relative
    position bias: one computation, three regions in the trace."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(256, 1024)
        self.scales = nn.Parameter(torch.rand(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(256, device=x.device)
        for i in range(3):
            x = torch.tanh(x * self.scales[i] + self.pos(positions))
        return x


def test_identical_regions_share_one_snapshot_and_count_once(config: Any, device: torch.device) -> None:
    torch.manual_seed(0)
    model = _SharedTable().to(device).eval()
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(6)).to(device)
    table_mib = 256 * 1024 * 4 / 2**20
    # a budget of one and a half tables: the three regions hold one snapshot, so all three fold
    compiled = streamfuse.compile(model, (x,), config.replace(fold_weights_max_bytes=int(1.5 * table_mib * 2**20)))
    notes = _notes(compiled)
    assert notes and f"{table_mib:.1f} MiB kept" in notes[0], notes
    assert not any("embedding" in op for op in _ops(compiled)), compiled.explain(source=False)
    with torch.no_grad():
        _close(compiled(x), model(x))
        model.pos.weight.mul_(0.5)
        _close(compiled(x), model(x))


@pytest.mark.parametrize("budget", [1, 10_000_000])
def test_the_budget_bounds_what_is_kept(budget: int, config: Any, device: torch.device) -> None:
    model = _model(device)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(5)).to(device)
    compiled = streamfuse.compile(model, (x,), config.replace(fold_weights_max_bytes=budget))
    assert bool(_notes(compiled)) == (budget > 1)
    with torch.no_grad():
        _close(compiled(x), model(x))


def test_the_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="fold_weights_max_bytes"):
        streamfuse.Config(fold_weights_max_bytes=0)


def test_a_change_no_version_counter_sees_needs_weights_changed(config: Any, device: torch.device) -> None:
    """`.data` writes bump no counter: the snapshot keeps the old values until weights_changed()."""
    model = _model(device)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(6)).to(device)
    compiled = streamfuse.compile(model, (x,), config)
    with torch.no_grad():
        before = compiled(x).clone()
        for p in model.parameters():
            p.data.mul_(1.5)
        want = model(x)
        assert (want - before).abs().max() > 1e-3 * before.abs().max()
        compiled.weights_changed()
        _close(compiled(x), want)


def test_parallel_models_fold_their_weights(config: Any, device: torch.device) -> None:
    models = [_model(device) for _ in range(2)]
    with torch.no_grad():
        models[1].out.weight.mul_(-1)
    xs = [torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(7 + i)).to(device) for i in range(2)]
    par = streamfuse.parallel([(m, (x,)) for m, x in zip(models, xs, strict=True)], config)
    assert _notes(par.compiled)
    with torch.no_grad():
        for out, m, x in zip(par(*xs), models, xs, strict=True):
            _close(out, m(x))
        for p in models[0].parameters():
            p.add_(0.1)
        for out, m, x in zip(par(*xs), models, xs, strict=True):
            _close(out, m(x))
