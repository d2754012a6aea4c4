"""One activation layout across a convolutional network (tune/network_layout.py): the kernels
before the convolutions store channels_last, walking their domain in that memory order, the
convolutions read those results without a conversion, and the answers stay eager's; "auto"
keeps the network layout only when its measured convolutions beat the one-by-one choice."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import streamfuse
from streamfuse.fusion.groups import GroupKind
from streamfuse.ir.indexing import channels_last_strides
from streamfuse.runtime.steps import ChannelsLastConvStep
from streamfuse.tune.conv_layout import eligible, measure_layout
from streamfuse.tune.network_layout import measure_network_layout, producing_part, storable


class Block(nn.Module):
    """conv-BN-ReLU, conv-BN, a residual add and ReLU, max-pooled, then a 1x1 conv and a head:
    odd channel counts and sizes, so a wrong stride or walk shows."""

    def __init__(self, c: int = 5) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(c)
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.proj = nn.Conv2d(c, 7, 1)
        self.head = nn.Linear(7, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.bn0(self.stem(x)))
        b = torch.relu(self.bn1(self.conv1(a)))
        c = torch.relu(self.conv2(b) + a)
        d = torch.relu(self.proj(self.pool(c)))
        return self.head(d.mean((2, 3)))


def randomized(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    model = Block().eval()
    with torch.no_grad():
        for bn in (model.bn0, model.bn1):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    return model.to(device)


def tol(device: torch.device) -> float:
    return 5e-3 if device.type == "cuda" else 1e-4  # cuDNN's float32 convolutions run in TF32


def test_kernels_store_channels_last_for_the_convolutions_after_them(config, device) -> None:  # type: ignore[no-untyped-def]
    model = randomized(device)
    x = torch.randn(3, 3, 9, 7, device=device)
    compiled = streamfuse.compile(model, (x,), config.replace(conv_layout="channels_last"))
    exe = compiled.base
    network = exe.network_layout
    assert network is not None and network.channels_last and len(network.stored) >= 3
    owner = compiled.plan.group_of()
    for node in network.stored:
        assert node.strides == channels_last_strides(node.shape)
        part = producing_part(owner[node], node)
        assert part is not None and part.walk == (0, 2, 3, 1)  # its kernel walks the result in memory order
    # the kernels that write them store channels_last strides
    written = [o for src in exe.sources.values() for o, st in zip(src.outputs, src.output_strides or [], strict=False)
               if st is not None and st == channels_last_strides(o.shape)]
    assert set(written) >= set(network.stored)
    explained = compiled.explain()
    assert "activation layout: channels_last through the network (Config.conv_layout)" in explained
    assert explained.count("(channels_last)") >= len(network.stored)
    # at run time the convolutions find their inputs channels_last already (no conversion)
    seen: list[bool] = []
    steps = [s for s in exe.steps if isinstance(s, ChannelsLastConvStep)]
    assert len(steps) == 4
    for step in steps:
        original = step.run

        def spy(env, step=step, original=original):  # type: ignore[no-untyped-def]
            args, _ = step.arguments(step.call, env)
            seen.append(args[0].dim() == 4 and args[0].is_contiguous(memory_format=torch.channels_last))
            return original(env)

        step.run = spy  # type: ignore[method-assign]
    with torch.no_grad():
        for seed in range(3):
            x = torch.randn(3, 3, 9, 7, device=device) * (seed + 1)
            torch.testing.assert_close(compiled(x), model(x), rtol=tol(device), atol=tol(device))
    # the stem reads the caller's NCHW image; the three convolutions after kernels read channels_last
    assert sum(seen) == 3 * 3 and len(seen) == 4 * 3


def test_network_layout_through_the_backend_and_at_another_batch(config, device) -> None:  # type: ignore[no-untyped-def]
    model = randomized(device)
    cfg = config.replace(conv_layout="channels_last")
    backend = torch.compile(model, backend=streamfuse.make_backend(cfg), dynamic=False)
    compiled = streamfuse.compile(model, (torch.randn(2, 3, 11, 5, device=device),), cfg)
    with torch.no_grad():
        for batch in (2, 5):
            x = torch.randn(batch, 3, 11, 5, device=device)
            want = model(x)
            torch.testing.assert_close(backend(x), want, rtol=tol(device), atol=tol(device))
            torch.testing.assert_close(compiled(x), want, rtol=tol(device), atol=tol(device))
    torch._dynamo.reset()


class Fire(nn.Module):
    """squeezenet's fire module and the max pool after it: two ReLU'd expand convolutions
    concatenated and pooled before the next convolution; odd channel counts and sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.squeeze = nn.Conv2d(3, 5, 1)
        self.e1, self.e3 = nn.Conv2d(5, 6, 1), nn.Conv2d(5, 7, 3, padding=1)
        self.pool = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.next = nn.Conv2d(13, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.relu(self.squeeze(x))
        cat = torch.cat([torch.relu(self.e1(s)), torch.relu(self.e3(s))], 1)
        return self.next(self.pool(cat)).mean((2, 3))


def test_kernels_between_channels_last_convolutions_store_channels_last_too(config, device) -> None:  # type: ignore[no-untyped-def]
    """A chain of generated kernels between convolutions (ReLU, then cat + max pool) stays in the
    network's layout: every 4-D result a generated kernel stores and only generated kernels or
    convolutions read is channels_last, computed from a channels_last tensor (run 118: squeezenet's
    ReLUs stored row-major between channels_last convolutions made two kernels convert layouts)."""
    torch.manual_seed(2)
    model = Fire().eval().to(device)
    x = torch.randn(2, 3, 11, 9, device=device)
    compiled = streamfuse.compile(model, (x,), config.replace(conv_layout="channels_last"))
    network = compiled.base.network_layout
    assert network is not None and network.channels_last
    owner = compiled.plan.group_of()
    generated = [n for g in compiled.plan.groups if g.kind in (GroupKind.POINTWISE, GroupKind.HORIZONTAL)
                 for n in g.outputs if len(n.shape) == 4 and n not in compiled.graph.output_nodes]
    assert len(generated) >= 3  # the squeeze's ReLU, the expand ReLUs (or their cat), the pool
    assert set(generated) <= set(network.stored)
    for node in generated:
        part = producing_part(owner[node], node)
        assert node.strides == channels_last_strides(node.shape)
        assert part is not None and part.walk == (0, 2, 3, 1)
    with torch.no_grad():
        for batch in (2, 3):
            x = torch.randn(batch, 3, 11, 9, device=device)
            torch.testing.assert_close(compiled(x), model(x), rtol=tol(device), atol=tol(device))


def test_results_read_by_aten_or_returned_stay_nchw(config, device) -> None:  # type: ignore[no-untyped-def]
    """A result the caller sees, or that an ATen op reads, keeps the recorded layout."""

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = torch.relu(self.a(x))
            return self.b(h), h  # h is an output as well as the second convolution's input

    torch.manual_seed(1)
    model = Two().eval().to(device)
    x = torch.randn(2, 3, 6, 6, device=device)
    compiled = streamfuse.compile(model, (x,), config.replace(conv_layout="channels_last"))
    assert compiled.base.network_layout is not None and compiled.base.network_layout.stored == []
    with torch.no_grad():
        out, h = compiled(x)
        want_out, want_h = model(x)
    assert h.is_contiguous()
    torch.testing.assert_close(out, want_out, rtol=tol(device), atol=tol(device))
    torch.testing.assert_close(h, want_h, rtol=tol(device), atol=tol(device))


@pytest.mark.parametrize(("pure_us", "margin", "expected"),
                         [(5.0, 0.03, True), (8.5, 0.03, True), (8.5, 0.1, False), (9.5, 0.03, False)])
def test_auto_keeps_the_network_layout_only_when_its_convolutions_win_by_the_margin(
        config, tmp_path, pure_us, margin, expected) -> None:  # type: ignore[no-untyped-def]
    """Each convolution alone: NCHW 10 µs, channels_last with its input conversion 12 µs (so NCHW
    one by one, 10 µs each); in the network layout, with its input already channels_last,
    `pure_us`, except the stem, whose input is the caller's NCHW image: it keeps its conversion
    (12 µs, read from the cache of the one-by-one measurement). Summed: 3 * pure_us + 12 against 40,
    kept where ahead by Config.network_layout_margin (8.5 µs: 6% ahead, kept at 3%, not at 10%)."""
    model = randomized(torch.device("cpu"))
    compiled = streamfuse.compile(model, (torch.randn(2, 3, 8, 8),), config.replace(conv_layout="native"))
    plan, graph = compiled.plan, compiled.graph
    owner = plan.group_of()
    convs = [g for g in plan.groups if len(g.nodes) == 1 and eligible(g.nodes[0], graph)]
    assert len(convs) == 4
    cfg = config.replace(conv_layout="auto", autotune=True, cache_dir=tmp_path, network_layout_margin=margin)
    keep = {g.name: False for g in convs}
    phase = {"cl": 12.0}

    def timer(fn):  # type: ignore[no-untyped-def]
        out = fn()
        return 10.0 if out.is_contiguous() and not timer.cl else phase["cl"]  # type: ignore[attr-defined]

    def alternating(fn):  # type: ignore[no-untyped-def]
        timer.cl = alternating.calls % 2 == 1  # type: ignore[attr-defined]
        alternating.calls += 1  # type: ignore[attr-defined]
        return timer(fn)

    alternating.calls = 0  # type: ignore[attr-defined]
    per_conv = {g.name: measure_layout(g.nodes[0], graph, cfg, torch.device("cpu"), alternating) for g in convs}
    assert all(c.layout == "native" and c.measured_us == 10.0 for c in per_conv.values())
    stored = storable(plan, owner, {g.nodes[0] for g in convs})
    phase["cl"] = pure_us
    layout, choices = measure_network_layout(plan, convs, per_conv, keep, stored, cfg, torch.device("cpu"),
                                             alternating)
    # the three convolutions' inputs, and the residual ReLU between them that the pool reads
    assert len(stored) == 4 and (layout.channels_last_us, layout.chosen_us) == (3 * pure_us + 12.0, 40.0)
    assert layout.channels_last is expected and (layout.stored == stored if expected else layout.stored == [])
    if expected:
        assert sorted(c.channels_last_us for c in choices.values()) == [pure_us] * 3 + [12.0]
        assert all(c.layout == "channels_last" and c.native_us == 10.0 for c in choices.values())
        assert f"channels_last through the network (measured: convolutions {3 * pure_us + 12:.1f} µs so" \
            in layout.describe()
    else:
        assert choices is per_conv and "chosen per convolution (measured" in layout.describe()


def test_a_result_the_trace_stored_permuted_is_walked_in_its_memory_order(config, device) -> None:  # type: ignore[no-untyped-def]
    """Config.walk_stored_order: a result the trace recorded in a dense non-row-major layout (a
    permuted view made contiguous, convnext's permute back scaled and added, a transposed 3-D or 5-D
    result) is stored so, its kernel walking that memory order; off, the walk stays row-major. Both
    match eager, with eager's strides."""

    def f(x: torch.Tensor) -> torch.Tensor:
        y = (x * 2).permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        return torch.relu(y) + 1

    def g(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # convnext: b is [N, H, W, C]
        return b.permute(0, 3, 1, 2) * 0.5 + a.permute(0, 3, 1, 2)

    def h(t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(t.transpose(1, 2)) * 3

    def k(v: torch.Tensor) -> torch.Tensor:
        return v.permute(0, 2, 4, 1, 3).contiguous().permute(0, 3, 1, 4, 2) - 0.25

    cases = [(f, (torch.randn(2, 5, 3, 7, device=device),), (0, 2, 3, 1)),
             (g, (torch.randn(2, 3, 5, 6, device=device), torch.randn(2, 3, 5, 6, device=device)), (0, 2, 3, 1)),
             (h, (torch.randn(3, 7, 5, device=device),), (0, 2, 1)),
             (k, (torch.randn(2, 3, 4, 5, 3, device=device),), (0, 2, 4, 1, 3))]
    for fn, inputs, order in cases:
        for on in (True, False):
            compiled = streamfuse.compile(fn, inputs, config.replace(walk_stored_order=on))
            walks = {gr.walk for gr in compiled.plan.groups if gr.kind is GroupKind.POINTWISE}
            assert walks == ({order} if on else {None}), (fn.__name__, walks)
            out, ref = compiled(*inputs), fn(*inputs)
            torch.testing.assert_close(out, ref)
            assert out.stride() == ref.stride(), fn.__name__


class RandomConvNet(nn.Module):
    """A random stack of convolutional blocks from one seed: 1x1/3x3 convolutions (some strided,
    some grouped, some with batch-norm), ReLU/SiLU, residual adds, two-branch cats, max and average
    pools, squeeze-and-excitation scales, and an intermediate result returned beside the head."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        rng = torch.Generator().manual_seed(seed)
        pick = lambda n: int(torch.randint(n, (1,), generator=rng))
        self.kinds: list[str] = []
        self.layers = nn.ModuleList()
        c = 3
        for _ in range(7 + pick(4)):
            kind = ["conv", "conv", "residual", "residual", "cat", "cat", "se", "pool", "avgpool"][pick(9)]
            if kind == "conv":
                out, k, stride = 3 + pick(6), [1, 3][pick(2)], [1, 2][pick(2)]
                groups = c if out == c and pick(2) else 1
                layer = nn.Sequential(nn.Conv2d(c, out, k, stride, k // 2, groups=groups, bias=bool(pick(2))),
                                      *([nn.BatchNorm2d(out)] if pick(2) else []))
                c = out
            elif kind in ("residual", "se"):
                layer = nn.Conv2d(c, c, 3, padding=1) if kind == "residual" else nn.Sequential(
                    nn.Conv2d(c, 2, 1), nn.ReLU(), nn.Conv2d(2, c, 1), nn.Sigmoid())
            elif kind == "cat":
                layer = nn.ModuleList([nn.Conv2d(c, 2 + pick(3), 1), nn.Conv2d(c, 2 + pick(3), 3, padding=1)])
                c = layer[0].out_channels + layer[1].out_channels
            else:
                layer = nn.Identity()
            self.kinds.append(kind)
            self.layers.append(layer)
        self.head = nn.Linear(c, 3)
        self.out_at = pick(len(self.kinds))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        side = x
        for i, (kind, layer) in enumerate(zip(self.kinds, self.layers, strict=True)):
            if kind == "conv":
                x = torch.relu(layer(x)) if i % 2 else F.silu(layer(x))
            elif kind == "residual":
                x = torch.relu(layer(x) + x)
            elif kind == "cat":
                x = torch.relu(torch.cat([layer[0](x), layer[1](x)], 1))
            elif kind == "pool":
                x = F.max_pool2d(x, 3, 2, 1) if min(x.shape[2:]) > 2 else x
            elif kind == "avgpool":
                x = F.avg_pool2d(x, 3, 1, 1)
            else:
                x = x * layer(x.mean((2, 3), keepdim=True))
            if i == self.out_at:
                side = x * 2
        return self.head(x.mean((2, 3))), side


@pytest.mark.parametrize("seed", range(8))
def test_random_convolutional_networks_match_eager_in_the_network_layout(config, device, seed) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    model = RandomConvNet(seed).eval().to(device)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 3, 15, 13, device=device)
    compiled = streamfuse.compile(model, (x,), config.replace(conv_layout="channels_last"))
    network = compiled.base.network_layout
    assert network is not None and network.channels_last and network.stored  # 1 to 8 per seed, 27 in all
    with torch.no_grad():
        for batch in (2, 3):
            x = torch.randn(batch, 3, 15, 13, device=device)
            got, want = compiled(x), model(x)
            for g, w in zip(got, want, strict=True):
                assert g.is_contiguous()  # results the caller sees keep the recorded layout
                torch.testing.assert_close(g, w, rtol=tol(device), atol=tol(device))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_network_layout_matches_eager(config, device, dtype) -> None:  # type: ignore[no-untyped-def]
    model = randomized(device).to(dtype)
    x = torch.randn(3, 3, 9, 7, device=device, dtype=dtype)
    compiled = streamfuse.compile(model, (x,), config.replace(conv_layout="channels_last"))
    assert compiled.base.network_layout is not None and compiled.base.network_layout.stored
    with torch.no_grad():
        x = torch.randn(3, 3, 9, 7, device=device, dtype=dtype)
        want = copy.deepcopy(model).float()(x.float())
        # against float32 eager: streamfuse computes in float32 between the half-precision stores
        torch.testing.assert_close(compiled(x).float(), want, rtol=5e-2, atol=5e-2)
