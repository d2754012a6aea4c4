"""Benchmark workloads. Each builds (callable, inputs) on a device; `parallel` ones are lists of
independent models that streamfuse runs through streamfuse.parallel and other modes in sequence."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from streamfuse.demo_models import MultiBranchConv


@dataclass(frozen=True)
class Workload:
    name: str
    make: Callable[[torch.device], tuple[Any, tuple[torch.Tensor, ...]]]
    """device -> (model or fn, inputs); for parallel workloads: (list of models, list of input tuples)."""
    dtype: torch.dtype = torch.float32
    parallel: bool = False
    suites: tuple[str, ...] = ("all",)
    tolerance: float | None = None
    """Largest relative error accepted (None: runner.TOLERANCE of the dtype)."""
    rel_floor: float = 1.0
    """Relative error = max|out - ref| / max(max|ref|, rel_floor); 0 is the plain definition."""
    second_inputs: Callable[[Any, torch.device], tuple[torch.Tensor, ...]] | None = None
    """(model, device) -> inputs at a second batch size: the streamfuse modes are also checked there."""
    info: tuple[tuple[str, Any], ...] = ()
    """What the JSON says about the workload beside its name (model, batch, dtype, ...)."""


def chain8(x: torch.Tensor) -> torch.Tensor:
    """8 pointwise ops (mul, add, sigmoid, mul, sub, relu, exp, div): eager moves 8x the bytes of
    the fused kernel. Shared by the bench suite, benchmarks/foundation.py and the fusion tests."""
    y = torch.sigmoid(x * 1.5 + 0.25) * x
    y = torch.exp(torch.relu(y - 0.1))
    return y / 3.0


def _small_ops(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [torch.relu(x) * 2 + 1 for x in xs]


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def _transformer(batch: int, seq: int) -> Callable[[torch.device], tuple[Any, tuple[torch.Tensor, ...]]]:
    def make(device: torch.device) -> tuple[Any, tuple[torch.Tensor, ...]]:
        torch.manual_seed(0)
        model = nn.Sequential(*[Block(1024, 16) for _ in range(4)]).eval().to(device)
        return model, (torch.randn(batch, seq, 1024, device=device),)

    return make


def _linear_gelu(batch: int) -> Callable[[torch.device], tuple[Any, tuple[torch.Tensor, ...]]]:
    def make(device: torch.device) -> tuple[Any, tuple[torch.Tensor, ...]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4096, 4096), nn.GELU()).eval().to(device, torch.bfloat16)
        return model, (torch.randn(batch, 4096, device=device, dtype=torch.bfloat16),)

    return make


def _conv(batch: int) -> Callable[[torch.device], tuple[Any, tuple[torch.Tensor, ...]]]:
    def make(device: torch.device) -> tuple[Any, tuple[torch.Tensor, ...]]:
        torch.manual_seed(0)
        return MultiBranchConv(64).eval().to(device), (torch.randn(batch, 64, 56, 56, device=device),)

    return make


def _mlps(device: torch.device) -> tuple[Any, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                            nn.Linear(512, 512)).eval().to(device) for _ in range(4)]
    return models, tuple(torch.randn(1, 512, device=device) for _ in range(4))


def _resnet18(device: torch.device) -> tuple[Any, tuple[torch.Tensor, ...]]:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None).eval().to(device), (torch.randn(1, 3, 224, 224, device=device),)


WORKLOADS: list[Workload] = [
    Workload("pointwise chain 1K", lambda d: (chain8, (torch.randn(1024, device=d),)), suites=("all", "quick")),
    Workload("pointwise chain 64M", lambda d: (chain8, (torch.randn(64 * 2**20, device=d),))),
    Workload("softmax 4096x4096", lambda d: (lambda x: torch.softmax(x, -1), (torch.randn(4096, 4096, device=d),)),
             suites=("all", "quick")),
    Workload("layer_norm 4096x4096", lambda d: (lambda x, w, b: F.layer_norm(x, (4096,), w, b),
                                                (torch.randn(4096, 4096, device=d), torch.randn(4096, device=d),
                                                 torch.randn(4096, device=d)))),
    Workload("linear 4096 + gelu bf16, batch 8", _linear_gelu(8), torch.bfloat16),
    Workload("linear 4096 + gelu bf16, batch 4096", _linear_gelu(4096), torch.bfloat16),
    Workload("32 small pointwise ops", lambda d: (_small_ops, tuple(torch.randn(64, 64, device=d) for _ in range(32))),
             suites=("all", "quick")),
    Workload("multi-branch conv, batch 1", _conv(1)),
    Workload("multi-branch conv, batch 32", _conv(32)),
    Workload("4 MLPs, batch 1", _mlps, parallel=True, suites=("all", "quick")),
    Workload("transformer 4x1024, b1 t1", _transformer(1, 1)),
    Workload("transformer 4x1024, b8 t128", _transformer(8, 128)),
    Workload("resnet18, batch 1", _resnet18),
]


def suite(name: str, tiny: bool = False) -> list[Workload]:
    """The workloads of a suite; "models" is bench/models.py's (all of them: model_workloads filters)."""
    if name == "models":
        from streamfuse.bench.models import model_workloads

        return model_workloads(tiny=tiny)
    chosen = [w for w in WORKLOADS if name in w.suites]
    if not chosen:
        names = sorted({s for w in WORKLOADS for s in w.suites} | {"models"})
        raise ValueError(f"suite must be one of {names}, got {name!r}")
    return chosen
