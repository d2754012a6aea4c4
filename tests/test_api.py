"""The user-facing surface: streamfuse.compile, the torch.compile backend, errors, stats, explain, CLI."""

from __future__ import annotations

import importlib.metadata
import re
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_to_reference, randn

import streamfuse
from streamfuse import Config
from streamfuse.capture import backend as backend_module
from streamfuse.codegen.cache import load_kernel


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(32)
        self.fc = torch.nn.Linear(32, 64)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.fc(self.ln(x))
        return {"act": F.gelu(h), "probs": torch.softmax(h, -1)}


def test_compile_module_keeps_output_structure(config, device) -> None:  # type: ignore[no-untyped-def]
    model = Block().eval().to(device)
    x = randn(4, 32, device=device)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config)
        out = compiled(x)
        ref = model(x)
    assert isinstance(out, dict) and set(out) == {"act", "probs"}
    for k in ref:
        torch.testing.assert_close(out[k], ref[k], rtol=1e-4, atol=1e-5)


def test_compile_accepts_a_single_tensor_and_weight_updates_are_seen(config, device) -> None:  # type: ignore[no-untyped-def]
    model = torch.nn.Linear(8, 8).to(device)
    x = randn(3, 8, device=device)
    with torch.no_grad():
        compiled = streamfuse.compile(model, x, config)
        model.bias.add_(1.0)  # bound parameters are the module's own tensors
        torch.testing.assert_close(compiled(x), model(x))


def test_torch_compile_backend(config, device) -> None:  # type: ignore[no-untyped-def]
    torch._dynamo.reset()
    fn = lambda x, y: torch.softmax(x * y + 1, -1).relu()
    x, y = randn(6, 40, device=device, seed=1), randn(6, 40, device=device, seed=2)
    before = len(backend_module.compiled_graphs)
    out = torch.compile(fn, backend="streamfuse")(x, y)
    assert_close_to_reference(out, fn, [x, y])
    assert len(backend_module.compiled_graphs) == before + 1
    graph = backend_module.compiled_graphs[-1]
    assert graph.stats["kernels"] == 1


def test_torch_compile_backend_with_config_and_training(config, device) -> None:  # type: ignore[no-untyped-def]
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.LayerNorm(16)).to(device)
    x = randn(4, 16, device=device)
    # a fixed random direction, not out.sum(): a LayerNorm's outputs sum to a constant, so every
    # gradient before it would be zero in exact arithmetic and the comparison one of rounding noise
    direction = randn(4, 16, device=device, seed=7)
    compiled = torch.compile(model, backend=streamfuse.make_backend(config))
    out = compiled(x)
    (out * direction).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (model(x) * direction).sum().backward()
    for g, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)


def test_backend_entry_point_is_declared() -> None:
    names = {ep.name for ep in importlib.metadata.entry_points(group="torch_dynamo_backends")}
    assert "streamfuse" in names
    assert streamfuse.backend is backend_module.streamfuse_backend


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((randn(4, 8),), "expected 2 input tensor(s) (x, y), got 1; missing: y"),
        ((randn(4, 8), randn(4, 9)), "input 1 (y): expected shape (4, 8), got (4, 9)"),
        ((randn(4, 8), randn(4, 8).double()), "input 1 (y): expected dtype torch.float32, got torch.float64"),
        ((randn(4, 8), torch.empty(4, 8, device="meta")), "input 1 (y): expected device"),
        ((randn(4, 8), 3.0), "input 1 (y): expected a torch.float32 tensor"),
    ],
)


def test_bad_call_inputs_raise_value_error_naming_the_input(config, args, message) -> None:  # type: ignore[no-untyped-def]
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y

    strict = config.replace(max_specializations=0)  # no plan of its own for another shape or dtype
    compiled = streamfuse.compile(f, (randn(4, 8), randn(4, 8)), strict)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        compiled(*args)


def test_new_shapes_and_dtypes_get_their_own_plan(config) -> None:  # type: ignore[no-untyped-def]
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x * y, dim=-1).sum(0)  # batch rows are not independent: no padding

    compiled = streamfuse.compile(f, (randn(4, 8, seed=1), randn(4, 8, seed=2)), config.replace(max_specializations=2))
    calls = [(randn(3, 5, seed=3), randn(3, 5, seed=4)), (randn(4, 8, seed=5), randn(4, 8, seed=6).double()),
             (randn(6, 7, seed=7), randn(6, 7, seed=8)), (randn(3, 5, seed=9), randn(3, 5, seed=10))]
    for x, y in calls:
        out = compiled(x, y)
        torch.testing.assert_close(out, f(x, y), rtol=1e-5, atol=1e-6)
    assert compiled.stats["specializations"] == 2  # three signatures seen, the least recently used evicted
    assert all(isinstance(s, streamfuse.CompiledGraph) for s in compiled.specializations.values())


def test_wrong_shape_for_the_model_raises_eager_error(config) -> None:  # type: ignore[no-untyped-def]
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y

    compiled = streamfuse.compile(f, (randn(4, 8), randn(4, 8)), config)
    with pytest.warns(streamfuse.StreamfuseFallbackWarning, match="runs eagerly"), \
            pytest.raises(RuntimeError, match="size of tensor"):
        compiled(randn(4, 8), randn(4, 9))  # eager's own error, as without streamfuse


def test_one_tensor_given_for_several_example_inputs_stays_several_inputs(config) -> None:  # type: ignore[no-untyped-def]
    """`(x, x)` as example inputs, or nn.MultiheadAttention compiled on `(q, q, q)` (its forward
    takes a packed path when `key is query`): later calls with different tensors match eager."""
    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * 2 + b.sin()

    x, y = randn(4, 8, seed=1), randn(4, 8, seed=2)
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True).eval()
    q, k, v = randn(2, 5, 16, seed=3), randn(2, 5, 16, seed=4), randn(2, 5, 16, seed=5)
    with torch.no_grad():
        compiled = streamfuse.compile(fn, (x, x), config)
        torch.testing.assert_close(compiled(x, y), fn(x, y))
        attention = streamfuse.compile(mha, (q, q, q), config)
        torch.testing.assert_close(attention(q, k, v)[0], mha(q, k, v)[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(attention(q, q, q)[0], mha(q, q, q)[0], rtol=1e-5, atol=1e-5)


def test_keyword_example_inputs_and_keyword_calls(config) -> None:  # type: ignore[no-untyped-def]
    """A dict of example inputs compiles the model for those keywords (a parameter after others left
    out, like GPT-2's attention_mask after past_key_values); calls pass them in that order or by
    name, and a tuple-compiled model takes its parameters by name too. Bad names raise TypeError."""
    def fn(x: torch.Tensor, cache: Any = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        assert cache is None
        return x.sin() * mask if mask is not None else x.sin()

    x, mask = randn(2, 8, seed=1), randn(2, 8, seed=2)
    with torch.no_grad():
        compiled = streamfuse.compile(fn, {"x": x, "mask": mask}, config)
        assert isinstance(compiled, streamfuse.CompiledGraph)
        want = fn(x, mask=mask)
        for got in (compiled(x, mask), compiled(x=x, mask=mask), compiled(x, mask=mask)):
            torch.testing.assert_close(got, want)
        x3, mask3 = randn(3, 8, seed=3), randn(3, 8, seed=4)
        torch.testing.assert_close(compiled(mask=mask3, x=x3), fn(x3, mask=mask3))
        with pytest.raises(TypeError, match=r"unexpected keyword argument 'cache'.*takes x, mask.*compile with it in "
                                            r"example_inputs.*\{'x': \.\.\., 'mask': \.\.\., 'cache': \.\.\.\}"):
            compiled(x, cache=None)
        with pytest.raises(TypeError, match="multiple values for argument 'x'"):
            compiled(x, x=x)
        with pytest.raises(TypeError, match="missing argument.*'mask'"):
            compiled(x=x)
        with pytest.raises(ValueError, match=r"expected 2 input tensor\(s\) \(x, mask\), got 1; missing: mask"):
            compiled(x)
        positional = streamfuse.compile(fn, (x,), config)
        torch.testing.assert_close(positional(x=x), fn(x))
    with pytest.warns(streamfuse.StreamfuseFallbackWarning, match=r"example_inputs\['mask'\] is a NoneType"):
        flagged = streamfuse.compile(fn, {"x": x, "mask": None}, config)
    torch.testing.assert_close(flagged(x=x, mask=None), fn(x))
    with pytest.raises(ValueError, match="keys must be the model's parameter names"):
        streamfuse.compile(fn, {0: x}, config)


def test_a_bad_first_call_raises_eagers_error_and_keeps_the_plan(config) -> None:  # type: ignore[no-untyped-def]
    """A first call with an input eager rejects too (a wrong feature size) raises eager's error; the
    plan is not given up for it (it was, with a fallback warning: every later call ran eagerly)."""
    model = torch.nn.Linear(8, 8)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (randn(2, 8),), config)
        with pytest.raises(RuntimeError, match="cannot be multiplied"), pytest.warns(streamfuse.StreamfuseFallbackWarning):
            compiled(randn(2, 9))
        assert compiled.eager_reason is None
        torch.testing.assert_close(compiled(randn(2, 8, seed=2)), model(randn(2, 8, seed=2)))
        assert compiled.eager_reason is None and compiled._proven


def test_a_list_of_tensors_as_one_input_goes_through_the_backend(config) -> None:  # type: ignore[no-untyped-def]
    """torchvision's detection models take a list of images: streamfuse.compile raised a ValueError
    for it. Such an input now sends the model through the backend (Dynamo guards the structure), with
    one warning saying so; a list of another length is another graph."""
    def model(images: list[torch.Tensor], scale: torch.Tensor) -> list[torch.Tensor]:
        return [torch.relu(im * scale).sum(0) for im in images]

    images, scale = [randn(3, 4, 4, seed=1), randn(3, 5, 5, seed=2)], randn(1, seed=3)
    with pytest.warns(streamfuse.StreamfuseFallbackWarning, match=r"example_inputs\[0\] is a list of 2 tensor"):
        compiled = streamfuse.compile(model, (images, scale), config)
    assert isinstance(compiled, streamfuse.BackendFallback)
    for call in ([images, scale], [[randn(3, 6, 2, seed=4)], scale], [images[::-1] + images, randn(1, seed=5)]):
        got, want = compiled(*call), model(*call)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
    assert compiled.eager_reason is None and compiled.graphs


def test_flags_numbers_and_caches_as_example_inputs_go_through_the_backend(config) -> None:  # type: ignore[no-untyped-def]
    """A model called with a flag (`output_hidden_states=True`, timm's `pre_logits=True`), a number or
    a cache object (transformers' DynamicCache for the next decode step) raised a ValueError
    (helper sweeps, session 41); it now runs through the backend, where Dynamo guards those values,
    with the fallback warning naming the input."""
    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 4)

        def forward(self, x: torch.Tensor, pre_logits: bool = False, scale: float = 1.0) -> torch.Tensor:
            x = x.mean(1) * scale
            return x if pre_logits else self.fc(x)

    torch.manual_seed(0)
    model, x = Head().eval(), randn(2, 5, 8)
    torch._dynamo.reset()
    with torch.no_grad():
        with pytest.warns(streamfuse.StreamfuseFallbackWarning, match=r"example_inputs\['pre_logits'\] is a bool"):
            compiled = streamfuse.compile(model, {"x": x, "pre_logits": True}, config)
            got = compiled(x=x, pre_logits=True)
        torch.testing.assert_close(got, model(x, pre_logits=True))
        torch.testing.assert_close(compiled(x=x, pre_logits=False), model(x))  # Dynamo guards the flag
        with pytest.warns(streamfuse.StreamfuseFallbackWarning, match=r"example_inputs\[1\] is a bool"):
            scaled = streamfuse.compile(model, (x, False, 2.0), config)
            got = scaled(x, False, 2.0)
        torch.testing.assert_close(got, model(x, False, 2.0))
    torch._dynamo.reset()


def test_bad_compile_arguments(config) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="example_inputs must be a tensor, a tuple of tensors or a dict"):
        streamfuse.compile(torch.relu, 3.0, config)
    # a non-tensor example input (a flag, a number, None, a cache object) goes through the backend,
    # where Dynamo guards it; a call eager rejects then raises eager's error
    with pytest.warns(streamfuse.StreamfuseFallbackWarning, match=r"example_inputs\[1\] is a str, not a tensor"):
        added = streamfuse.compile(torch.add, (randn(2), "x"), config)
    assert isinstance(added, streamfuse.BackendFallback)
    with pytest.raises(TypeError):
        added(randn(2), "x")
    with pytest.raises(ValueError, match="model must be an nn.Module or a callable"):
        streamfuse.compile(42, (randn(2),), config)
    with pytest.raises(ValueError, match="config must be a streamfuse.Config"):
        streamfuse.compile(torch.relu, (randn(2),), {"fuse": False})
    with pytest.raises(ValueError, match="Config.pointwise_block must be a power of two"):
        Config(pointwise_block=1000)
    with pytest.raises(ValueError, match="Config.executor must be"):
        Config(executor="fast")  # type: ignore[arg-type]


def test_stats_and_explain(config) -> None:  # type: ignore[no-untyped-def]
    fn = lambda x: (torch.softmax(x, -1), torch.sort(x, -1).values * 2)
    compiled = streamfuse.compile(fn, (randn(4, 16),), config)
    stats = compiled.stats
    assert {"source_ops", "kernels", "fused_groups"} <= set(stats)
    assert stats["kernels"] == 3  # softmax, sort (ATen), mul
    text = compiled.explain()
    assert "amax" in text and "aten.sort" in text and "@triton.jit" in text
    assert "refused fusions" in text and "opaque" in text
    assert "@triton.jit" not in compiled.explain(source=False)
    if compiled.device.type == "cpu":
        assert "programmatic dependent launch: off (not a CUDA device)" in text
    off = streamfuse.compile(fn, (randn(4, 16),), config.replace(pdl=False))
    assert "programmatic dependent launch: off (Config.pdl=False)" in off.explain(source=False)


def test_reference_executor_matches(config) -> None:  # type: ignore[no-untyped-def]
    fn = lambda x: F.layer_norm(x, (16,)) * 2
    x = randn(3, 16)
    compiled = streamfuse.compile(fn, (x,), config.replace(executor="reference"))
    assert compiled.executor == "reference"
    assert_close_to_reference(compiled(x), fn, [x])


def test_kernel_cache_is_keyed_by_content(config, device) -> None:  # type: ignore[no-untyped-def]
    x = randn(8, device=device)
    compiled = streamfuse.compile(lambda x: x.exp() + 1, (x,), config.replace(executor="triton"))
    src = next(iter(compiled.sources.values()))
    again = load_kernel(src.fn_name, src.source, config.cache_dir)
    assert again is compiled.steps[0].kernel  # type: ignore[union-attr]
    assert (config.cache_dir / "kernels" / f"{src.fn_name}.py").read_text() == src.source
    other = streamfuse.compile(lambda x: x.exp() + 2, (x,), config)
    assert next(iter(other.sources.values())).fn_name != src.fn_name


def test_batch_norm_training_updates_running_stats_like_eager(config) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    bn_a, bn_b = torch.nn.BatchNorm1d(6), torch.nn.BatchNorm1d(6)
    x = randn(10, 6)
    compiled = streamfuse.compile(bn_a, (x,), config)
    for seed in range(3):  # once per call: a first call (or a CUDA graph's warm-up) must not update twice
        x = randn(10, 6, seed=seed)
        out = compiled(x)
        ref = bn_b(x)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(bn_a.running_mean, bn_b.running_mean)
        torch.testing.assert_close(bn_a.running_var, bn_b.running_var)
    assert int(bn_a.num_batches_tracked) == 3
    # the one-trace capture leaves training batch-norm's in-place statistics update in the graph:
    # AOTAutograd's export, which makes it a functional op and an output, takes such a model
    assert compiled.capture_path.startswith("AOTAutograd export")


def test_an_in_place_view_of_an_intermediate_stays_on_the_one_trace_path(config) -> None:  # type: ignore[no-untyped-def]
    """Adaptive average pooling of a channels-last-strided tensor traces as mean -> as_strided_
    (convnext, swin): nothing else reads the mean, so the in-place view becomes as_strided and the
    model keeps the one-trace capture (it went through AOTAutograd's export, a second trace, before)."""

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.pool = torch.nn.Conv2d(3, 8, 3), torch.nn.AdaptiveAvgPool2d(1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x).permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # channels-last strides
            return self.pool(y).permute(0, 2, 3, 1) * 2

    torch.manual_seed(0)
    model = Head().eval()
    x = randn(2, 3, 9, 9)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config)
        for batch in (2, 3):
            x = randn(batch, 3, 9, 9, seed=batch)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert compiled.capture_path == "one trace"
    assert "aten.as_strided.default" in {n.op for n in compiled.graph.nodes}


def test_writes_that_functionalization_leaves_are_never_dropped(config) -> None:  # type: ignore[no-untyped-def]
    """Circular padding copies into slices of the padded tensor it made, and the one-trace capture
    kept those copies as side effects, which the graph dropped as dead code: streamfuse.compile
    returned the uninitialised tensor (1e25 or NaN; helper sweep, session 41). Such a trace now goes
    to AOTAutograd's export, and the graph converter refuses any write it would otherwise drop."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from streamfuse.ir.from_fx import UnsupportedGraph, graph_from_fx

    torch.manual_seed(0)
    model = torch.nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular").eval()
    with torch.no_grad():
        compiled = streamfuse.compile(model, (randn(2, 3, 6, 6),), config)
        for batch in (2, 3):
            x = randn(batch, 3, 6, 6, seed=batch)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        pad = streamfuse.compile(lambda x: F.pad(x, (1, 2, 2, 1), mode="circular"), (randn(2, 3, 5, 5),), config)
        x = randn(2, 3, 5, 5, seed=7)
        assert torch.equal(pad(x), F.pad(x, (1, 2, 2, 1), mode="circular"))
    assert "writes into a view" in compiled.capture_path

    def writes(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        y.add_(1)  # a write that a graph handed to the converter should not hold
        return x + 1

    graph_module = make_fx(writes)(randn(2, 3))
    assert any(n.target is torch.ops.aten.add_.Tensor for n in graph_module.graph.nodes)
    with pytest.raises(UnsupportedGraph, match="writes into one of its arguments"):
        graph_from_fx(graph_module)


def _aten_graph_has_effect_tokens(fn: Any, *inputs: torch.Tensor) -> bool:
    """Whether AOTAutograd threads effect tokens (with_effects) through fn's graph. Version-dependent:
    aten._linalg_check_errors is effectful only from pytorch#184111 (May 2026: in 2.13, not in 2.11);
    before it AOTAutograd pruned the check, so torch 2.11 hands a graph without tokens (H200, s41)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    with_effects = getattr(torch.ops.higher_order, "with_effects", None)
    found: list[bool] = []

    def record(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        found.append(with_effects is not None and any(n.target is with_effects for n in gm.graph.nodes))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    torch.compile(fn, backend=aot_autograd(fw_compiler=record))(*inputs)
    torch._dynamo.reset()
    return any(found)


def test_effect_token_graphs_run_as_handed_through_the_backend(config) -> None:  # type: ignore[no-untyped-def]
    """torch.linalg.inv's error check is ordered by an AOTAutograd effect token, passed as None at
    run time: the backend crashed on it with BadInput (helper sweep, session 41). Such a graph now
    runs as handed, with the fallback warning naming why; inference and gradients match eager.
    Where this torch prunes the check instead (no token, torch 2.11), the graph compiles as any
    other: no fallback warning (conftest makes one an error), and the same results."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.inv(x).sum(-1) * 2

    x = randn(2, 4, 4) + 4 * torch.eye(4)
    tokens = _aten_graph_has_effect_tokens(fn, x)
    compiled = torch.compile(fn, backend=streamfuse.make_backend(config))
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    if tokens:
        with pytest.warns(streamfuse.StreamfuseFallbackWarning, match="effect tokens"):
            got = compiled(x)
            compiled(a).sum().backward()  # a training graph pair of its own
    else:
        with warnings.catch_warnings():  # an error even under pytest -W ignore
            warnings.simplefilter("error", streamfuse.StreamfuseFallbackWarning)
            got = compiled(x)
            compiled(a).sum().backward()
    torch.testing.assert_close(got, fn(x), rtol=1e-5, atol=1e-5)
    fn(b).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


class _SharedEncoding(torch.nn.Module):
    """One submodule registered under two parents, as timm's CoaT shares its positional encoding."""

    def __init__(self) -> None:
        super().__init__()
        shared = torch.nn.Linear(8, 8)
        self.first = torch.nn.Sequential(shared, torch.nn.ReLU())
        self.second = torch.nn.Sequential(shared, torch.nn.GELU())
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.second(self.first(x)))


def test_compiling_leaves_a_model_with_a_shared_submodule_as_it_was(config) -> None:  # type: ignore[no-untyped-def]
    """torch's restore after functional_call put a traced tensor back under the second name of a
    shared submodule: the model lost its Parameter, and every later trace (a new batch size, the
    backend) failed inside functorch (timm's coat_lite_tiny, session 26)."""
    torch.manual_seed(0)
    model = _SharedEncoding().eval()
    before = {id(m): (dict(m._parameters), dict(m._buffers)) for m in model.modules()}
    weight = model.first[0].weight
    with torch.no_grad():
        for rows in (2, 5):  # a second capture of the same model object
            compiled = streamfuse.compile(model, (randn(rows, 8),), config)
            x = randn(rows, 8, seed=rows)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    after = {id(m): (dict(m._parameters), dict(m._buffers)) for m in model.modules()}
    assert all(a is b for k in before for old, new in zip(before[k], after[k], strict=True)
               for a, b in zip(old.values(), new.values(), strict=True)) and before.keys() == after.keys()
    assert isinstance(model.second[0].weight, torch.nn.Parameter) and model.second[0].weight is weight
    torch._dynamo.reset()
    backend = torch.compile(model, backend=streamfuse.make_backend(config))
    with torch.no_grad():
        x = randn(4, 8, seed=4)
        torch.testing.assert_close(backend(x), model(x), rtol=1e-5, atol=1e-5)


class _CachedTable(torch.nn.Module):
    """A forward that caches a tensor in a plain attribute (a position table for the current width)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.table: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None or self.table.shape[0] != x.shape[1]:
            self.table = torch.arange(x.shape[1], dtype=x.dtype, device=x.device)
        return self.lin(x) + self.table


def test_a_tensor_cached_by_forward_is_not_left_traced_on_the_model(config) -> None:  # type: ignore[no-untyped-def]
    """The trace stored its fake tensor in the attribute; eager calls afterwards used it (and raised)."""
    torch.manual_seed(0)
    model = _CachedTable().eval()
    x = randn(2, 8)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config)
        assert model.table is None  # as before the compile: the trace's table is gone
        expected = model.lin(x) + torch.arange(8.0)
        torch.testing.assert_close(model(x), expected)  # eager afterwards builds its own, real table
        torch.testing.assert_close(compiled(x), expected, rtol=1e-5, atol=1e-5)
    real = model.table
    with torch.no_grad():
        streamfuse.compile(model, (randn(3, 8),), config)
    assert model.table is real


def test_a_function_without_inputs(config) -> None:  # type: ignore[no-untyped-def]
    table = randn(4, 8)
    compiled = streamfuse.compile(lambda: torch.softmax(table * 2, -1), (), config)
    torch.testing.assert_close(compiled(), torch.softmax(table * 2, -1))
    with pytest.raises(ValueError, match="expected 0 input tensor"):
        compiled(table)


def test_a_compiled_graph_refuses_copy_and_pickle_by_name(config) -> None:  # type: ignore[no-untyped-def]
    """deepcopy used to fail deep inside torch ('Only Tensors created explicitly by the user ... support
    the deepcopy protocol'), pickle on a pybind11 record; both now say what to do instead."""
    import copy
    import pickle

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    x = randn(4, 8)
    compiled = streamfuse.compile(model, (x,), config)
    for attempt in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be (copied|pickled).*streamfuse.compile"):
            attempt(compiled)
    twin = streamfuse.compile(copy.deepcopy(model), (x,), config)  # the way the message gives
    torch.testing.assert_close(twin(x), model(x))


def test_compile_results_carry_no_partial_gradients(config) -> None:  # type: ignore[no-untyped-def]
    """Generated kernels record no autograd graph: results that kept one through the ATen steps
    alone would give partial gradients, silently. streamfuse.compile's results carry none, and a
    call with grad enabled on a model that requires grad says to train through the backend."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    x = randn(3, 8)
    compiled = streamfuse.compile(model, (x,), config)
    with pytest.warns(UserWarning, match="for inference"):
        out = compiled(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, model(x).detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.sum().backward()


def test_config_settings_parse_by_field_type() -> None:
    """`streamfuse bench --set NAME=VALUE`: each value takes its field's type; bad names and values
    are errors that name them."""
    config = streamfuse.Config().with_settings(["backend_cuda_graphs=true", "batch_buckets=1,4", "fusion_fuel=none",
                                                "max-streams=2", "conv_layout=native", "conv_layout_margin=0.25"])
    assert (config.backend_cuda_graphs, config.batch_buckets, config.fusion_fuel, config.max_streams,
            config.conv_layout, config.conv_layout_margin) == (True, (1, 4), None, 2, "native", 0.25)
    with pytest.raises(ValueError, match="max_streams: expected a value of type int, got 'x'"):
        streamfuse.Config().with_settings(["max_streams=x"])
    with pytest.raises(ValueError, match="NAME a Config field"):
        streamfuse.Config().with_settings(["no_such_field=1"])
    with pytest.raises(ValueError, match="conv_layout must be"):
        streamfuse.Config().with_settings(["conv_layout=sideways"])


class _ShiftedWindowMask(torch.nn.Module):
    """swin_t's attention mask: slices of a fresh tensor set to Python ints trace 0-dim CPU constants
    whatever the model's device; with two branches, so the GPU plan uses streams."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = x.new_zeros((8, 8))
        count = 0
        for h in ((0, 4), (4, 6), (6, None)):
            mask[h[0]:h[1], :] = count
            count += 1
        mask = mask.unsqueeze(1) - mask.unsqueeze(2)
        mask = mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)
        return torch.softmax(x @ x.transpose(-1, -2) + mask.sum(0), -1) + torch.relu(x).sum(-1, keepdim=True)


def test_cpu_scalar_constants_in_a_device_graph(config, device) -> None:  # type: ignore[no-untyped-def]
    model = _ShiftedWindowMask()
    x = randn(3, 8, 8, device=device)
    compiled = streamfuse.compile(model, (x,), config)
    assert isinstance(compiled, streamfuse.CompiledGraph)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


def test_torch_compile_mode_and_options_choose_the_backend_s_config() -> None:
    """torch.compile(..., backend="streamfuse", mode=..., options=...) reach the backend's Config:
    options by Config field name, modes by torch.compile's names; anything else is a clear error."""
    import streamfuse.capture.backend as backend_module

    f = lambda x: torch.relu(x) * 2 + 1  # noqa: E731
    x = randn(4, 8)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="streamfuse", options={"fuse": False, "executor": "reference"})
    torch.testing.assert_close(compiled(x), f(x))
    graph = backend_module.compiled_graphs[-1]
    assert graph.config.fuse is False and graph.config.executor == "reference"
    assert graph.stats["kernels"] == graph.stats["source_ops"]  # fusion off: one kernel per op
    cfg = backend_module.config_for("max-autotune-no-cudagraphs")
    assert cfg.profile_guided and not cfg.cuda_graphs and not cfg.backend_cuda_graphs
    assert backend_module.config_for("reduce-overhead") == backend_module.config_for()
    for kwargs, words in ((dict(options={"fusion": False}), "unknown option(s) 'fusion'"),
                          (dict(mode="fastest"), "mode='fastest'")):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=re.escape(words)):
            torch.compile(f, backend="streamfuse", **kwargs)(x)
