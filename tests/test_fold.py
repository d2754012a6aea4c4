"""Batch-norm folding (ir/fold.py): inference BN absorbed into the preceding conv's weights.

Every model gets random, non-trivial BN statistics and affine parameters (fresh BNs are the
identity map up to eps, which would hide a wrong fold). Compiled results are compared with eager at
float32 accuracy, with folding on and off; the graph is checked for what the fold must remove.
"""

from __future__ import annotations

import pytest
import torch
from helpers import randn

import streamfuse
from streamfuse import Config
from streamfuse.capture.export import capture
from streamfuse.fusion.groups import GroupKind
from streamfuse.ir.fold import fold_batchnorm
from streamfuse.ir.from_fx import graph_from_fx
from streamfuse.ir.graph import Graph, Node
from streamfuse.ir.ops import OpKind

nn = torch.nn
RSQRT = "aten.rsqrt.default"
BN_NAMES = ("bn_centered", "bn_var_eps", "bn_rstd", "bn_normed", "bn_scaled", "bn_shifted", "bn_out")


@pytest.fixture(autouse=True)
def ieee_convs(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, cuDNN convolutions in full float32: with TF32, folded and original weights round
    differently (~1e-3 relative), more than the float32 tolerance these comparisons use."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


def randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random running stats, weight and bias on every batch-norm; returns the model in eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                c = m.num_features
                m.running_mean.copy_(torch.randn(c, generator=gen))
                m.running_var.copy_(torch.rand(c, generator=gen) * 2 + 0.05)
                if m.affine:
                    m.weight.copy_(torch.randn(c, generator=gen))
                    m.bias.copy_(torch.randn(c, generator=gen))
    return model.eval()


def conv_bn(conv: nn.Module, channels: int, relu: bool = True, seed: int = 0, **bn: bool) -> nn.Module:
    layers = [conv, nn.BatchNorm2d(channels, **bn)] + ([nn.ReLU()] if relu else [])
    return randomize_bn(nn.Sequential(*layers), seed)


def count(graph: Graph, op: str) -> int:
    return sum(1 for n in graph.nodes if n.op == op)


def bn_nodes(graph: Graph) -> list[str]:
    return [n.name for n in graph.nodes if n.name.startswith(BN_NAMES) or n.op == RSQRT]


def check(model: nn.Module, x: torch.Tensor, config: Config, fold: bool) -> streamfuse.CompiledGraph:
    """Compile with folding on or off, compare with eager at float32 accuracy, validate the graph."""
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config.replace(fold_batchnorm=fold))
        out, ref = compiled(x), model(x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    compiled.graph.validate()
    return compiled


BIAS_ADD = ["aten.view.default", "aten.add.Tensor"]
BIAS_RELU = BIAS_ADD + ["aten.relu.default"]


def folded_bias(graph) -> Node:  # type: ignore[no-untyped-def]
    return next(n for n in graph.constants if n.name.endswith("_bias_folded"))


def generated_ops(compiled: streamfuse.CompiledGraph) -> list[list[str]]:
    return [[n.op for n in g.nodes] for g in compiled.plan.groups if g.kind.generated]


def test_conv_bn_relu_folds_to_a_relu_only_epilogue(config, device) -> None:  # type: ignore[no-untyped-def]
    model = conv_bn(nn.Conv2d(3, 8, 3, padding=1), 8).to(device)
    x = randn(2, 3, 10, 10, device=device)
    on, off = check(model, x, config, fold=True), check(model, x, config, fold=False)
    assert count(on.graph, RSQRT) == 0 and bn_nodes(on.graph) == []
    assert count(off.graph, RSQRT) == 1
    assert generated_ops(on) == [BIAS_RELU]  # the BN left the epilogue: only its folded bias and the ReLU
    assert any(RSQRT in ops for ops in generated_ops(off))  # unfolded: the BN runs in a generated epilogue
    assert on.stats["kernels"] == 2 <= off.stats["kernels"]  # convolution + bias/ReLU (unfolded: BN/ReLU epilogue)
    # the conv reads the folded tensors; the BN parameters and the original conv weight are no longer held
    conv = next(n for n in on.graph.nodes if n.op == "aten.convolution.default")
    held = {id(t) for t in on.graph.constants.values()}
    for t in (model[0].weight, model[0].bias, model[1].weight, model[1].bias, model[1].running_mean,
              model[1].running_var):
        assert id(t) not in held
    assert conv.args[2] is None  # the folded bias is added in the epilogue (ATen adds a conv bias in a kernel of its own)
    weight, bias = on.graph.constants[conv.args[1]], on.graph.constants[folded_bias(on.graph)]
    assert weight.device == model[0].weight.device and bias.device == model[0].weight.device
    assert not weight.requires_grad and not bias.requires_grad


def test_conv_bn_without_relu_is_the_convolution_alone(config, device) -> None:  # type: ignore[no-untyped-def]
    model = conv_bn(nn.Conv2d(4, 6, 3), 6, relu=False, seed=1).to(device)
    x = randn(3, 4, 9, 9, device=device)
    on, off = check(model, x, config, fold=True), check(model, x, config, fold=False)
    assert on.stats["kernels"] == 2 and count(on.graph, RSQRT) == 0  # conv + the folded bias's add
    assert generated_ops(on) == [BIAS_ADD]
    assert [n.op for n in on.graph.output_nodes] == ["aten.add.Tensor"]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("groups", [1, 2, 8], ids=["dense", "groups2", "depthwise"])
def test_grouped_depthwise_and_biasless_convs_fold(config, device, groups: int, bias: bool) -> None:  # type: ignore[no-untyped-def]
    model = conv_bn(nn.Conv2d(8, 8, 3, padding=1, groups=groups, bias=bias), 8, seed=groups).to(device)
    x = randn(2, 8, 7, 7, device=device, seed=groups)
    on = check(model, x, config, fold=True)
    check(model, x, config, fold=False)
    assert count(on.graph, RSQRT) == 0
    conv = next(n for n in on.graph.nodes if n.op == "aten.convolution.default")
    assert conv.args[8] == groups and conv.args[1].shape == (8, 8 // groups, 3, 3)
    assert conv.args[2] is None and on.graph.constants[folded_bias(on.graph)].shape == (8,)  # (b - mean) * s + beta


def test_batch_norm_without_affine_and_conv1d_fold(config) -> None:  # type: ignore[no-untyped-def]
    model = randomize_bn(nn.Sequential(nn.Conv1d(5, 7, 3), nn.BatchNorm1d(7, affine=False), nn.ReLU()), seed=3)
    on = check(model, randn(4, 5, 20), config, fold=True)
    assert count(on.graph, RSQRT) == 0 and generated_ops(on) == [BIAS_RELU]


def test_conv_output_read_elsewhere_is_not_folded(config) -> None:  # type: ignore[no-untyped-def]
    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            return torch.relu(self.bn(y)) + y.sigmoid()  # the raw conv result is needed too

    model = randomize_bn(Both(), seed=4)
    on = check(model, randn(2, 3, 8, 8), config, fold=True)
    assert count(on.graph, RSQRT) == 1


def test_conv_that_is_a_graph_output_is_not_folded(config) -> None:  # type: ignore[no-untyped-def]
    conv, bn = nn.Conv2d(3, 4, 1), randomize_bn(nn.BatchNorm2d(4), seed=5)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = conv(x)
        return y, bn(y)  # the BN is the conv's only reader, but the caller reads the conv too

    x = randn(2, 3, 5, 5)
    with torch.no_grad():
        compiled = streamfuse.compile(fn, (x,), config)
        for o, r in zip(compiled(x), fn(x), strict=True):
            torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4)
    assert count(compiled.graph, RSQRT) == 1


def test_transposed_conv_is_not_folded(config) -> None:  # type: ignore[no-untyped-def]
    model = conv_bn(nn.ConvTranspose2d(4, 6, 3, stride=2), 6, seed=6)
    on = check(model, randn(2, 4, 5, 5), config, fold=True)
    assert count(on.graph, RSQRT) == 1


def test_the_pass_on_its_own(device) -> None:  # type: ignore[no-untyped-def]
    class Two(nn.Module):
        """Two conv+BN pairs, one sharing the other's conv weight (the shared weight must stay)."""

        def __init__(self) -> None:
            super().__init__()
            self.a, self.bn_a, self.bn_b = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.bn_a(self.a(x)))
            return self.bn_b(torch.conv2d(h, self.a.weight, None, 1, 1)) + self.a(h)

    model = randomize_bn(Two(), seed=7).to(device)
    x = randn(2, 4, 6, 6, device=device)
    with torch.no_grad():
        cap = capture(model, (x,))
    graph = graph_from_fx(cap.gm, cap.bound)
    before = len(graph.nodes)
    assert fold_batchnorm(graph) == 2
    graph.validate()
    assert fold_batchnorm(graph) == 0  # nothing left to fold
    assert bn_nodes(graph) == [] and len(graph.nodes) < before
    names = [n.name for n in graph.nodes]
    assert len(set(names)) == len(names)
    held = [t for t in graph.constants.values()]
    assert any(t is model.a.weight for t in held)  # still read by the unfolded third conv
    assert not any(t is model.bn_a.running_var or t is model.bn_b.running_mean for t in held)
    for node, value in graph.constants.items():
        assert node in graph.nodes and node.kind is OpKind.INPUT
        assert (node.shape, node.dtype, node.strides) == (tuple(value.shape), value.dtype, tuple(value.stride()))
        assert value.device == x.device
    for conv in (n for n in graph.nodes if n.op == "aten.convolution.default"):
        assert conv.shape[1] == 4 and conv.dtype == torch.float32


def test_folded_weights_follow_in_place_changes_of_the_parameters(config, device) -> None:  # type: ignore[no-untyped-def]
    """streamfuse.compile's folded weights are computed again, in place, when a parameter or
    statistic they came from changed in place (an optimizer step, load_state_dict, `p.add_()`),
    at the compiled batch and in a padded bucket; the sibling filters stacked from them
    (Config.merge_sibling_convolutions) follow."""
    class Siblings(nn.Module):  # two conv + BN branches reading one input: merged into one convolution
        def __init__(self, seed: int):
            super().__init__()
            torch.manual_seed(seed)
            self.a = conv_bn(nn.Conv2d(3, 4, 1), 4, seed=seed)
            self.b = conv_bn(nn.Conv2d(3, 4, 1), 4, seed=seed + 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([self.a(x), self.b(x)], 1)

    model, other = Siblings(8).to(device).eval(), Siblings(10).to(device).eval()
    x, x3 = randn(2, 3, 6, 6).to(device), randn(3, 3, 6, 6, seed=3).to(device)
    with torch.no_grad():
        folded = streamfuse.compile(model, (x,), config.replace(merge_sibling_convolutions=True))
        assert folded.weights_watch is not None and count(folded.graph, "aten.convolution.default") == 1
        for change in (lambda: model.a[0].weight.add_(0.5), lambda: model.b[1].running_mean.add_(1.0),
                       lambda: model.a[1].weight.mul_(2.0), lambda: model.load_state_dict(other.state_dict())):
            change()
            torch.testing.assert_close(folded(x), model(x), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(folded(x3), model(x3), rtol=1e-4, atol=1e-4)
        assert folded.weights_watch.refreshes == 4
        torch.testing.assert_close(folded(x), model(x), rtol=1e-4, atol=1e-4)
        assert folded.weights_watch.refreshes == 4  # nothing changed: nothing computed again


def test_batch_buckets_share_one_snapshot_of_the_folds(config) -> None:  # type: ignore[no-untyped-def]
    model = conv_bn(nn.Conv2d(3, 4, 3, padding=1), 4, seed=9)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (randn(2, 3, 6, 6),), config)
        x = randn(3, 3, 6, 6, seed=3)  # padded to the bucket of 4: a second graph, captured now
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    assert set(compiled._variants) == {2, 4}
    folded = [{id(t) for t in exe.graph.constants.values()} for exe in compiled._variants.values()]
    assert folded[0] == folded[1]


def test_parallel_folds_each_model(config) -> None:  # type: ignore[no-untyped-def]
    models = [conv_bn(nn.Conv2d(3, 4, 3), 4, seed=s) for s in (10, 11)]
    xs = [randn(1, 3, 8, 8, seed=s) for s in (10, 11)]
    with torch.no_grad():
        for fold in (True, False):
            par = streamfuse.parallel([(m, (x,)) for m, x in zip(models, xs, strict=True)],
                                      config.replace(fold_batchnorm=fold))
            for out, m, x in zip(par(*xs), models, xs, strict=True):
                torch.testing.assert_close(out, m(x), rtol=1e-4, atol=1e-4)
            assert count(par.compiled.graph, RSQRT) == (0 if fold else 2)


def test_channels_last_weights_keep_their_layout(config) -> None:  # type: ignore[no-untyped-def]
    model = conv_bn(nn.Conv2d(4, 8, 3, padding=1), 8, seed=12).to(memory_format=torch.channels_last)
    x = randn(2, 4, 6, 6).to(memory_format=torch.channels_last)
    on = check(model, x, config, fold=True)
    conv = next(n for n in on.graph.nodes if n.op == "aten.convolution.default")
    weight = on.graph.constants[conv.args[1]]
    assert weight.is_contiguous(memory_format=torch.channels_last) and conv.args[1].strides == weight.stride()
    assert [g.kind for g in on.plan.groups].count(GroupKind.POINTWISE) == 1


def test_explain_says_what_was_folded(config) -> None:  # type: ignore[no-untyped-def]
    model = conv_bn(nn.Conv2d(3, 8, 3, padding=1), 8)
    on = check(model, randn(2, 3, 10, 10), config, fold=True)
    off = check(model, randn(2, 3, 10, 10), config, fold=False)
    assert "batch-norm after %convolution folded into its weights" in on.explain(source=False)
    assert "folded into its weights" not in off.explain(source=False)


def _backend_plan() -> streamfuse.CompiledGraph:
    import streamfuse.capture.backend as backend_module

    holder = backend_module.compiled_graphs[-1]
    assert holder.compiled is not None, holder.explain(source=False)
    return holder


def test_the_backend_folds_and_watches_the_parameters(config) -> None:  # type: ignore[no-untyped-def]
    """torch.compile(backend="streamfuse") folds inference batch-norms as streamfuse.compile does (the
    same plan through both entry points), and a parameter changed in place afterwards (an optimizer
    step, load_state_dict between evaluations) is seen: the graph is bound again unfolded, once."""
    model = nn.Sequential(conv_bn(nn.Conv2d(3, 8, 3, padding=1), 8, seed=13),
                          conv_bn(nn.Conv2d(8, 8, 3, padding=1, groups=8), 8, relu=False, seed=14))
    x = randn(2, 3, 10, 10, seed=4)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=streamfuse.make_backend(config))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
        holder = _backend_plan()
        assert holder.folded == 2 and not holder.live
        assert count(holder.compiled.graph, RSQRT) == 0
        assert "2 batch-norm(s) folded" in holder.explain(source=False)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)  # unchanged: still folded
        assert holder.folded == 2 and not holder.live
        for changed in (model[0][1].running_var, model[1][0].weight, model[1][1].bias):
            changed.mul_(1.5)  # in place: the folded snapshot is stale
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
            assert holder.live and holder.folded == 0 and count(holder.compiled.graph, RSQRT) == 2
    assert "bound again with none folded" in holder.explain(source=False)


def test_the_backend_does_not_fold_inference_tensors(config) -> None:  # type: ignore[no-untyped-def]
    """Parameters made under torch.inference_mode keep no version counter: nothing to watch, so the
    backend keeps reading them live (no fold) and stays correct."""
    with torch.inference_mode():
        model = conv_bn(nn.Conv2d(3, 4, 3), 4, seed=15)
        x = randn(2, 3, 8, 8, seed=5)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=streamfuse.make_backend(config))
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    holder = _backend_plan()
    assert holder.folded == 0 and count(holder.compiled.graph, RSQRT) == 1


def test_the_backend_fold_can_be_turned_off(config) -> None:  # type: ignore[no-untyped-def]
    model = conv_bn(nn.Conv2d(3, 4, 3), 4, seed=16)
    x = randn(2, 3, 8, 8, seed=6)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=streamfuse.make_backend(config.replace(fold_batchnorm=False)))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    holder = _backend_plan()
    assert holder.folded == 0 and count(holder.compiled.graph, RSQRT) == 1
