"""The `models` suite of `streamfuse bench`: models a user would bring, from random weights.

torchvision classifiers and Hugging Face transformers built from configs (never downloaded:
no `from_pretrained`, no `weights=`), each at batch 1 and at a throughput batch, in float32 and
bfloat16. Hugging Face models are wrapped so that forward(input_ids) returns one tensor (logits or
last_hidden_state; `use_cache=False` where the model takes it; no attention mask), which both
entry points, streamfuse.compile and torch.compile(backend="streamfuse"), see as a plain tensor
function. `tiny=True` (the default without a GPU) swaps the transformers' configs for one-layer
ones of hidden size 32-64 and shortens the sequences, so the suite runs in Triton's interpreter.

Tolerances (relative error = max|out - ref| / max|ref|, worst over outputs; runner.rel_error):
float32 1e-4 with TF32 off while checking (runner.exact_fp32), bfloat16/float16 2e-2.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from streamfuse.bench.workloads import Workload

MODEL_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
BATCHES = ("1", "throughput")
SECOND_BATCH = 3
"""Batch of the extra correctness check of the streamfuse modes (a size no workload is compiled at)."""


class TextModel(nn.Module):
    """A Hugging Face model as a tensor function: forward(input_ids) -> logits or last_hidden_state."""

    def __init__(self, model: nn.Module, output: str):
        super().__init__()
        self.model, self.output = model, output
        self.vocab_size = int(model.config.vocab_size)  # type: ignore[union-attr]
        params = inspect.signature(model.forward).parameters
        self.kwargs = {"use_cache": False} if "use_cache" in params else {}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return getattr(self.model(input_ids=input_ids, **self.kwargs), self.output)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    kind: Literal["vision", "text"]
    build: Callable[[bool], nn.Module]
    """tiny -> the model (random weights; the caller seeds and places it)."""
    size: int = 224
    """Vision: image height and width. Text: tokens per row (1 for one decode step)."""
    tiny_size: int | None = None
    """The size with tiny=True (default: `size` for vision, 16 tokens for text)."""

    def input_size(self, tiny: bool) -> int:
        if not tiny:
            return self.size
        if self.tiny_size is not None:
            return self.tiny_size
        return self.size if self.kind == "vision" else min(self.size, 16)


def throughput_batch(spec: ModelSpec, tiny: bool) -> int:
    """32 images or 8 sequences; 4 and 2 of them with tiny=True (the interpreter is slow)."""
    if spec.kind == "vision":
        return 2 if tiny else 32
    return 4 if tiny else 8


# --- torchvision -------------------------------------------------------------------------------

def _vision(name: str, **kwargs: Any) -> Callable[[bool], nn.Module]:
    def build(tiny: bool) -> nn.Module:
        import torchvision  # absent on some machines: the workload then reports "workload unavailable"

        return getattr(torchvision.models, name)(weights=None, **kwargs)

    return build


def _vit(tiny: bool) -> nn.Module:
    import torchvision

    return torchvision.models.vit_b_16(weights=None, image_size=64 if tiny else 224)


VISION = [
    ModelSpec("resnet50", "vision", _vision("resnet50"), tiny_size=64),
    ModelSpec("googlenet", "vision", _vision("googlenet", aux_logits=False, init_weights=False), tiny_size=64),
    ModelSpec("inception_v3", "vision", _vision("inception_v3", aux_logits=False, init_weights=False), 299,
              tiny_size=96),
    ModelSpec("mobilenet_v2", "vision", _vision("mobilenet_v2"), tiny_size=64),
    ModelSpec("mobilenet_v3_small", "vision", _vision("mobilenet_v3_small"), tiny_size=64),
    ModelSpec("mobilenet_v3_large", "vision", _vision("mobilenet_v3_large"), tiny_size=64),
    ModelSpec("efficientnet_b0", "vision", _vision("efficientnet_b0"), tiny_size=64),
    ModelSpec("squeezenet1_1", "vision", _vision("squeezenet1_1"), tiny_size=64),
    ModelSpec("densenet121", "vision", _vision("densenet121"), tiny_size=64),
    ModelSpec("shufflenet_v2_x1_0", "vision", _vision("shufflenet_v2_x1_0"), tiny_size=64),
    ModelSpec("regnet_y_400mf", "vision", _vision("regnet_y_400mf"), tiny_size=64),
    ModelSpec("convnext_tiny", "vision", _vision("convnext_tiny"), tiny_size=64),
    ModelSpec("vit_b_16", "vision", _vit, tiny_size=64),
    ModelSpec("swin_t", "vision", _vision("swin_t"), tiny_size=64),
]


# --- Hugging Face transformers, from configs ---------------------------------------------------

def _gpt2(tiny: bool) -> nn.Module:
    import transformers

    # gpt2 (124M): the config's defaults are the released model's sizes
    config = (transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=256, n_positions=64,
                                      bos_token_id=0, eos_token_id=0)
              if tiny else transformers.GPT2Config())
    return TextModel(transformers.GPT2LMHeadModel(config), "logits")


def _bert(tiny: bool) -> nn.Module:
    import transformers

    config = (transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64, vocab_size=256, max_position_embeddings=64)
              if tiny else transformers.BertConfig())  # defaults: bert-base-uncased
    return TextModel(transformers.BertModel(config, add_pooling_layer=False), "last_hidden_state")


def _distilbert(tiny: bool) -> nn.Module:
    import transformers

    config = (transformers.DistilBertConfig(dim=32, n_layers=1, n_heads=2, hidden_dim=64, vocab_size=256,
                                            max_position_embeddings=64)
              if tiny else transformers.DistilBertConfig())  # defaults: distilbert-base-uncased
    return TextModel(transformers.DistilBertModel(config), "last_hidden_state")


def _roberta(tiny: bool) -> nn.Module:
    import transformers

    sizes: dict[str, Any] = (dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=256, max_position_embeddings=66)
                             if tiny else dict(vocab_size=50265, max_position_embeddings=514))  # roberta-base
    config = transformers.RobertaConfig(type_vocab_size=1, layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0,
                                        eos_token_id=2, **sizes)
    return TextModel(transformers.RobertaModel(config, add_pooling_layer=False), "last_hidden_state")


def _t5_encoder(tiny: bool) -> nn.Module:
    import transformers

    sizes: dict[str, Any] = (dict(d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2, vocab_size=256,
                                  relative_attention_num_buckets=8, relative_attention_max_distance=16)
                             if tiny else dict(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8,
                                               vocab_size=32128))  # t5-small
    config = transformers.T5Config(feed_forward_proj="relu", is_encoder_decoder=False, use_cache=False, **sizes)
    return TextModel(transformers.T5EncoderModel(config), "last_hidden_state")


def _llama(tiny: bool) -> nn.Module:
    import transformers

    # a ~0.85B Llama: grouped-query attention (32 query heads share 8 key/value heads); RoPE, RMSNorm
    # and SwiGLU come with LlamaConfig
    sizes: dict[str, Any] = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
                             if tiny else dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                                               num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                               max_position_embeddings=2048))
    config = transformers.LlamaConfig(bos_token_id=0, eos_token_id=0, pad_token_id=None, **sizes)
    return TextModel(transformers.LlamaForCausalLM(config), "logits")


TEXT = [
    ModelSpec("gpt2 decode", "text", _gpt2, 1, tiny_size=1),
    ModelSpec("gpt2 prefill", "text", _gpt2, 128),
    ModelSpec("bert-base", "text", _bert, 128),
    ModelSpec("distilbert", "text", _distilbert, 128),
    ModelSpec("roberta-base", "text", _roberta, 128),
    ModelSpec("t5-small encoder", "text", _t5_encoder, 128),
    ModelSpec("llama gqa", "text", _llama, 128),
]

MODELS: list[ModelSpec] = VISION + TEXT


# --- workloads ---------------------------------------------------------------------------------

def make_inputs(spec: ModelSpec, model: nn.Module, batch: int, tiny: bool, device: torch.device,
                dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """Random images in `dtype`, or random token ids (int64) below the model's vocabulary size."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    size = spec.input_size(tiny)
    if spec.kind == "vision":
        return (torch.randn(batch, 3, size, size, generator=gen).to(device, dtype),)
    vocab = int(getattr(model, "vocab_size"))
    return (torch.randint(0, vocab, (batch, size), generator=gen).to(device),)


def nonzero_parameters(model: nn.Module, seed: int = 0, std: float = 0.02) -> nn.Module:
    """Parameters initialised to all zeros get small random values (normal, `std`), in place.

    torchvision's ViT starts its classifier head at zero (and timm's ResMLP likewise), so every
    output is exactly 0 whatever the layers before it compute: a comparison with eager would pass
    on any result, and every gradient but the head's would be 0. Values do not change the time."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.numel() and not bool(p.any()):
                # drawn on the CPU (the generator's device), whatever `torch.device` context the model is built in
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32, device="cpu").mul_(std))
    return model


def _maker(spec: ModelSpec, batch: int, dtype: torch.dtype, tiny: bool,
           ) -> Callable[[torch.device], tuple[Any, tuple[torch.Tensor, ...]]]:
    def make(device: torch.device) -> tuple[Any, tuple[torch.Tensor, ...]]:
        torch.manual_seed(0)
        with torch.device(device):  # initialised where it runs: a 0.85B Llama in seconds, not a minute
            model = nonzero_parameters(spec.build(tiny))
        model = model.eval().to(device, dtype)
        return model, make_inputs(spec, model, batch, tiny, device, dtype, seed=1)

    return make


def _second(spec: ModelSpec, dtype: torch.dtype, tiny: bool) -> Callable[[Any, torch.device], tuple[torch.Tensor, ...]]:
    def inputs(model: Any, device: torch.device) -> tuple[torch.Tensor, ...]:
        return make_inputs(spec, model, SECOND_BATCH, tiny, device, dtype, seed=2)

    return inputs


def workload_name(spec: ModelSpec, batch: int, dtype: torch.dtype, tiny: bool) -> str:
    shape = f"b{batch}" if spec.kind == "vision" else f"b{batch}x{spec.input_size(tiny)}"
    return f"{spec.name} {shape} {SHORT[dtype]}"


def _starts_a_word(prefix: str, name: str) -> bool:
    """`prefix` begins `name` or a word of it (after a space, "-" or "_")."""
    return any(name.startswith(prefix, i) for i in range(len(name)) if i == 0 or name[i - 1] in " -_")


def model_workloads(models: str | None = None, batch: str = "all", dtype: str = "all",
                    tiny: bool = False) -> list[Workload]:
    """The suite's workloads: model x batch (1, throughput) x dtype, filtered.

    models: comma-separated starts of model names or of a word in them (None: all): "mobilenet" is both
    MobileNets, "t5" the T5 encoder and not resnet50, "bert" bert-base and not distilbert; batch:
    "1", "throughput" or "all"; dtype: "float32", "bfloat16" or "all". A filter that matches nothing
    is a ValueError."""
    if batch not in (*BATCHES, "all"):
        raise ValueError(f"batch must be 1, throughput or all, got {batch!r}")
    if dtype not in (*DTYPE_NAMES, "all"):
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)} or all, got {dtype!r}")
    wanted = [w.strip().lower() for w in (models or "").split(",") if w.strip()]
    specs = [s for s in MODELS if not wanted or any(_starts_a_word(w, s.name.lower()) for w in wanted)]
    if not specs:
        raise ValueError(f"no model matches {models!r}; models: {', '.join(s.name for s in MODELS)}")
    dtypes = list(DTYPE_NAMES.values()) if dtype == "all" else [DTYPE_NAMES[dtype]]
    chosen: list[Workload] = []
    for spec in specs:
        for which in BATCHES if batch == "all" else (batch,):
            b = 1 if which == "1" else throughput_batch(spec, tiny)
            for dt in dtypes:
                info = {"model": spec.name, "family": "torchvision" if spec.kind == "vision" else "transformers",
                        "batch": b, "batch_kind": "batch 1" if which == "1" else "throughput",
                        "dtype": str(dt).removeprefix("torch."), "tiny": tiny,
                        ("resolution" if spec.kind == "vision" else "tokens"): spec.input_size(tiny)}
                chosen.append(Workload(workload_name(spec, b, dt, tiny), _maker(spec, b, dt, tiny), dt,
                                       suites=("models",), tolerance=MODEL_TOLERANCE[dt], rel_floor=0.0,
                                       second_inputs=_second(spec, dt, tiny), info=tuple(info.items())))
    return chosen
