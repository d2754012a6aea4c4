"""A convolution reading a channel slice (ShuffleNet v2's `chunk`) gets its input from a generated
copy (ir/conv_input.py) instead of ATen's, so it can run in the network's channels_last layout with
that copy storing channels_last; dense inputs, NCHW or channels_last, are read as they are."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import streamfuse
from streamfuse.fusion.groups import GroupKind
from streamfuse.ir.indexing import channels_last_strides, contiguous_strides
from streamfuse.tune.conv_layout import eligible
from streamfuse.tune.network_layout import shuffled_view, stored_strides


def shuffle(x: torch.Tensor) -> torch.Tensor:
    b, c, h, w = x.shape
    return x.view(b, 2, c // 2, h, w).transpose(1, 2).contiguous().view(b, c, h, w)


class ShuffleBlock(nn.Module):
    """ShuffleNet v2's stride-1 unit, odd sizes: half the channels pass, half go through 1x1, depthwise
    3x3 and 1x1 convolutions, then the halves are concatenated and their channels interleaved; then a
    depthwise convolution reads the shuffled tensor whole, as a downsampling unit's branches do."""

    def __init__(self, c: int = 6) -> None:
        super().__init__()
        h = c // 2
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.branch = nn.Sequential(nn.Conv2d(h, h, 1, bias=False), nn.BatchNorm2d(h), nn.ReLU(),
                                    nn.Conv2d(h, h, 3, padding=1, groups=h, bias=False), nn.BatchNorm2d(h),
                                    nn.Conv2d(h, h, 1, bias=False), nn.BatchNorm2d(h), nn.ReLU())
        self.down = nn.Conv2d(c, c, 3, stride=2, padding=1, groups=c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.stem(x))
        for _ in range(2):
            keep, work = y.chunk(2, dim=1)
            y = shuffle(torch.cat((keep, self.branch(work)), dim=1))
        return torch.relu(self.down(y))


def model_on(device: torch.device) -> nn.Module:
    torch.manual_seed(3)
    model = ShuffleBlock().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model.to(device)


def tol(device: torch.device) -> float:
    return 5e-3 if device.type == "cuda" else 1e-4  # cuDNN's float32 convolutions run in TF32


def conv_inputs(compiled) -> list:  # type: ignore[no-untyped-def]
    return [n.args[0] for n in compiled.graph.nodes if n.op == "aten.convolution.default"]


@pytest.mark.parametrize("layout", ["native", "channels_last"])
def test_a_convolution_reading_a_channel_slice_reads_a_generated_copy(config, device, layout) -> None:  # type: ignore[no-untyped-def]
    model = model_on(device)
    x = torch.randn(2, 3, 7, 9, device=device)
    compiled = streamfuse.compile(model, (x,), config.replace(conv_layout=layout))
    copies = [a for a in conv_inputs(compiled) if a.op == "aten.clone.default"]
    assert len(copies) == 2  # the first 1x1 convolution of each unit
    assert all(tuple(c.args[0].strides) != contiguous_strides(c.shape) for c in copies)  # read from the slice
    owner = compiled.plan.group_of()
    assert all(owner[c].kind in (GroupKind.POINTWISE, GroupKind.HORIZONTAL) for c in copies)  # generated, not ATen
    convs = [n for n in compiled.graph.nodes if n.op == "aten.convolution.default"]
    if layout == "native":  # (the network layout rewrites the strides of what it stores)
        assert all(eligible(n, compiled.graph) for n in convs)
    else:
        network = compiled.base.network_layout
        assert network is not None and network.channels_last and set(copies) <= set(network.stored)
        assert all(c.strides == channels_last_strides(c.shape) for c in copies)
        # the 5-D results of the channel shuffles are stored so that their 4-D views are channels_last:
        # the copies read them coalesced, and the last one reaches the depthwise convolution unconverted
        shuffled = [n for n in network.stored if len(n.shape) == 5]
        assert len(shuffled) == 2
        for n in shuffled:
            view = shuffled_view(n)
            assert view is not None and n.strides == stored_strides(n)
            assert view.strides == channels_last_strides(view.shape)
    with torch.no_grad():
        for batch in (2, 3):
            x = torch.randn(batch, 3, 7, 9, device=device)
            torch.testing.assert_close(compiled(x), model(x), rtol=tol(device), atol=tol(device))


@pytest.mark.parametrize("channels_last", [False, True])
def test_a_dense_input_is_read_as_it_is(config, device, channels_last) -> None:  # type: ignore[no-untyped-def]
    conv = nn.Conv2d(4, 5, 3).eval().to(device)
    x = torch.randn(2, 4, 6, 6, device=device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    fn = lambda t: torch.relu(conv(t))
    compiled = streamfuse.compile(fn, (x,), config)
    assert not any(a.op == "aten.clone.default" for a in conv_inputs(compiled))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), fn(x), rtol=tol(device), atol=tol(device))


def test_the_copy_can_be_turned_off(config, device) -> None:  # type: ignore[no-untyped-def]
    model = model_on(device)
    x = torch.randn(2, 3, 7, 9, device=device)
    compiled = streamfuse.compile(model, (x,), config.replace(conv_input_copy=False, conv_layout="native"))
    assert not any(a.op == "aten.clone.default" for a in conv_inputs(compiled))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=tol(device), atol=tol(device))


@pytest.mark.parametrize("reader", ["aten", "split_h", "returned"])
def test_a_shuffle_read_otherwise_stays_row_major(config, device, reader) -> None:  # type: ignore[no-untyped-def]
    """The shuffled view read by an ATen op, split along H (not channels), or with a channel half
    returned to the caller, keeps the traced layout."""
    conv = nn.Conv2d(3, 6, 3, padding=1).eval().to(device)
    tail = nn.Conv2d(6, 6, 1).eval().to(device)

    def fn(x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        y = shuffle(torch.relu(conv(x)))
        if reader == "returned":
            return tail(y), y.chunk(2, dim=1)[1]
        if reader == "aten":
            return tail(y) + torch.cumsum(y, 2)
        top, bottom = y.split([3, 4], dim=2)
        return tail(top.contiguous()) * 2 + bottom.sum()

    x = torch.randn(2, 3, 7, 9, device=device)
    compiled = streamfuse.compile(fn, (x,), config.replace(conv_layout="channels_last"))
    network = compiled.base.network_layout
    assert network is not None and not [n for n in network.stored if len(n.shape) == 5]
    with torch.no_grad():
        got, want = compiled(x), fn(x)
        torch.testing.assert_close(got, want, rtol=tol(device), atol=tol(device))
        if reader == "returned":
            assert got[1].stride() == want[1].stride()
