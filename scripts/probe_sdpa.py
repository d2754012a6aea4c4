"""Probe (session 23, to go once its finding is in docs/PERF.md): which attention kernel SDPA can use
for bert-base at 8x128 on the GPU, in eager and while streamfuse.compile traces it (the GPU plan has
the math path's bmm/softmax where gpt2 prefill has efficient attention)."""

import warnings

import torch
import torch.nn.functional as F

import streamfuse
from streamfuse.bench import models as bm

original = F.scaled_dot_product_attention
seen: list[int] = []


def describe(t: object) -> object:
    if not isinstance(t, torch.Tensor):
        return t
    return (type(t).__name__, str(t.device), str(t.dtype), tuple(t.shape), tuple(t.stride()), t.requires_grad)


def probe(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # type: ignore[no-untyped-def]
    if not seen:
        seen.append(1)
        print("  inputs", [describe(x) for x in (q, k, v, attn_mask)], "dropout", dropout_p, "causal", is_causal,
              "scale", scale, "gqa", enable_gqa, "grad mode", torch.is_grad_enabled(), flush=True)
        for name in ("can_use_efficient_attention", "can_use_flash_attention", "can_use_cudnn_attention"):
            try:
                params = torch.backends.cuda.SDPAParams(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    ok = getattr(torch.backends.cuda, name)(params, True)
                print(f"  {name}: {ok}", [str(w.message)[:400] for w in caught], flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"  {name}: raised {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)


F.scaled_dot_product_attention = probe
for name in ("bert-base", "gpt2 prefill"):
    spec = [s for s in bm.MODELS if s.name == name][0]
    torch.manual_seed(0)
    model = spec.build(False).eval().cuda()
    x = bm.make_inputs(spec, model, 8, False, torch.device("cuda"), torch.float32, 0)
    with torch.no_grad():
        for label, run in (("eager", lambda: model(*x)), ("streamfuse.compile", lambda: streamfuse.compile(model, x))):
            seen.clear()
            print(f"{name}, {label}:", flush=True)
            run()
