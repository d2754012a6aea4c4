"""benchmarks/train_check.py, the suite's training check through the backend: it passes a correct
run, and it fails one whose compiled copy trains at other weights (its lockstep broken)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import streamfuse

pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("train_check", BENCH / "train_check.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def train_check() -> ModuleType:
    return _load()


def _spec(tc: ModuleType, name: str) -> object:
    return next(s for s in tc.MODELS if s.name == name)


def test_passes_a_correct_run(train_check: ModuleType) -> None:
    row = train_check.check(_spec(train_check, "distilbert"), True, torch.device("cpu"), calls=3,
                            config=streamfuse.Config(executor="reference"))
    assert "error" not in row, row.get("error")
    assert len(row["steps"]) == 3
    assert row["float32_grad"] < 1e-3 and row["float32_loss"] < 1e-4
    assert row["float64_grad"] < 1e-9 and row["float64_state"] < 1e-9


def test_fails_a_run_at_other_weights(train_check: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled copy keeps its first weights (as a plan reading stale parameters would): from the
    second step its gradients are not eager's at the same weights, and the check says so."""
    load = train_check.Run.load

    def stale(self: object, state: dict[str, torch.Tensor]) -> None:
        if getattr(self, "fn", None) is getattr(self, "model", None):  # the eager copies follow
            load(self, state)

    monkeypatch.setattr(train_check.Run, "load", stale)
    row = train_check.check(_spec(train_check, "distilbert"), True, torch.device("cpu"), calls=2,
                            config=streamfuse.Config(executor="reference"))
    assert "error" in row and "step 2: the backend in float64 is off" in row["error"]
    assert row["steps"][0]["float64"]["grad"] < 1e-9 and row["steps"][1]["float64"]["grad"] > 1e-3


class _SmallConvNet(torch.nn.Module):
    """Convolutions, training batch-norms, ReLU and a max-pool: the layers whose float32 gradients
    jump between steps (a ReLU input near zero, a near-tie in the pool)."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.head = nn.Linear(16, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


def test_vision_models_sample_float32_noise_in_channels_last(train_check: ModuleType) -> None:
    """A vision model gets a second eager float32 copy in channels_last, in lockstep, and the float32
    bar is twice the worse of the two eager copies' errors."""
    spec = train_check.ModelSpec("small_convnet", "vision", lambda tiny: _SmallConvNet(), size=16)
    row = train_check.check(spec, True, torch.device("cpu"), calls=2, config=streamfuse.Config(executor="reference"))
    assert "error" not in row, row.get("error")
    assert all(set(step) == {"eager", "eager_cl", "float32", "float64"} for step in row["steps"])
    for key in ("grad", "loss", "state"):
        assert row[f"noise_{key}"] == max(row[f"eager_{key}"], row[f"eager_cl_{key}"])
    assert row["float64_grad"] < 1e-9
    copy = train_check.Run(spec, True, torch.device("cpu"), torch.float32, channels_last=True)
    assert copy.model.features[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert copy.batch[0].is_contiguous(memory_format=torch.channels_last) and copy.batch[0].shape[1] == 3
