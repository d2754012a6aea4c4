"""The embedded default models of `streamfuse demo`: a small transformer block and a
multi-branch (inception-style) conv block, each with example inputs."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class TransformerBlock(nn.Module):
    """Pre-norm attention + GELU MLP with residuals: layer_norm, softmax, pointwise chains."""

    def __init__(self, d_model: int = 256, heads: int = 4, mlp_ratio: int = 4):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, mlp_ratio * d_model)
        self.fc2 = nn.Linear(mlp_ratio * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = self.qkv(h).split(d, dim=-1)
        q = q.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        attn = torch.softmax(scores, dim=-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class MultiBranchConv(nn.Module):
    """Four parallel conv branches with BN + ReLU, concatenated, plus a residual."""

    def __init__(self, channels: int = 32):
        super().__init__()
        c = channels // 4
        self.b1 = nn.Sequential(nn.Conv2d(channels, c, 1), nn.BatchNorm2d(c), nn.ReLU())
        self.b2 = nn.Sequential(nn.Conv2d(channels, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
        self.b3 = nn.Sequential(nn.Conv2d(channels, c, 5, padding=2), nn.BatchNorm2d(c), nn.ReLU())
        self.b4 = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(channels, c, 1), nn.BatchNorm2d(c), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], dim=1)
        return F.relu(y + x) * torch.sigmoid(y.mean(dim=(2, 3), keepdim=True))


def _randomize_bn(model: nn.Module, gen: torch.Generator) -> None:
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)


def transformer_block(device: torch.device, dtype: torch.dtype = torch.float32,
                      batch: int = 4, seq: int = 64) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = TransformerBlock().eval().to(device=device, dtype=dtype)
    x = torch.randn(batch, seq, 256, generator=gen).to(device=device, dtype=dtype)
    return model, (x,)


def conv_block(device: torch.device, dtype: torch.dtype = torch.float32,
               batch: int = 2, size: int = 16) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    model = MultiBranchConv()
    with torch.no_grad():
        _randomize_bn(model, gen)
    model = model.eval().to(device=device, dtype=dtype)
    x = torch.randn(batch, 32, size, size, generator=gen).to(device=device, dtype=dtype)
    return model, (x,)


DEMO_MODELS: dict[str, Callable[..., tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "transformer_block": transformer_block,
    "multibranch_conv": conv_block,
}
