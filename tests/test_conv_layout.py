"""Convolutions run in channels_last through cuDNN (Config.conv_layout, tune/conv_layout.py):
equal to eager, live weights stay live, folded ones are converted once, and "auto" keeps
channels_last only when it is measured faster by the margin, caching what it measured."""

from __future__ import annotations

import pytest
import torch

import streamfuse
from streamfuse import Config
from streamfuse.demo_models import MultiBranchConv, _randomize_bn
from streamfuse.runtime.steps import ChannelsLastConvStep
from streamfuse.tune.conv_layout import choose_layout, eligible, measure_layout


def conv_steps(compiled: streamfuse.CompiledGraph) -> list[ChannelsLastConvStep]:
    return [s for s in compiled.base.steps if isinstance(s, ChannelsLastConvStep)]


def bn_block(channels: int, device: torch.device) -> torch.nn.Module:
    block = MultiBranchConv(channels).eval()
    with torch.no_grad():
        _randomize_bn(block, torch.Generator().manual_seed(3))
    return block.to(device)


def tol(device: torch.device) -> float:
    """cuDNN runs float32 convolutions in TF32 by default, each layout through its own engine."""
    return 5e-3 if device.type == "cuda" else 1e-4


def test_channels_last_block_matches_eager_on_fresh_inputs(config, device) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    block = bn_block(32, device)
    x = torch.randn(1, 32, 12, 12, device=device)
    compiled = streamfuse.compile(block, (x,), config.replace(conv_layout="channels_last"))
    steps = conv_steps(compiled)
    assert len(steps) == 4  # the four branches' convolutions, batch-norm folded: weights converted once
    assert all(s.weight is not None and s.weight.is_contiguous(memory_format=torch.channels_last) for s in steps)
    for seed in range(3):
        x = torch.randn(1, 32, 12, 12, device=device) * (seed + 1)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), block(x), rtol=tol(device), atol=tol(device))
    assert compiled(x).is_contiguous()
    lines = [line for line in compiled.explain().splitlines() if "runs in channels_last (Config.conv_layout)" in line]
    assert len(lines) == 4


def test_a_channels_last_result_read_only_by_generated_kernels_is_not_converted_back(config, device) -> None:  # type: ignore[no-untyped-def]
    """The block's four convolutions feed the fused tail kernel (bias, ReLU, cat, residual, mean),
    which takes strides at launch: it reads their channels_last results as they are."""
    torch.manual_seed(5)
    block = bn_block(32, device)
    x = torch.randn(2, 32, 9, 9, device=device)
    compiled = streamfuse.compile(block, (x,), config.replace(conv_layout="channels_last"))
    steps = conv_steps(compiled)
    assert len(steps) == 4 and not any(s.convert_back for s in steps)
    assert compiled.explain().count("take the channels_last result as it is") == 4
    converting = streamfuse.compile(block, (x,), config.replace(conv_layout="channels_last",
                                                                conv_keep_channels_last=False))
    assert all(s.convert_back for s in conv_steps(converting))
    with torch.no_grad():
        for seed in range(3):
            x = torch.randn(2, 32, 9, 9, device=device) * (seed + 1)
            torch.testing.assert_close(compiled(x), block(x), rtol=tol(device), atol=tol(device))
            torch.testing.assert_close(converting(x), block(x), rtol=tol(device), atol=tol(device))
    # a convolution whose result is the model's output (or read by ATen) is converted back
    conv = torch.nn.Conv2d(4, 6, 3, padding=1).eval().to(device)
    x = torch.randn(1, 4, 7, 7, device=device)
    alone = streamfuse.compile(conv, (x,), config.replace(conv_layout="channels_last"))
    (step,) = conv_steps(alone)
    assert step.convert_back and alone(x).is_contiguous()


def test_channels_last_conv_converts_a_live_weight_once_and_again_after_it_changes(config, device) -> None:  # type: ignore[no-untyped-def]
    """A live 3x3 weight is converted once into the step's buffer, and again at the first call after
    an in-place change (its version counter moved), replays of the recorded graph included; a 1x1
    weight is channels_last already and is read where it is."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Conv2d(8, 6, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(6, 4, 1)).eval().to(device)
    x = torch.randn(2, 8, 10, 10, device=device)
    compiled = streamfuse.compile(model, (x,), config.replace(conv_layout="channels_last"))
    three, one = conv_steps(compiled)
    assert three.source is model[0].weight and three.weight is not None
    assert three.weight.data_ptr() != model[0].weight.data_ptr()
    assert one.source is None and one.weight is not None and one.weight.data_ptr() == model[2].weight.data_ptr()
    assert compiled.base.converted_weights == [three]
    with torch.no_grad():
        for _ in range(3):  # step by step, then recorded and replayed where CUDA graphs are on
            torch.testing.assert_close(compiled(x), model(x), rtol=tol(device), atol=tol(device))
        before = three.weight.clone()
        model[0].weight.mul_(-0.5)
        model[2].weight.add_(0.25)
        torch.testing.assert_close(compiled(x), model(x), rtol=tol(device), atol=tol(device))
        torch.testing.assert_close(three.weight, -0.5 * before)
        torch.testing.assert_close(compiled(x), model(x), rtol=tol(device), atol=tol(device))
        model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()})
        torch.testing.assert_close(compiled(x), model(x), rtol=tol(device), atol=tol(device))


def test_the_backend_converts_bound_weights_once_and_sees_in_place_changes(config, device) -> None:  # type: ignore[no-untyped-def]
    """torch.compile(backend="streamfuse") binds an inference graph's parameters as constants: its
    channels_last convolutions hold converted copies too, refreshed after an in-place change."""
    import streamfuse.capture.backend as backend_module

    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 6, 3, padding=1), torch.nn.ReLU()).eval().to(device)
    x = torch.randn(2, 4, 9, 9, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=streamfuse.make_backend(config.replace(conv_layout="channels_last")))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=tol(device), atol=tol(device))
        plan = backend_module.compiled_graphs[-1].compiled
        assert plan is not None
        (step,) = conv_steps(plan)
        assert step.source is not None and plan.base.converted_weights == [step]
        for _ in range(3):
            model[0].weight.add_(torch.randn_like(model[0].weight))
            torch.testing.assert_close(compiled(x), model(x), rtol=tol(device), atol=tol(device))
    torch._dynamo.reset()


def test_native_layout_and_ineligible_convolutions_keep_the_recorded_step(config, device) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.ReLU()).eval().to(device)
    x = torch.randn(1, 4, 6, 6, device=device)
    assert not conv_steps(streamfuse.compile(model, (x,), config.replace(conv_layout="native")))
    # auto off CUDA or without autotune: nothing measured, nothing converted
    compiled = streamfuse.compile(model, (x,), config.replace(conv_layout="auto", autotune=False))
    assert not conv_steps(compiled)
    assert "runs in NCHW (not measured" in compiled.explain()
    # a channels_last input, a 1-D and a transposed convolution are run as recorded
    xcl = x.contiguous(memory_format=torch.channels_last)
    cl = streamfuse.compile(model, (xcl,), config.replace(conv_layout="channels_last"))
    assert not conv_steps(cl)
    for other, shape in ((torch.nn.Conv1d(4, 4, 3), (1, 4, 9)), (torch.nn.ConvTranspose2d(4, 4, 3), (1, 4, 6, 6))):
        inp = torch.randn(*shape, device=device)
        c = streamfuse.compile(other.eval().to(device), (inp,), config.replace(conv_layout="channels_last"))
        assert not conv_steps(c)
        with torch.no_grad():
            torch.testing.assert_close(c(inp), other(inp), rtol=tol(device), atol=tol(device))


def _conv_node(model: torch.nn.Module, x: torch.Tensor, config: Config):  # type: ignore[no-untyped-def]
    compiled = streamfuse.compile(model, (x,), config.replace(conv_layout="native"))
    graph = compiled.graph
    (node,) = [n for n in graph.nodes if eligible(n, graph)]
    return node, graph


@pytest.mark.parametrize(("native_us", "cl_us", "expected"), [(30.0, 10.0, "channels_last"), (30.0, 28.0, "native"),
                                                               (10.0, 30.0, "native")])
def test_auto_keeps_channels_last_only_when_faster_by_the_margin(config, tmp_path, native_us, cl_us,
                                                                 expected) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(3)
    model = torch.nn.Conv2d(4, 3, 5, padding=2).eval()
    node, graph = _conv_node(model, torch.randn(1, 4, 8, 8), config)
    cfg = config.replace(conv_layout="auto", autotune=True, cache_dir=tmp_path)
    calls: list[str] = []

    def timer(fn):  # type: ignore[no-untyped-def]
        layout = "native" if len(calls) % 2 == 0 else "channels_last"
        calls.append(layout)
        assert fn().shape == tuple(node.shape)  # each variant runs and gives the node's shape
        return native_us if layout == "native" else cl_us

    choice = measure_layout(node, graph, cfg, torch.device("cpu"), timer)
    assert (choice.layout, choice.native_us, choice.channels_last_us) == (expected, native_us, cl_us)
    assert calls == ["native", "channels_last"]
    again = measure_layout(node, graph, cfg, torch.device("cpu"), timer)  # from the cache: not timed again
    assert again == choice and len(calls) == 2
    # choose_layout measures only on CUDA
    assert choose_layout(node, graph, cfg, torch.device("cpu"), timer).layout == "native"


def test_auto_times_channels_last_the_way_the_step_will_run_it(config, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A result that stays channels_last (only generated kernels read it) is timed without the
    conversion back, and cached apart from the converting variant."""
    torch.manual_seed(6)
    node, graph = _conv_node(torch.nn.Conv2d(4, 3, 5, padding=2).eval(), torch.randn(1, 4, 8, 8), config)
    cfg = config.replace(conv_layout="auto", autotune=True, cache_dir=tmp_path)
    contiguous: list[bool] = []

    def timer(fn):  # type: ignore[no-untyped-def]
        contiguous.append(fn().is_contiguous())
        return 1.0

    measure_layout(node, graph, cfg, torch.device("cpu"), timer, convert_back=False)
    assert contiguous == [True, False]  # NCHW, then channels_last handed on as it is
    measure_layout(node, graph, cfg, torch.device("cpu"), timer, convert_back=True)
    assert contiguous == [True, False, True, True]  # not read from the other variant's cache entry


def test_measured_convolution_time_moves_the_critical_path_onto_the_priority_stream(config) -> None:  # type: ignore[no-untyped-def]
    """The cost model prices a small convolution by its FLOPs; the measured 5x5 (tens of µs on the
    H200) is the block's longest branch, so its stream must be the high-priority one."""
    from streamfuse.schedule.plan import schedule_steps

    block = bn_block(64, torch.device("cpu"))
    compiled = streamfuse.compile(block, (torch.randn(1, 64, 14, 14),), config.replace(conv_layout="native"))
    plan = compiled.plan
    (i5,) = [i for i, g in enumerate(plan.groups) if len(g.nodes) == 1 and g.nodes[0].op == "aten.convolution.default"
             and g.nodes[0].args[1].shape[-1] == 5]
    sched = schedule_steps(plan, config.replace(stream_priorities=True), {plan.groups[i5].id: 40.0})
    assert sched.own_first_stream and sched.stream_of[i5] == 0
    others = [i for i, g in enumerate(plan.groups) if g.nodes[0].op == "aten.convolution.default" and i != i5]
    assert all(sched.stream_of[i] != 0 for i in others)


def test_config_rejects_a_bad_conv_layout() -> None:
    with pytest.raises(ValueError, match="conv_layout must be"):
        Config(conv_layout="nhwc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="conv_layout_margin"):
        Config(conv_layout_margin=1.5)


@pytest.mark.gpu
def test_auto_layout_on_the_gpu_matches_eager_in_graphs_and_streams(config) -> None:  # type: ignore[no-untyped-def]
    """The c64 56x56 block (its 5x5 convolution is the case channels_last won on the H200): every
    convolution measured both ways, and the compiled block equal to eager on 20 fresh inputs, in a
    CUDA graph on 4 streams."""
    torch.manual_seed(4)
    block = bn_block(64, torch.device("cuda"))
    x = torch.randn(1, 64, 56, 56, device="cuda")
    compiled = streamfuse.compile(block, (x,), config.replace(conv_layout="auto", autotune=True))
    choices = compiled.base.conv_layouts
    assert len(choices) == 4 and all(c.reason == "measured" and c.native_us and c.channels_last_us
                                     for c in choices.values())
    assert len(conv_steps(compiled)) == sum(c.layout == "channels_last" for c in choices.values())
    with torch.no_grad():
        for _ in range(20):
            x = torch.randn(1, 64, 56, 56, device="cuda")
            # cuDNN's convolutions run in TF32 by default, and the two layouts take different engines
            torch.testing.assert_close(compiled(x), block(x), rtol=1e-2, atol=1e-2)
    assert compiled.stats["graphs"] == 1 and compiled.stats["streams"] == 4
