"""Training through `torch.compile(backend=streamfuse)`: a few SGD steps against eager.

AOTAutograd sends the forward and the backward aten graphs through the backend; the loss, every
parameter's gradient, and every parameter and buffer after each optimizer step must match eager's.
A wrong gradient is silent (the loss of the first step still matches), so each step checks them all.

Regression: torch's core decomposition of `_scaled_dot_product_flash_attention_for_cpu` (registered
for export, inference only: torch/_decomp/decompositions.py says inductor must exclude it) returns
the attention probabilities where the real op returns the logsumexp. The op's backward is not
decomposed and reads that result as a logsumexp, so with the decomposition in the capture table
every gradient upstream of attention was wrong (GPT-2: 60% to 1,300% off) while the loss matched.
capture/decomp.py keeps SDPA whole.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import streamfuse
from streamfuse.capture.decomp import decomposition_table

aten = torch.ops.aten

RTOL, ATOL = 1e-4, 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _assert_match(what: str, got: torch.Tensor | None, want: torch.Tensor | None) -> None:
    assert (got is None) == (want is None), f"{what}: compiled {got is not None}, eager {want is not None}"
    if got is None or want is None:
        return
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{what} (relative norm error {_rel(got, want):.3g}): {m}")


def train_and_compare(model: nn.Module, batches: list[tuple[Any, ...]], loss_fn: Callable[..., torch.Tensor],
                      config: streamfuse.Config, lr: float = 0.05) -> None:
    """Train `model` through the backend and a deep copy eagerly, one SGD step per batch; after each
    step compare loss, every gradient (None-ness too), every parameter and every buffer."""
    torch._dynamo.reset()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=streamfuse.make_backend(config))
    opt_c = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    opt_e = torch.optim.SGD(eager.parameters(), lr=lr, momentum=0.9)
    for step, batch in enumerate(batches):
        loss_c = loss_fn(compiled, *batch)
        loss_e = loss_fn(eager, *batch)
        loss_c.backward()
        loss_e.backward()
        _assert_match(f"step {step}: loss", loss_c.detach(), loss_e.detach())
        for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters(), strict=True):
            _assert_match(f"step {step}: grad of {name}", p.grad, q.grad)
        opt_c.step()
        opt_e.step()
        opt_c.zero_grad()
        opt_e.zero_grad()
        for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters(), strict=True):
            _assert_match(f"step {step}: parameter {name} after the update", p.detach(), q.detach())
        for (name, b), (_, c) in zip(model.named_buffers(), eager.named_buffers(), strict=True):
            _assert_match(f"step {step}: buffer {name}", b, c)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=_gen(seed))


# ---------------------------------------------------------------------------- the decomposition table
def test_capture_table_keeps_cpu_flash_attention_whole() -> None:
    """Its torch decomposition is for inference only (see the module docstring): in the table it makes
    every gradient through attention wrong, silently."""
    assert aten._scaled_dot_product_flash_attention_for_cpu.default not in decomposition_table()


class _CompositeOps(nn.Module):
    """CompositeImplicitAutograd ops (linear, flatten, adaptive pooling, dropout, attention) beside core ones."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.flatten(nn.functional.adaptive_avg_pool2d(self.bn(self.conv(x)), 2), 2).transpose(1, 2)
        y = self.drop(nn.functional.gelu(self.fc(self.norm(y))))
        y = nn.functional.scaled_dot_product_attention(y, y, y).softmax(-1)
        return y.sum(dim=1).log_softmax(-1)


@pytest.mark.parametrize("training", [False, True])
def test_tracing_table_captures_what_the_full_table_does(training: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tracing table leaves out torch's entries for CompositeImplicitAutograd ops (they decompose
    as they are traced): make_fx's capture and AOTAutograd's forward and backward graphs come out
    the same as with the full table that ExportedProgram.run_decompositions gets."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from streamfuse.capture import export
    from streamfuse.capture.decomp import export_decomposition_table

    lean, full = decomposition_table(), export_decomposition_table()
    assert len(lean) < len(full) and set(lean) <= set(full)
    model = _CompositeOps().train(training)
    x = _randn(2, 3, 6, 6, seed=51)
    codes: dict[int, list[str]] = {}
    for table in (lean, full):
        graphs = codes.setdefault(id(table), [])
        monkeypatch.setattr(export, "decomposition_table", lambda table=table: table)
        if not training:
            graphs.append(export._capture_functional(model, (x,), ["x"]).gm.code)

        def keep(gm: torch.fx.GraphModule, example: Any, graphs: list[str] = graphs) -> Any:
            graphs.append(gm.code)
            return make_boxed_func(gm)

        torch._dynamo.reset()
        compiled = torch.compile(model, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep,
                                                             inference_compiler=keep, decompositions=table))
        with torch.set_grad_enabled(training):
            out = compiled(x)
        if training:
            out.sum().backward()
    torch._dynamo.reset()
    assert len(codes[id(lean)]) == 2
    assert codes[id(lean)] == codes[id(full)]


class _CheckDecompositions(TorchDispatchMode):
    """Runs every multi-result op that the capture table decomposes both ways and records the results
    where the decomposition differs from the kernel. A backward the table leaves whole reads the
    forward's extra results (saved statistics, logsumexp, indices): a decomposition that returns
    something else there trains wrongly while the forward looks right."""

    def __init__(self) -> None:
        super().__init__()
        self.table = decomposition_table()
        self.checked: set[str] = set()
        self.wrong: dict[str, list[int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        decomposition = self.table.get(func)
        # (the functions checked draw no random numbers: a dropout's decomposition would differ)
        if decomposition is None or not isinstance(out, (tuple, list)):
            return out
        self.checked.add(str(func))
        for i, (a, b) in enumerate(zip(out, decomposition(*args, **kwargs), strict=True)):
            if isinstance(a, torch.Tensor) and a.numel() and not (
                    isinstance(b, torch.Tensor) and a.shape == b.shape
                    and torch.allclose(a, b.to(a.dtype), rtol=1e-4, atol=1e-5, equal_nan=True)):
                self.wrong.setdefault(str(func), []).append(i)
        return out


def test_decompositions_in_the_table_return_every_result_as_the_kernel_does() -> None:
    x = _randn(2, 4, 6, 8, seed=50)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    with _CheckDecompositions() as check:
        for kwargs in ({}, {"is_causal": True}, {"attn_mask": mask}, {"attn_mask": x[0, 0, :, :6]}):
            F.scaled_dot_product_attention(x, x * 0.5, x + 1, **kwargs)
        F.layer_norm(x, (8,), torch.ones(8), torch.zeros(8))
        F.group_norm(x, 2)
        F.batch_norm(x, torch.zeros(4), torch.ones(4), training=True)
        F.max_pool2d(x, 2, return_indices=True)
        F.max_pool1d(x[0], 2, return_indices=True)
        F.nll_loss(F.log_softmax(x[:, :, 0, 0], -1), torch.tensor([0, 3]))
        F.logsigmoid(x)
        torch.std_mean(x, dim=-1)
        torch.aminmax(x, dim=-1)
    assert "aten.native_layer_norm.default" in check.checked  # the check is not vacuous
    assert not check.wrong, f"decompositions whose results differ from the kernel's: {check.wrong}"


# ---------------------------------------------------------------------------- models
class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.norm(self.fc1(x)), approximate="tanh"))


def test_mlp(train_config: streamfuse.Config) -> None:
    torch.manual_seed(0)
    batches = [(_randn(8, 16, seed=i), torch.randint(0, 4, (8,), generator=_gen(i))) for i in range(3)]
    train_and_compare(_MLP(), batches, lambda m, x, y: F.cross_entropy(m(x), y), train_config)


def test_float32_products_emulated_on_tensor_cores_train_like_eager(train_config: streamfuse.Config,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Config.float32_matmul="tf32x3": the training graphs' float32 products (forward, and the
    backward's input and weight gradients, whose operands are transposed views) may run in the
    matmul template, epilogue or not; the step still trains like eager's. Shapes large enough for
    the cost model to pick the template without an epilogue, its K-step latency prior lowered so it
    does for all five products here."""
    from streamfuse.codegen import matmul

    asked: list[str] = []
    generate = matmul.generate_matmul

    def spy(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs.get("float32", ""))
        return generate(*args, **kwargs)

    monkeypatch.setattr(matmul, "generate_matmul", spy)
    model = nn.Sequential(nn.Linear(256, 384), nn.GELU(), nn.Linear(384, 256))
    batches = [(_randn(320, 256, seed=i), _randn(320, 256, seed=10 + i)) for i in range(2)]
    train_and_compare(model, batches, lambda m, x, y: F.mse_loss(m(x), y),
                      train_config.replace(float32_matmul="tf32x3", check_templates=False, triton_matmul_k_step_us=0.01))
    if train_config.executor == "triton":
        # two forward products (bias + GELU, bias), one input gradient, two weight gradients
        assert asked.count("tf32x3") == 5, asked


def test_batch_norm_under_bfloat16_autocast_trains(train_config: streamfuse.Config) -> None:
    """CPU bf16 autocast: a float32 batch-norm's saved statistics are float32 at run time while
    AOTAutograd's metadata said bfloat16, and the backward's plan refused them (InputMismatch from
    loss.backward(), session-27 sweep). The graph is traced again on the real tensors; gradients
    match eager's within bfloat16's tolerance."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1))
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=streamfuse.make_backend(train_config))
    target = _randn(2, 4, 8, 8, seed=2)
    for step in range(2):
        x = _randn(2, 3, 8, 8, seed=step)
        losses = []
        for m in (compiled, eager):
            with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                out = m(x)
            losses.append(((out.float() - target) ** 2).mean())
            losses[-1].backward()
        assert abs(losses[0].item() - losses[1].item()) <= 2e-2 * abs(losses[1].item())
        for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            if name == "0.bias":  # feeds a training batch norm: its true gradient is 0, both hold bf16 noise
                scale = 1e-2 * model[0].weight.grad.norm()
                assert p.grad.norm() <= scale and q.grad.norm() <= scale, f"step {step}: {name}'s gradient is not ~0"
            else:
                assert _rel(p.grad, q.grad) <= 2e-2, f"step {step}: grad of {name}: {_rel(p.grad, q.grad):.3g}"
        for p in list(model.parameters()) + list(eager.parameters()):
            p.grad = None
        for (name, b), (_, c) in zip(model.named_buffers(), eager.named_buffers(), strict=True):
            assert _rel(b.float(), c.float()) <= 2e-2, f"step {step}: buffer {name}"


class _InPlace(nn.Module):
    """In-place ops on activations, a buffer updated in place in forward, and training batch-norm."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 12)
        self.bn = nn.BatchNorm1d(12)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.mul_(2.0).add_(1.0)
        h = torch.relu_(self.bn(h))
        self.calls.add_(1)
        self.ema.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
        return h


def test_in_place_ops_and_buffers(train_config: streamfuse.Config) -> None:
    torch.manual_seed(1)
    batches = [(_randn(6, 12, seed=10 + i),) for i in range(3)]
    train_and_compare(_InPlace(), batches, lambda m, x: (m(x) ** 2).mean(), train_config)


class _ParamViews(nn.Module):
    """Parameters read through views: transposed, sliced, reshaped, and one used twice (tied)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 24) * 0.2)
        self.b = nn.Parameter(torch.randn(2, 4) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w[:, :8].t() + self.b.view(8)  # [n, 8]
        h = torch.tanh(h) @ self.w.view(8, 3, 8)[:, 1, :]  # [n, 8]
        return h @ self.w  # the whole weight again: [n, 24]


def test_views_of_parameters(train_config: streamfuse.Config) -> None:
    torch.manual_seed(2)
    batches = [(_randn(5, 8, seed=20 + i),) for i in range(3)]
    train_and_compare(_ParamViews(), batches, lambda m, x: m(x).pow(2).mean(), train_config)


class _Checkpointed(nn.Module):
    """Residual blocks under activation checkpointing (torch.utils.checkpoint, non-reentrant, as
    transformers' gradient_checkpointing_enable uses): the partitioner recomputes their forward in
    the backward graph."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"fc1": nn.Linear(12, 24), "fc2": nn.Linear(24, 12),
                                                   "norm": nn.LayerNorm(12)}) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.utils.checkpoint.checkpoint(
                lambda t, b=b: b["norm"](t + b["fc2"](F.gelu(b["fc1"](t)))), x, use_reentrant=False)
        return x


def test_activation_checkpointing(train_config: streamfuse.Config) -> None:
    torch.manual_seed(3)
    batches = [(_randn(6, 12, seed=30 + i),) for i in range(3)]
    train_and_compare(_Checkpointed(), batches, lambda m, x: m(x).pow(2).mean(), train_config)


class _Aliasing(nn.Module):
    """Outputs that alias a parameter and each other, a buffer overwritten, the input mutated."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6) * 0.3)
        self.register_buffer("last", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x.mul_(2.0)
        y = x @ self.w
        self.last.copy_(y.detach().sum(0))
        return y, y.t(), self.w, self.w.view(36), y[1:]


def _aliasing_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    y, yt, w, flat, tail = model(x)  # doubles x in place: x.sum() below sees it
    return (y * 2).sum() + yt.pow(2).mean() + w.sum() * 0.1 + flat.mean() + tail.tanh().sum() + x.sum()


def test_outputs_aliasing_parameters_and_a_mutated_input(train_config: streamfuse.Config) -> None:
    torch.manual_seed(5)
    batches = [(_randn(4, 6, seed=60 + i),) for i in range(3)]
    train_and_compare(_Aliasing(), batches, _aliasing_loss, train_config)


class _Attention(nn.Module):
    def __init__(self, causal: bool, masked: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.proj = nn.Linear(32, 32)
        self.causal, self.masked = causal, masked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
        mask = None
        if self.masked:  # a boolean mask: the last key of every sequence is hidden
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device)
            mask[:, -1] = False
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(n, t, 32))


@pytest.mark.parametrize(("causal", "masked"), [(False, False), (True, False), (False, True)])
def test_scaled_dot_product_attention_backward(causal: bool, masked: bool, config: streamfuse.Config) -> None:
    torch.manual_seed(3)
    batches = [(_randn(2, 6, 32, seed=30 + i),) for i in range(2)]
    train_and_compare(_Attention(causal, masked), batches, lambda m, x: m(x).pow(2).mean(),
                      config.replace(executor="reference"))


def test_gpt2_tied_weights(train_config: streamfuse.Config) -> None:
    """The 2-layer GPT-2 language model whose gradients were wrong: tied LM head and token embedding,
    Conv1D (addmm on a transposed weight), tanh-GELU, SDPA with a causal mask, views."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(4)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg).float().train()
    assert model.lm_head.weight is model.transformer.wte.weight
    # the generated kernels run in Triton's interpreter on CPU, where one GPT-2 backward takes ~10 s:
    # one step there (the wrong gradients showed on the first), two steps under the reference executor
    steps = 1 if train_config.executor == "triton" and not torch.cuda.is_available() else 2
    batches = [(torch.randint(0, 256, (2, 16), generator=_gen(40 + i)),) for i in range(steps)]
    train_and_compare(model, batches, lambda m, ids: m(ids, labels=ids).loss, train_config)


_BERT_LIKE = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
TEXT_ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # name: (model class, config class, small config with dropout 0)
    "bert": ("BertForMaskedLM", "BertConfig", dict(_BERT_LIKE, max_position_embeddings=64)),
    "distilbert": ("DistilBertForMaskedLM", "DistilBertConfig",
                   dict(n_layers=2, dim=32, n_heads=4, hidden_dim=64, max_position_embeddings=64, dropout=0.0,
                        attention_dropout=0.0)),
    "roberta": ("RobertaForMaskedLM", "RobertaConfig", dict(_BERT_LIKE, max_position_embeddings=70)),
    "t5": ("T5ForConditionalGeneration", "T5Config",
           dict(num_layers=2, d_model=32, d_kv=8, num_heads=4, d_ff=64, dropout_rate=0.0, decoder_start_token_id=0)),
    "llama": ("LlamaForCausalLM", "LlamaConfig",
              dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=64, max_position_embeddings=64)),
}


@pytest.mark.parametrize("arch", list(TEXT_ARCHITECTURES))
def test_text_architectures_train_like_eager(arch: str, config: streamfuse.Config) -> None:
    """The suite's other Hugging Face architectures in training mode (small configs, dropout 0): padding
    and attention masks, relative position buckets (T5), RoPE, RMSNorm, SwiGLU and grouped-query
    attention (Llama); two SGD steps, every gradient against eager (reference executor: the generated
    kernels of these models are checked by GPT-2 above and by tests/test_models.py)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(5)
    model_class, config_class, sizes = TEXT_ARCHITECTURES[arch]
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(vocab_size=128, **sizes))
    model = model.float().train()
    ids = [torch.randint(1, 128, (2, 12), generator=_gen(50 + i)) for i in range(2)]
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0  # a padded second row

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(input_ids=x, attention_mask=mask, labels=x).loss  # type: ignore[no-any-return]

    train_and_compare(model, [(x,) for x in ids], loss, config.replace(executor="reference"))


@pytest.mark.parametrize("streams", [1, 3])
def test_training_graphs_plan_training_max_streams(streams: int) -> None:
    """A training step's graphs keep their memory pool, where each stream keeps its own free blocks:
    they are planned with Config.training_max_streams; an inference graph keeps max_streams."""
    from streamfuse.capture.backend import compiled_graphs, make_backend

    class Branches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.parts = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([p(x).relu() for p in self.parts], 1)

    torch.manual_seed(0)
    model = Branches()
    # three sibling Linears: kept apart (merge_sibling_linears would make them one), so the branches are real
    config = streamfuse.Config(executor="reference", max_streams=4, training_max_streams=streams,
                               merge_sibling_linears=False)
    before = len(compiled_graphs)
    compiled = torch.compile(model, backend=make_backend(config))
    compiled(torch.randn(8, 16)).sum().backward()
    with torch.no_grad():
        compiled(torch.randn(8, 16))
    graphs = [g for g in compiled_graphs[before:] if g is not None]
    plans = [getattr(g, "compiled", g) for g in graphs]
    streams_of = [c.base.schedule.streams for c in plans if hasattr(c, "base")]
    assert streams_of == [streams, streams, 3]  # forward, backward; then the no_grad call's graph
    torch._dynamo.reset()


@pytest.mark.gpu
def test_training_batch_norm_runs_cudnn_with_the_native_results() -> None:
    """Training batch norm runs through a stand-in on CUDA (runtime/steps._batch_norm_functional):
    cuDNN's kernels, with the native op's results in the same positions (the saved inverse std is what
    the decomposed backward reads)."""
    from torch.profiler import ProfilerActivity, profile

    from streamfuse.runtime.steps import _batch_norm_functional

    torch.manual_seed(0)
    x = torch.randn(8, 16, 12, 12, device="cuda") * 3 + 1
    w, b = torch.rand(16, device="cuda") + 0.5, torch.randn(16, device="cuda")
    rm, rv = torch.randn(16, device="cuda"), torch.rand(16, device="cuda") + 0.5
    ref = torch.ops.aten._native_batch_norm_legit_functional.default(x, w, b, rm, rv, True, 0.1, 1e-5)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ours = _batch_norm_functional(x, w, b, rm, rv, True, 0.1, 1e-5)
        torch.cuda.synchronize()
    assert len(ours) == len(ref) == 5
    for got, want in zip(ours, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    names = [e.name for e in prof.events()]
    assert any("bn_fw" in n or "cudnn" in n.lower() for n in names), names


def test_backward_dtype_conversions_are_generated(train_config: streamfuse.Config) -> None:
    """The backward of `.to(dtype)` is `_to_copy(grad, dtype=..., layout=strided, device=<its own
    device>)`: a conversion, not a move, so it runs in a generated kernel (GPT-2's backward made four
    ATen copies per layer of it, reading dropout's masks) and the gradients still match eager's."""
    from streamfuse.capture.backend import compiled_graphs
    from streamfuse.fusion.groups import GroupKind

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(12, 16), nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x).to(torch.float64).tanh().to(torch.float32)  # two conversions, each with a backward
            return self.b(h * h.to(torch.float16).float())

    torch.manual_seed(0)
    model = Mixed()
    before = len(compiled_graphs)
    batches = [(torch.randn(6, 12),) for _ in range(2)]
    train_and_compare(model, batches, lambda m, x: m(x).square().mean(), train_config)
    plans = [getattr(g, "compiled", g) for g in compiled_graphs[before:] if g is not None]
    groups = [grp for c in plans if hasattr(c, "base") for grp in c.base.plan.groups]
    copies = [grp for grp in groups if grp.kind is GroupKind.ATEN and "_to_copy" in grp.nodes[0].op]
    assert len(plans) == 2 and not copies, [grp.nodes[0].kwargs for grp in copies]


def test_a_copy_to_another_device_keeps_its_device() -> None:
    """Only a `_to_copy` onto its input's own device loses the `device` keyword; a move keeps it (and
    stays in ATen, ir/ops.refine_kind)."""
    from streamfuse.ir.from_fx import _same_device_copy

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(3, 4)
    kwargs = {"dtype": torch.float16, "layout": torch.strided, "device": torch.device("cpu")}
    same = graph.call_function(aten._to_copy.default, (x,), kwargs)
    same.meta["val"] = torch.empty(3, 4, dtype=torch.float16)
    moved = graph.call_function(aten._to_copy.default, (x,), kwargs | {"device": torch.device("meta")})
    moved.meta["val"] = torch.empty(3, 4, dtype=torch.float16, device="meta")
    pinned = graph.call_function(aten._to_copy.default, (x,), kwargs | {"pin_memory": True})
    pinned.meta["val"] = torch.empty(3, 4, dtype=torch.float16)
    assert _same_device_copy(same, dict(same.kwargs)) == {"dtype": torch.float16}
    assert _same_device_copy(moved, dict(moved.kwargs)) == moved.kwargs
    assert _same_device_copy(pinned, dict(pinned.kwargs)) == pinned.kwargs
