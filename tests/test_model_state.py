"""What a compiled model sees of its model after compiling: gradients wanted at a call, train/eval
switches, parameters given new memory, replaced parameters, buffers and submodules (and the
registration counter that watches for them), and the autocast and TF32 state of a call."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import randn

import streamfuse
from streamfuse.capture import backend as backend_module


def test_a_call_that_would_record_gradients_warns_even_after_the_first_call(config) -> None:  # type: ignore[no-untyped-def]
    """streamfuse.compile's results carry no gradients: a call with grad enabled where a parameter or
    an input requires grad warns, at whichever call that first happens (once per model)."""
    compiled = streamfuse.compile(lambda t: t.exp(), (randn(2, 8),), config)
    with torch.no_grad():
        compiled(randn(2, 8))
    x = randn(2, 8, seed=3).requires_grad_()
    with pytest.warns(UserWarning, match="carry no gradients"):
        out = compiled(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, x.detach().exp())
    model = torch.nn.Linear(8, 4)
    with torch.no_grad():
        module = streamfuse.compile(model, (randn(2, 8),), config)
        module(randn(2, 8))
    with pytest.warns(UserWarning, match="under torch.no_grad"):
        module(randn(2, 8))


def test_a_model_switched_to_the_other_mode_runs_eagerly_until_it_is_back(config) -> None:  # type: ignore[no-untyped-def]
    """Compiled in eval mode, then model.train(): dropout must apply as in eager, so calls run the
    model eagerly (one warning) until model.eval(), then the plan again."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)).eval()
    x = randn(64, 8)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config)
        torch.testing.assert_close(compiled(x), model(x))
        model.train()
        with pytest.warns(UserWarning, match="compiled in eval mode and is in training mode"):
            dropped = compiled(x)
        assert 0.3 < float((dropped == 0).float().mean()) < 0.7  # dropout applied, as in eager
        model.eval()
        torch.testing.assert_close(compiled(x), model(x))
    assert compiled.stats["specializations"] == 0


def test_a_parameter_given_new_memory_is_seen_by_both_entry_points(config) -> None:  # type: ignore[no-untyped-def]
    """`p.data = t` (and Module._apply round trips such as `.double().float()`) gives a parameter new
    memory without a version bump. The backend's inference graph binds again (a hoisted transpose of
    the Linear weight kept reading the old memory: wrong by 20 on the CPU); streamfuse.compile's
    plan runs the model eagerly with one warning (its recorded CUDA graphs hold the old address)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    x = randn(4, 16)
    torch._dynamo.reset()
    fast = torch.compile(model, backend=streamfuse.make_backend(config.replace(backend_cuda_graphs=True)))
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config)
        torch.testing.assert_close(fast(x), model(x))
        torch.testing.assert_close(compiled(x), model(x))
        model[0].weight.data = randn(32, 16, seed=7)
        torch.testing.assert_close(fast(x), model(x))
        with pytest.warns(streamfuse.StreamfuseFallbackWarning, match="given new memory"):
            torch.testing.assert_close(compiled(x), model(x))
        model.double().float()
        torch.testing.assert_close(fast(x), model(x))
        torch.testing.assert_close(compiled(x), model(x))
    torch._dynamo.reset()


@pytest.mark.parametrize("change", ["parameter", "submodule", "buffer", "tie"])
def test_a_replaced_parameter_buffer_or_submodule_is_seen_by_both_entry_points(config, change: str) -> None:  # type: ignore[no-untyped-def]
    """A new object assigned after compiling (`fc.weight = nn.Parameter(w)`, `act = nn.Tanh()`,
    `register_buffer` again, tying two weights): streamfuse.compile's plan still read the old one and
    returned stale results, silently (wrong by 2 here). Now it runs the model eagerly with one
    warning naming what changed; the backend's guards recompile. Building an unrelated model in
    between (its registrations advance the same counter) changes nothing."""
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.act, self.b = torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16)
            self.register_buffer("shift", torch.randn(16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.act(self.a(x))) + self.shift

    torch.manual_seed(0)
    model = Net().eval()
    x = randn(4, 16)
    torch._dynamo.reset()
    fast = torch.compile(model, backend=streamfuse.make_backend(config))
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config)
        torch.testing.assert_close(compiled(x), model(x))
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))  # registers elsewhere
        torch.testing.assert_close(compiled(x), model(x))
        assert compiled.eager_reason is None
        if change == "parameter":
            model.b.weight = torch.nn.Parameter(randn(16, 16, seed=3))
        elif change == "submodule":
            model.act = torch.nn.Tanh()
        elif change == "buffer":
            model.register_buffer("shift", randn(16, seed=4))
        else:
            model.b.weight = model.a.weight
        with pytest.warns(streamfuse.StreamfuseFallbackWarning, match="compile again"):
            torch.testing.assert_close(compiled(x), model(x))
        torch.testing.assert_close(fast(x), model(x))
        torch.testing.assert_close(compiled(x), model(x))
    torch._dynamo.reset()


def test_the_registration_counter_does_not_make_dynamo_recompile(config) -> None:  # type: ignore[no-untyped-def]
    """streamfuse.compile installs global registration hooks (runtime/structure.py). A forward that
    registers a buffer at every call, compiled by the backend, must not have Dynamo guard on the
    hooks' counter: it recompiled at every call (Hugging Face's static KV cache, session 38)."""
    class Caching(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.register_buffer("last", x.detach(), persistent=False)
            return self.lin(x).relu()

    streamfuse.compile(torch.nn.Linear(4, 4), (randn(2, 4),), config)  # installs the hooks
    model = Caching()
    torch._dynamo.reset()
    fast = torch.compile(model, backend=streamfuse.make_backend(config))
    graphs = []
    with torch.no_grad():
        for seed in range(5):
            x = randn(2, 8, seed=seed)
            torch.testing.assert_close(fast(x), model.lin(x).relu())
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[1], graphs  # nothing compiled after the second call
    torch._dynamo.reset()


def test_a_call_under_another_autocast_state_runs_eagerly(config) -> None:  # type: ignore[no-untyped-def]
    """Autocast chose each op's dtype when the plan was captured: compiled outside it and called
    inside, the plan returned float32 (or, with the reference executor, a mix) where eager returns
    bfloat16, and compiled inside and called outside it returned bfloat16 where eager returns
    float32. Such calls now run eagerly with one warning; calls in the compiled state stay compiled."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()
    x = randn(4, 16)
    with torch.no_grad():
        plain = streamfuse.compile(model, (x,), config)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = streamfuse.compile(model, (x,), config)
            want_mixed = model(x)
            torch.testing.assert_close(mixed(x), want_mixed, rtol=2e-2, atol=2e-2)
            with pytest.warns(UserWarning, match="compiled under no autocast and is called under autocast to bfloat16"):
                got = plain(x)
            assert got.dtype == torch.bfloat16 and torch.equal(got, want_mixed)
        with pytest.warns(UserWarning, match="compiled under autocast to bfloat16 and is called under no autocast"):
            got = mixed(x)
        assert got.dtype == torch.float32 and torch.equal(got, model(x))
        torch.testing.assert_close(plain(x), model(x))
        assert plain.eager_reason is None and mixed.eager_reason is None


def _conv_bn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).eval()


def test_forward_hooks_added_or_removed_after_compiling_are_seen(config) -> None:  # type: ignore[no-untyped-def]
    """The trace made the hooks there were part of the plan: a hook added after compiling (on the
    model, a submodule or globally) or removed from the model makes the model run eagerly, with one
    warning (helper sweep, session 41: silently ignored before)."""
    x = randn(4, 16)
    with torch.no_grad():
        for where in ("model", "submodule", "global", "removed"):
            model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU()).eval()
            handle = model.register_forward_hook(lambda m, i, o: o * 3) if where == "removed" else None
            compiled = streamfuse.compile(model, (x,), config)
            torch.testing.assert_close(compiled(x), model(x))
            if where == "model":
                handle = model.register_forward_hook(lambda m, i, o: o * 2)
            elif where == "submodule":
                handle = model[0].register_forward_pre_hook(lambda m, i: (i[0] + 1,))
            elif where == "global":
                handle = torch.nn.modules.module.register_module_forward_hook(
                    lambda m, i, o, model=model: o * 2 if m is model else o)
            else:
                handle.remove()
            with pytest.warns(streamfuse.StreamfuseFallbackWarning, match="forward hook was added or removed"):
                torch.testing.assert_close(compiled(x), model(x))
            torch.testing.assert_close(compiled(x), model(x))
            handle.remove()


def test_folded_batch_norms_follow_statistics_a_train_mode_forward_updated(config) -> None:  # type: ignore[no-untyped-def]
    """ATen's training-mode batch-norm updates the running statistics without bumping their version
    counters; the module's num_batches_tracked is watched too, so a recalibration pass in train mode
    followed by eval is seen (helper sweep, session 41: 0.27 off)."""
    model, x = _conv_bn(), randn(2, 3, 8, 8)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config)
        compiled(x)
        model.train()
        model(randn(4, 3, 8, 8, seed=5) * 3 + 1)  # the eager module: updates running_mean/var only
        model.eval()
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def test_backend_folds_follow_statistics_the_uncompiled_module_updated(config) -> None:  # type: ignore[no-untyped-def]
    """The same through the backend, with the uncompiled module's train-mode forward (a compiled
    train-mode call was seen already): the backend's graph holds the statistics but not the module,
    so the bound graph finds the module among the process's objects to watch its
    num_batches_tracked (session 43; stale folds before, as README said)."""
    model, x = _conv_bn(), randn(2, 3, 8, 8)
    torch._dynamo.reset()
    fast = torch.compile(model, backend=streamfuse.make_backend(config.replace(backend_cuda_graphs=True)))
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-5)
        graph = [g for g in backend_module.compiled_graphs if isinstance(g, backend_module.StaticParamsGraph)][-1]
        assert graph.folded == 1
        model.train()
        model(randn(4, 3, 8, 8, seed=5) * 3 + 1)  # the eager module: updates running_mean/var only
        model.eval()
        torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-5)
        assert graph.live


def test_no_snapshots_of_inference_tensors(config) -> None:  # type: ignore[no-untyped-def]
    """A model made under torch.inference_mode keeps no version counters, so folded weights could
    not follow a later in-place change: nothing is folded (helper sweep, session 41: a
    load_state_dict inside inference_mode left the folds stale, 1.5-5.7 off)."""
    x = randn(2, 3, 8, 8)
    with torch.inference_mode():
        model = _conv_bn()
        compiled = streamfuse.compile(model, (x,), config)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        state = {k: v * 1.5 if v.is_floating_point() else v for k, v in model.state_dict().items()}
        model.load_state_dict(state)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert not compiled.graph.snapshots


def test_weights_changed_after_a_change_through_data(config) -> None:  # type: ignore[no-untyped-def]
    """A change through `.data` bumps no version counter: the folded weights keep the old values
    until CompiledGraph.weights_changed(), which computes every copy again (the documented way)."""
    model, x = _conv_bn(), randn(2, 3, 8, 8)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config)
        compiled(x)
        model[0].weight.data.mul_(2)
        model[1].running_var.data.mul_(3)
        assert not torch.allclose(compiled(x), model(x), rtol=1e-3, atol=1e-3)  # the documented limit
        compiled.weights_changed()
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def test_tf32_baked_names_the_float32_work_each_setting_governs(config, tf32_flags) -> None:  # type: ignore[no-untyped-def]
    """What a CUDA plan built now would bake in: the matmul setting where it has float32 products, the
    cuDNN one where it has float32 convolutions; nothing for 16-bit work, with both off, or off CUDA.
    (Judged on graphs compiled here: the function reads only the graph and torch's flags.)"""
    from streamfuse.runtime.structure import tf32_baked

    linear = streamfuse.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()), (randn(2, 8),), config)
    conv = streamfuse.compile(_conv_bn(), (randn(1, 3, 6, 6),), config)
    half = streamfuse.compile(torch.nn.Linear(8, 8).to(torch.bfloat16), (randn(2, 8, dtype=torch.bfloat16),), config)
    tf32_flags(True, True)
    assert tf32_baked(linear.graph, "cuda") == (True, False)
    assert tf32_baked(conv.graph, "cuda") == (False, True)
    assert tf32_baked(half.graph, "cuda") is None
    assert tf32_baked(linear.graph, "cpu") is None
    tf32_flags(False, True)
    assert tf32_baked(linear.graph, "cuda") is None  # TF32 for convolutions only: a product keeps float32
    tf32_flags(False, False)
    assert tf32_baked(conv.graph, "cuda") is None


def test_a_call_after_tf32_was_withdrawn_runs_eagerly_until_it_is_allowed_again(config, tf32_flags) -> None:  # type: ignore[no-untyped-def]
    """A CUDA plan built with TF32 allowed rounds its float32 products to TF32 in its kernels and
    recorded graphs, whatever the flag says later: a call after the permission was withdrawn would be
    TF32-rounded where eager is exact (1e-3 where 1e-6 is expected). Such calls run the model eagerly
    (one warning) until TF32 is allowed again. The state is set by hand as a CUDA compile under TF32
    would (on the CPU nothing is baked: tf32_baked is None there)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()
    x = randn(4, 16)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config)
        assert compiled.tracks_tf32 and compiled.tf32_baked is None  # CPU: nothing baked
        planned: list[int] = []
        plan_call = compiled._call
        compiled._call = lambda inputs: planned.append(1) or plan_call(inputs)  # type: ignore[method-assign]
        compiled.tf32_baked = (True, False)
        tf32_flags(True, False)
        torch.testing.assert_close(compiled(x), model(x))
        assert len(planned) == 1  # allowed as compiled: the plan runs
        tf32_flags(False, True)
        with pytest.warns(UserWarning, match="compiled with TF32 allowed for matmuls .* and it is not now"):
            got = compiled(x)
        assert torch.equal(got, model(x)) and len(planned) == 1  # eager's result, the plan did not run
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled(x)
        assert not caught and len(planned) == 1  # one warning per model; still eager
        tf32_flags(True, False)
        compiled(x)
        assert len(planned) == 2 and compiled.eager_reason is None
        # allowed only after compiling: the plan computes in float32, more exactly than asked, and runs
        compiled.tf32_baked = None
        compiled(x)
        assert len(planned) == 3


@pytest.mark.gpu
def test_tf32_withdrawn_on_cuda_gives_float32_results(config, tf32_flags) -> None:  # type: ignore[no-untyped-def]
    """On CUDA: a model compiled with TF32 allowed (its products in the template, asked for TF32) and
    called with TF32 off returns float32-exact results (eager's), not TF32-rounded ones; and a model
    compiled with TF32 off whose first call (the CUDA graph's recording) came with TF32 on is treated
    the same: the recording baked TF32 into its cuBLAS calls."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256)).cuda().eval()
    x = randn(64, 256, device="cuda")
    wide = copy.deepcopy(model).double()
    with torch.no_grad():
        want = wide(x.double())
        tf32_flags(True, False)
        compiled = streamfuse.compile(model, (x,), config.replace(matmul_strategy="triton"))
        assert compiled.tf32_baked == (True, False)
        tf32_out = compiled(x)
        tf32_flags(False, False)
        with pytest.warns(UserWarning, match="compiled with TF32 allowed"):
            exact = compiled(x)
        late = streamfuse.compile(model, (x,), config)
        assert late.tf32_baked is None
        tf32_flags(True, False)
        late(x)  # under TF32: the first call records the CUDA graph, where graphs pay off for the model
        recorded = bool(late._runners)
        tf32_flags(False, False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            late_exact = late(x)
        # a recording under TF32 baked it in (eager then); without one, the plan's cuBLAS calls follow the flag
        assert any("compiled with TF32 allowed" in str(w.message) for w in caught) == recorded
    scale = float(want.abs().max())
    assert float((tf32_out.double() - want).abs().max()) > 1e-5 * scale  # TF32 was in effect when allowed
    for out in (exact, late_exact):
        assert float((out.double() - want).abs().max()) <= 1e-5 * scale
