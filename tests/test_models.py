"""Real architectures (Hugging Face transformers from small configs) through both entry points, on
random inputs, at the example shape and at others; and the backend's compile on fake tensors.

On CPU the generated kernels run in Triton's interpreter (conftest.py), so the configs are small;
the same architectures at real sizes run on the GPU in `streamfuse bench --suite models`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import streamfuse
from streamfuse.capture import backend as backend_module

transformers = pytest.importorskip("transformers")

VOCAB = 128


class TokensToTensor(nn.Module):
    """A Hugging Face model as a function of token ids returning one tensor (logits or hidden states)."""

    def __init__(self, model: nn.Module, cache_flag: bool):
        super().__init__()
        self.model = model
        self.cache_flag = cache_flag

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, use_cache=False) if self.cache_flag else self.model(input_ids=ids)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return TokensToTensor(transformers.GPT2LMHeadModel(cfg), cache_flag=True)


def _bert() -> nn.Module:
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                  vocab_size=VOCAB, max_position_embeddings=64)
    return TokensToTensor(transformers.BertModel(cfg), cache_flag=False)


def _distilbert() -> nn.Module:
    cfg = transformers.DistilBertConfig(n_layers=2, dim=32, n_heads=4, hidden_dim=64, vocab_size=VOCAB,
                                        max_position_embeddings=64)
    return TokensToTensor(transformers.DistilBertModel(cfg), cache_flag=False)


def _roberta() -> nn.Module:
    cfg = transformers.RobertaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                     vocab_size=VOCAB, max_position_embeddings=70)
    return TokensToTensor(transformers.RobertaModel(cfg), cache_flag=False)


def _t5_encoder() -> nn.Module:
    cfg = transformers.T5Config(num_layers=2, d_model=32, d_kv=8, num_heads=4, d_ff=64, vocab_size=VOCAB)
    return TokensToTensor(transformers.T5EncoderModel(cfg), cache_flag=False)


def _llama() -> nn.Module:
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64)
    return TokensToTensor(transformers.LlamaForCausalLM(cfg), cache_flag=True)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "gpt2": _gpt2, "bert": _bert, "distilbert": _distilbert, "roberta": _roberta, "t5-encoder": _t5_encoder,
    "llama-gqa": _llama,
}
# (batch, tokens): the example shape first, then other shapes of the same model: another batch
# (padded up to its bucket: the rows are provably independent), then other lengths (plans of their own)
SHAPES = [(2, 9), (3, 9), (1, 1), (3, 16)]


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def _ids(batch: int, tokens: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = float((out - ref).abs().max()) / max(float(ref.abs().max()), 1e-6)
    assert err <= 1e-4, f"relative error {err:.2e}"


@pytest.mark.parametrize("name", list(MODELS))
def test_streamfuse_compile_matches_eager_at_several_shapes(name: str, config: Any) -> None:
    model = _model(name)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (_ids(*SHAPES[0], seed=0),), config)
        assert isinstance(compiled, streamfuse.CompiledGraph)
        assert compiled.stats["generated_kernels"] > 0
        assert compiled.batch_reason is None, compiled.batch_reason  # the batch pads to a bucket
        for k, shape in enumerate(SHAPES):
            ids = _ids(*shape, seed=k + 1)
            _close(compiled(ids), model(ids))
    assert compiled.stats["specializations"] == 2  # the two other lengths; batch 3 was padded to 4


@pytest.mark.parametrize("name", list(MODELS))
def test_backend_matches_eager_at_several_shapes(name: str, config: Any) -> None:
    model = _model(name)
    torch._dynamo.reset()
    fast = torch.compile(model, backend=streamfuse.make_backend(config))
    with torch.no_grad():
        for k, shape in enumerate(SHAPES):
            ids = _ids(*shape, seed=k + 1)
            _close(fast(ids), model(ids))
    compiled = backend_module.compiled_graphs[-1]
    # after the second shape Dynamo hands over symbolic sizes: one plan per concrete shape under it
    assert isinstance(compiled, backend_module.SymbolicGraph)
    assert compiled.built >= 1
    assert not any(isinstance(p, backend_module.EagerGraph) for p in compiled.plans.values())


def test_symbolic_plans_are_chosen_by_the_symbolic_arguments_alone(config: Any) -> None:
    """Once a second shape makes Dynamo's graph symbolic, a call picks its plan by the arguments
    whose sizes can change (and the SymInts), not by every parameter's shape: the key of each plan
    holds a few entries where the graph takes dozens of tensors, and each shape still gets its own
    plan with eager's results."""
    model = _model("bert")
    torch._dynamo.reset()
    first = len(backend_module.compiled_graphs)
    fast = torch.compile(model, backend=streamfuse.make_backend(config.replace(executor="reference")))
    with torch.no_grad():
        for k, shape in enumerate([(2, 5), (3, 7), (2, 6), (3, 7)]):
            ids = _ids(*shape, seed=k)
            _close(fast(ids), model(ids))
    symbolic = [g for g in backend_module.compiled_graphs[first:] if isinstance(g, backend_module.SymbolicGraph)]
    assert symbolic, "no graph with symbolic sizes"
    graph = symbolic[-1]
    tensors = sum(1 for n in graph.gm.graph.nodes if n.op == "placeholder"
                  and isinstance(n.meta.get("val"), torch.Tensor))
    assert len(graph.plans) == 2 and graph.built == 2  # (2, 5) ran the static graph of the first call
    for key in graph.plans:
        assert 1 <= len(key) <= 4 < tensors, (len(key), tensors)


def test_backend_compiles_under_fake_tensor_mode(config: Any) -> None:
    """Nothing reads tensor data at compile time: the backend's compiler, handed fake example inputs
    inside a FakeTensorMode (as AOTAutograd does), builds a plan with a matmul template (its split-K
    scratch is allocated once, at build) that then runs on real tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    torch.manual_seed(0)
    w, b = torch.randn(64, 256), torch.randn(64)

    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.nn.functional.gelu(torch.addmm(b, x, w.t())),)

    x = torch.randn(2, 256)
    gm = make_fx(f)(x, w, b)
    compiler = backend_module._compiler(config.replace(matmul_strategy="triton"))
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in (x, w, b)]
        run = compiler(gm, fakes)
    compiled = backend_module.compiled_graphs[-1]
    assert isinstance(compiled, streamfuse.CompiledGraph)
    assert any(g.kind.value == "matmul" for g in compiled.plan.groups)
    (out,) = run([x, w, b])
    torch.testing.assert_close(out, f(x, w, b)[0], rtol=1e-4, atol=1e-4)


class _DataDependentShape(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x)) * 2 + 1
        return h[h > 1].sum() * torch.ones(3, device=x.device) + h.mean()  # a data-dependent shape: no one graph holds it


def _through_backend(model: nn.Module, x: torch.Tensor, config: Any) -> Any:
    """streamfuse.compile of a model it cannot capture whole: a BackendFallback, with its warning."""
    torch._dynamo.reset()
    with pytest.warns(streamfuse.StreamfuseFallbackWarning, match="could not be captured as one graph"):
        compiled = streamfuse.compile(model, (x,), config)
    assert isinstance(compiled, streamfuse.BackendFallback)
    return compiled


class _DataDependentBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.sum() > 0:  # a branch on a tensor's value (FakeQuantize's observer flag): torch.export stops here
            h = h * 2
        return h.relu()


def test_a_failed_capture_prints_no_partial_graph(config: Any, device: torch.device,
                                                  capfd: pytest.CaptureFixture[str]) -> None:
    """torch.export prints the partial graph of a trace it gave up on (twice) to stderr before raising;
    streamfuse.compile drops that print and says why in its one warning, and the model still matches
    eager on inputs that take either branch."""
    torch.manual_seed(0)
    model = _DataDependentBranch().eval().to(device)
    capfd.readouterr()
    compiled = _through_backend(model, torch.randn(4, 16, device=device), config)
    assert "def forward" not in capfd.readouterr().err
    base, taken = torch.randn(4, 16, device=device) * 100, set()
    with torch.no_grad():
        for x in (base, -base):  # the weights' term outweighs the bias: the two take different branches
            taken.add(bool(model.lin(x).sum() > 0))
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-3)
    assert taken == {True, False}


def test_a_model_that_cannot_be_captured_whole_runs_through_the_backend(config: Any, device: torch.device) -> None:
    """A model torch.export cannot capture as one graph goes through torch.compile(backend=
    "streamfuse") instead, with one warning naming the reason: Dynamo splits it at the data-dependent
    shape and the backend compiles the pieces."""
    torch.manual_seed(0)
    model = _DataDependentShape().eval().to(device)
    compiled = _through_backend(model, torch.randn(4, 16, device=device), config)
    with torch.no_grad():
        for batch in (4, 3):
            y = torch.randn(batch, 16, device=device)
            torch.testing.assert_close(compiled(y), model(y), rtol=1e-5, atol=1e-5)
    assert compiled.eager_reason is None and compiled.stats["graphs"] >= 1 and compiled.stats["kernels"]
    assert "capture or planning failed" in compiled.explain() and "graph(s) compiled" in compiled.explain()
    torch._dynamo.reset()


def test_where_the_backend_fails_too_the_model_runs_eagerly(config: Any, monkeypatch: pytest.MonkeyPatch,
                                                            device: torch.device) -> None:
    """The backend failing as well sends the model to eager for good, with a second warning; a bad
    input still raises eager's own error."""
    import streamfuse.capture.backend as backend_module

    def broken(config: Any = None) -> Any:
        def backend(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
            raise RuntimeError("planning exploded")
        return backend

    monkeypatch.setattr(backend_module, "make_backend", broken)
    model = _DataDependentShape().eval().to(device)
    x = torch.randn(4, 16, device=device)
    compiled = _through_backend(model, x, config)
    with torch.no_grad():
        with pytest.warns(streamfuse.StreamfuseFallbackWarning, match="runs eagerly: .*failed too"):
            torch.testing.assert_close(compiled(x), model(x))
        assert compiled.eager_reason is not None and "planning exploded" in compiled.eager_reason
        torch.testing.assert_close(compiled(x), model(x))
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            compiled(torch.randn(4, 9, device=device))
    assert compiled.stats["kernels"] is None and "runs eagerly" in compiled.explain()
    torch._dynamo.reset()


def test_an_output_torch_export_cannot_flatten_goes_through_the_backend(config: Any, device: torch.device) -> None:
    """A model returning an object pytree cannot flatten (Mamba's cache in transformers 5) is not
    captured whole; through the backend it compiles, and the object comes back as eager's."""

    class State:
        def __init__(self, h: torch.Tensor):
            self.h = h

    class WithState(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, State]:
            h = torch.relu(self.lin(x))
            return h * 2, State(h.sum(-1))

    torch.manual_seed(0)
    model = WithState().eval().to(device)
    x = torch.randn(2, 8, device=device)
    compiled = _through_backend(model, x, config)
    with torch.no_grad():
        out, state = compiled(x)
        ref, ref_state = model(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert isinstance(state, State)
    torch.testing.assert_close(state.h, ref_state.h, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_mamba_goes_through_the_backend_and_matches_eager(config: Any, device: torch.device) -> None:
    """Hugging Face Mamba returns its cache as an object torch.export cannot flatten: streamfuse.compile
    sends it through the backend (one warning), whose graphs match eager's logits at two shapes."""
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=VOCAB, state_size=8)
    model = transformers.MambaForCausalLM(cfg).eval().to(device)
    ids = _ids(2, 12, seed=1).to(device)
    torch._dynamo.reset()
    with torch.no_grad():
        with pytest.warns(streamfuse.StreamfuseFallbackWarning, match="could not be captured as one graph"):
            compiled = streamfuse.compile(model, {"input_ids": ids}, config)
        assert isinstance(compiled, streamfuse.BackendFallback)
        for batch, tokens in ((2, 12), (3, 7)):
            x = _ids(batch, tokens, seed=batch).to(device)
            _close(compiled(input_ids=x).logits, model(input_ids=x).logits)
    assert compiled.eager_reason is None and compiled.stats["kernels"]
    torch._dynamo.reset()


def test_a_causal_lm_compiles_with_its_cache_among_the_outputs(config: Any) -> None:
    """transformers' causal LMs return a DynamicCache (past_key_values) by default: its keys and values
    become graph outputs (transformers' own pytree support for torch.export) and the call returns a
    DynamicCache again, equal to eager's, at the example batch and another; with the cache turned
    off the model compiles too. Afterwards the backend still generates eager's tokens with a growing
    DynamicCache (the registration is global)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64)).eval()
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, dtype=torch.long)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (ids, mask), config)
        assert isinstance(compiled, streamfuse.CompiledGraph)
        for batch in (2, 3):
            ids_b = torch.randint(1, 128, (batch, 8), generator=torch.Generator().manual_seed(batch))
            mask_b = torch.ones(batch, 8, dtype=torch.long)
            mask_b[0, :2] = 0  # left padding
            out, ref = compiled(ids_b, mask_b), model(ids_b, mask_b)
            _close(out.logits, ref.logits)
            assert type(out.past_key_values) is type(ref.past_key_values)
            assert len(out.past_key_values.layers) == len(ref.past_key_values.layers) == 2
            for got, want in zip(out.past_key_values.layers, ref.past_key_values.layers, strict=True):
                _close(got.keys, want.keys)
                _close(got.values, want.values)
        model.config.use_cache = False
        plain = streamfuse.compile(model, (ids, mask), config)
        assert isinstance(plain, streamfuse.CompiledGraph)
        _close(plain(ids, mask).logits, model(ids, mask).logits)
        model.config.use_cache = True
        kwargs: dict[str, Any] = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, attention_mask=mask)
        want_tokens = model.generate(ids, **kwargs)
        torch._dynamo.reset()
        forward = model.forward
        model.forward = torch.compile(forward, backend=streamfuse.make_backend(config))
        try:
            got_tokens = model.generate(ids, **kwargs)
        finally:
            model.forward = forward
            torch._dynamo.reset()
    assert torch.equal(got_tokens, want_tokens)


def test_a_seq2seq_model_compiles_with_its_encoder_decoder_cache(config: Any) -> None:
    """T5ForConditionalGeneration returns an EncoderDecoderCache (self- and cross-attention
    DynamicCaches): both come back from the compiled call, equal to eager's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=1, d_model=32, d_kv=8, num_heads=4, d_ff=64, vocab_size=VOCAB)).eval()
    ids, labels = _ids(2, 7, seed=5), _ids(2, 5, seed=6)
    with torch.no_grad():
        compiled = streamfuse.compile(lambda a, b: model(input_ids=a, decoder_input_ids=b), (ids, labels), config)
        assert isinstance(compiled, streamfuse.CompiledGraph)
        out, ref = compiled(ids, labels), model(input_ids=ids, decoder_input_ids=labels)
    _close(out.logits, ref.logits)
    assert type(out.past_key_values) is type(ref.past_key_values)
    for part in ("self_attention_cache", "cross_attention_cache"):
        for got, want in zip(getattr(out.past_key_values, part).layers, getattr(ref.past_key_values, part).layers,
                             strict=True):
            _close(got.keys, want.keys)
            _close(got.values, want.values)


def test_backend_binds_parameters_of_inference_graphs(config: Any) -> None:
    """Config.backend_cuda_graphs: an inference graph binds its parameters as constants at its first
    call (on CUDA its CUDA graphs then copy in only the token ids); a replaced parameter takes the
    plan over every argument, so results stay eager's."""
    model = _model("gpt2")
    torch._dynamo.reset()
    fast = torch.compile(model, backend=streamfuse.make_backend(config.replace(backend_cuda_graphs=True)))
    ids = _ids(2, 9, seed=1)
    with torch.no_grad():
        _close(fast(ids), model(ids))
        graph = backend_module.compiled_graphs[-1]
        assert isinstance(graph, backend_module.StaticParamsGraph)
        assert graph.compiled is not None and len(graph.static) > 10
        assert len(graph.compiled.graph.inputs) == 1  # the token ids alone
        _close(fast(_ids(2, 9, seed=2)), model(_ids(2, 9, seed=2)))
        model.model.lm_head.weight = nn.Parameter(torch.randn_like(model.model.lm_head.weight))  # untied, new
        _close(fast(ids), model(ids))


@pytest.mark.parametrize(("name", "cache"), [("gpt2", None), ("llama-gqa", "static")])
def test_greedy_generation_through_the_backend_gives_eager_tokens(name: str, cache: str | None, config: Any) -> None:
    """Hugging Face generate() (greedy, KV cache) with the model's forward compiled by the backend:
    the same tokens as eager. GPT-2's growing cache hands the backend symbolic lengths (one plan per
    length seen, within Config.max_specializations); Llama's static cache keeps two graphs (prefill
    and one-token decode) whose parameters are bound at their first call."""
    hf = _model(name).model
    ids = _ids(2, 5, seed=4)
    kwargs: dict[str, Any] = dict(max_new_tokens=6, do_sample=False, pad_token_id=0,
                                  attention_mask=torch.ones_like(ids))
    if cache is not None:
        kwargs["cache_implementation"] = cache
    with torch.no_grad():
        ref = hf.generate(ids, **kwargs)
    torch._dynamo.reset()
    first = len(backend_module.compiled_graphs)
    forward = hf.forward
    hf.forward = torch.compile(forward, backend=streamfuse.make_backend(config))
    try:
        with torch.no_grad():
            out = hf.generate(ids, **kwargs)
        graphs = backend_module.compiled_graphs[first:]  # held weakly: read before the reset frees them
    finally:
        hf.forward = forward
        torch._dynamo.reset()
    assert out.shape == (2, 11) and torch.equal(out, ref)
    assert graphs and not any(isinstance(g, backend_module.EagerGraph) for g in graphs)
    if cache == "static":
        assert len(graphs) == 2 and all(isinstance(g, backend_module.StaticParamsGraph) for g in graphs)


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama-gqa"])
def test_random_batches_and_lengths_through_both_entry_points(name: str, config: Any) -> None:
    """Issue 17's shape check on small configs: random (batch, length) pairs, batch 1-64 and length
    1-64 (the configs' position limit), through streamfuse.compile and the backend; each matches
    eager, and the plans kept stay within Config.max_specializations (4 here: the cache evicts). The
    reference executor runs the plans (the interpreter at batch 64 takes minutes; other tests run the
    generated kernels of these models)."""
    gen = torch.Generator().manual_seed(17)
    pairs = [(int(torch.randint(1, 65, (), generator=gen)), int(torch.randint(1, 65, (), generator=gen)))
             for _ in range(8)]
    model = _model(name)
    bounded = config.replace(max_specializations=4, executor="reference")  # generated kernels: other tests
    torch._dynamo.reset()
    fast = torch.compile(model, backend=streamfuse.make_backend(bounded))
    with torch.no_grad():
        compiled = streamfuse.compile(model, (_ids(*pairs[0], seed=0),), bounded)
        assert isinstance(compiled, streamfuse.CompiledGraph)
        for k, shape in enumerate(pairs):
            ids = _ids(*shape, seed=k)
            ref = model(ids)
            _close(compiled(ids), ref)
            _close(fast(ids), ref)
    stats = compiled.stats
    assert stats["specializations"] <= 4 and 1 <= stats["specializations_built"] <= len(pairs)
    symbolic = [g for g in backend_module.compiled_graphs if isinstance(g, backend_module.SymbolicGraph)]
    assert symbolic and len(symbolic[-1].plans) <= 4


def test_compiles_per_model_are_bounded(config: Any) -> None:
    """Past Config.max_specializations_built compiles, a new shape runs eagerly (one warning) on
    both entry points, while the plans kept still serve their shapes."""
    model = _model("bert")
    bounded = config.replace(max_specializations=2, max_specializations_built=2, executor="reference")
    lengths = [4, 5, 6, 7, 5]
    torch._dynamo.reset()
    fast = torch.compile(model, backend=streamfuse.make_backend(bounded))
    with torch.no_grad(), pytest.warns(streamfuse.StreamfuseFallbackWarning, match="max_specializations_built"):
        compiled = streamfuse.compile(model, (_ids(2, 3, seed=0),), bounded)
        for k, tokens in enumerate(lengths):
            ids = _ids(2, tokens, seed=k)
            ref = model(ids)
            _close(compiled(ids), ref)
            _close(fast(ids), ref)
    assert compiled.stats["specializations_built"] == 2 and compiled.specialization_overflow
    assert "max_specializations_built" in compiled.explain(source=False)
    symbolic = [g for g in backend_module.compiled_graphs if isinstance(g, backend_module.SymbolicGraph)][-1]
    assert symbolic.built == 2 and symbolic.overflow is not None


class _VideoBlock(nn.Module):
    """A video classifier's layers over 5-D tensors (torchvision's r3d_18 and mc3_18 in small): Conv3d,
    BatchNorm3d, ReLU, MaxPool3d, a residual add, adaptive 3-D average pooling and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(3, 8, (3, 5, 5), padding=(1, 2, 2), bias=False), nn.BatchNorm3d(8),
                                  nn.ReLU(), nn.MaxPool3d((1, 2, 2)))
        self.conv = nn.Sequential(nn.Conv3d(8, 8, 3, padding=1, bias=False), nn.BatchNorm3d(8), nn.ReLU(),
                                  nn.Conv3d(8, 8, 3, padding=1, bias=False), nn.BatchNorm3d(8))
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        y = torch.relu(y + self.conv(y))
        return self.head(nn.functional.adaptive_avg_pool3d(y, 1).flatten(1))


def test_a_video_network_over_5d_tensors_through_both_entry_points(config: Any, device: torch.device) -> None:
    torch.manual_seed(0)
    model = _VideoBlock().to(device).eval()
    with torch.no_grad():  # batch-norm statistics that are not 0 and 1
        for bn in (m for m in model.modules() if isinstance(m, nn.BatchNorm3d)):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
    clips = [torch.randn(b, 3, 4, 12, 12, generator=torch.Generator().manual_seed(b)).to(device) for b in (2, 3)]
    torch._dynamo.reset()
    fast = torch.compile(model, backend=streamfuse.make_backend(config))
    with torch.no_grad():
        compiled = streamfuse.compile(model, (clips[0],), config)
        assert compiled.stats["generated_kernels"] > 0
        for clip in clips:
            want = model(clip)
            _close(compiled(clip), want)
            _close(fast(clip), want)
    # training through the backend: batch statistics, gradients of every parameter
    train = _VideoBlock().double().to(device).train()
    train.load_state_dict(model.state_dict())
    ref = _VideoBlock().double().to(device).train()
    ref.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    fast = torch.compile(train, backend=streamfuse.make_backend(config))
    clip = clips[1].double()
    fast(clip).square().mean().backward()
    ref(clip).square().mean().backward()
    for (name, p), q in zip(train.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
    for (name, b), c in zip(train.named_buffers(), ref.buffers(), strict=True):
        torch.testing.assert_close(b, c, rtol=1e-9, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


def test_an_exported_program_compiles_as_its_module(config: Any, device: torch.device) -> None:
    """`streamfuse.compile(torch.export.export(model, args), args)`: an ExportedProgram cannot be
    called itself (torch raises), so it compiles as `exported.module()`, whose shape guards stay
    (an exported static batch accepts that batch only, as eagerly)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(512, 5))
    model = model.eval().to(device)
    x = torch.randn(2, 3, 10, 10, device=device)
    exported = torch.export.export(model, (x,))
    compiled = streamfuse.compile(exported, (x,), config)
    assert isinstance(compiled, streamfuse.CompiledGraph), compiled
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 3, 10, 10, device=device)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_torchscript_model_is_refused_by_name(config: Any) -> None:
    """TorchScript cannot be captured (torch.compile raises on a scripted module; a traced one went
    through the backend, ran its TorchScript whole and warned about an `OrderedDictWrapper`)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU()).eval()
    x = torch.randn(3, 4)
    for scripted in (torch.jit.script(model), torch.jit.trace(model, x)):
        with pytest.raises(ValueError, match="model is a TorchScript .*pass the original nn.Module"):
            streamfuse.compile(scripted, (x,), config)


def test_shapes_among_the_outputs_stay_torch_sizes(config: Any) -> None:
    """pytree flattens a torch.Size to its ints and rebuilds a plain tuple; the compiled model returns
    the torch.Size the model returned (at every batch: the ints are the plan's outputs)."""
    lin = nn.Linear(4, 4).eval()

    def shaped(x: torch.Tensor) -> dict[str, Any]:
        y = lin(x)
        return {"y": y, "shape": y.shape, "nested": [(y.sum(), x.shape)]}

    compiled = streamfuse.compile(shaped, (torch.randn(2, 4),), config)
    with torch.no_grad():
        for batch in (2, 5):
            x = torch.randn(batch, 4)
            got, want = compiled(x), shaped(x)
            assert type(got["shape"]) is torch.Size and got["shape"] == want["shape"]
            assert type(got["nested"][0][1]) is torch.Size and got["nested"][0][1] == (batch, 4)
            torch.testing.assert_close(got["y"], want["y"])
