"""Training graphs run their 2-D convolutions channels_last (capture/train_layout.py).

The rewrite happens on Dynamo's graph before AOTAutograd; the tests check which graphs it touches,
that outputs keep eager's layout, and that gradients through the backend still match eager's (the
layout changes summation order only)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import streamfuse
from streamfuse.capture.backend import compiled_graphs
from streamfuse.capture.train_layout import channels_last_training

CL = torch.channels_last


def _rewritten(model: nn.Module, x: torch.Tensor, grad: bool = True) -> tuple[int, torch.Tensor]:
    """(convolutions rewritten, the output) with a backend that only applies the rewrite."""
    counts: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        counts.append(channels_last_training(gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        out = torch.compile(model, backend=backend)(x)
    return sum(counts), out


class _ConvNet(nn.Module):
    def __init__(self, groups: int = 1) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(4, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1, groups=groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(torch.relu(self.bn(self.c1(x)))) + 1.0


def test_training_graph_runs_convolutions_channels_last() -> None:
    x = torch.randn(2, 4, 6, 6)
    model = _ConvNet()
    n, out = _rewritten(model, x)
    assert n == 2
    assert out.is_contiguous(), "a 4-D output contiguous in eager must come back contiguous"
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)


def test_grouped_and_depthwise_graphs_stay_nchw() -> None:
    """Depthwise too: efficientnet_b0's step was 34% slower with the layout on an H100 (run 204)."""
    x = torch.randn(2, 4, 6, 6)
    assert _rewritten(_ConvNet(groups=8), x)[0] == 0  # depthwise: one channel per group
    assert _rewritten(_ConvNet(groups=2), x)[0] == 0  # four channels per group


def test_inference_graph_is_not_rewritten() -> None:
    x = torch.randn(2, 4, 6, 6)
    assert _rewritten(_ConvNet(), x, grad=False)[0] == 0
    frozen = _ConvNet().requires_grad_(False)
    assert _rewritten(frozen, x)[0] == 0


def test_values_and_gradients_match_eager_through_backend() -> None:
    """float64 through the backend (generated kernels in Triton's interpreter where installed) with
    the layout on and off: loss, every gradient and the running statistics match eager's, the output
    has eager's strides, and the compiled forward's convolutions read channels_last tensors."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64, requires_grad=True)
    for on in (True, False):
        model = _ConvNet().double()
        eager = copy.deepcopy(model)
        torch._dynamo.reset()
        start = len(compiled_graphs)
        compiled = torch.compile(model, backend=streamfuse.make_backend(streamfuse.Config(train_channels_last=on)))
        for _ in range(2):
            out_c, out_e = compiled(x), eager(x)
            assert out_c.stride() == out_e.stride()
            torch.testing.assert_close(out_c, out_e, rtol=1e-12, atol=1e-12)
            names = [name for name, _ in model.named_parameters()]
            got = torch.autograd.grad(out_c.square().sum(), [x, *model.parameters()])
            want = torch.autograd.grad(out_e.square().sum(), [x, *eager.parameters()])
            for name, g, w in zip(["input", *names], got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=f"gradient of {name} (layout {on})")
            for (name, b), c in zip(model.named_buffers(), eager.buffers(), strict=True):
                torch.testing.assert_close(b, c, rtol=1e-12, atol=1e-12, msg=f"{name} (layout {on})")
        forward = next(g for g in compiled_graphs[start:] if g is not None)
        assert ("(channels_last)" in forward.explain()) == on, "the forward's kernels store channels_last iff on"


@pytest.mark.parametrize("on", [True, False])
def test_config_switch(on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import streamfuse.capture.backend as backend_module

    seen: list[bool] = []

    def spy(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> int:
        n = channels_last_training(gm, example_inputs)
        seen.append(any(node.op == "call_method" and node.target == "contiguous" and node.kwargs.get("memory_format") is CL
                        for node in gm.graph.nodes))
        return n

    monkeypatch.setattr(backend_module, "channels_last_training", spy)
    torch._dynamo.reset()
    compiled = torch.compile(_ConvNet(), backend=streamfuse.make_backend(streamfuse.Config(train_channels_last=on)))
    compiled(torch.randn(2, 4, 6, 6)).sum().backward()
    assert seen == ([True] if on else [])


def test_batch_norm_gradients_sum_along_the_channels(config, device, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """In channels_last the batch norms' backward sums over N, H and W read rows that lie next to
    each other (the channels are innermost): they run as the rows-contiguous looped reduction, each
    row tile split across programs on a 16-SM device (on the CPU; on the GPU its own SMs, 4x the
    batch, 32x32 images, and eager in channels_last). Loss, gradients, parameters and running
    statistics match eager over three SGD steps."""
    from test_training import train_and_compare

    from streamfuse.fusion.geometry import looped_split
    from streamfuse.runtime import executable

    batch, size, layout = 8, 16, torch.contiguous_format
    if device.type == "cpu":
        monkeypatch.setattr(executable, "DEFAULT_SM_COUNT", 16)
    else:
        # 4x the batch and 4x the image: 64 rows of 32,768 fill an H100's 132 SMs twice over once
        # split (fusion/geometry.fills_rows_contiguous); at 16x16 they do not and the sums run one
        # row per program (run 205). Eager in channels_last too: cuDNN's NCHW and NHWC algorithms sum
        # a weight gradient's 32,768 products in different orders, 1.7e-5 apart in float32 even with
        # TF32 off (run 209; 3e-3 with it on, run 204). Not float64: cuDNN runs float64 NCHW whatever
        # the input's layout, and the sums would not be rows-contiguous
        batch, size, layout = batch * 4, 32, torch.channels_last
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                          nn.Conv2d(64, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).to(device, memory_format=layout)
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(batch, 3, size, size, generator=gen).to(device, memory_format=layout),
                torch.randint(0, 10, (batch,), generator=gen).to(device)) for _ in range(3)]
    first = len(compiled_graphs)
    config = config.replace(train_channels_last=True)
    train_and_compare(model, batches, lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y), config)
    plans = [getattr(g, "compiled", g) for g in compiled_graphs[first:] if g is not None]
    sums = [grp for p in plans if hasattr(p, "plan") for grp in p.plan.groups
            if grp.rows_contiguous and grp.domain is not None and grp.domain.dims == (0, 2, 3)
            and looped_split(grp.domain, config, sm_count, True)[0] > 1]
    assert len(sums) >= 2, "both batch norms' backward sums run rows-contiguous and split"
