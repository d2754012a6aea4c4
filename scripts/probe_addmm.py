"""Probe (session 23, to go once its finding is in docs/PERF.md): Config.addmm_bias="auto"'s timings of
cuBLAS addmm against mm for each Linear shape of gpt2 prefill and bert-base at 8x128 and convnext_tiny
and vit_b_16 at batch 1, with TF32 allowed as the suite times them, and what it decided."""

import sys
import tempfile
from pathlib import Path

import torch

import streamfuse
from streamfuse.bench import models as bm
from streamfuse.tune.autotune import load_cache

torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
wanted = sys.argv[1:] or ["gpt2 prefill:8", "bert-base:8", "convnext_tiny:1", "vit_b_16:1"]
for name, batch in ((w.split(":")[0], int(w.split(":")[1])) for w in wanted):
    spec = [s for s in bm.MODELS if s.name == name][0]
    torch.manual_seed(0)
    model = spec.build(False).eval().cuda()
    x = bm.make_inputs(spec, model, batch, False, torch.device("cuda"), torch.float32, 0)
    cache = Path(tempfile.mkdtemp())
    with torch.no_grad():
        compiled = streamfuse.compile(model, x, streamfuse.Config(cache_dir=cache))
    ops = [n.op for n in compiled.base.graph.nodes]
    print(f"{name} b{batch}: {ops.count('aten.mm.default')} mm, {ops.count('aten.addmm.default')} addmm in the plan",
          flush=True)
    for key, v in load_cache(cache).items():
        if "|addmm-split|" in key:
            shapes = key.split("|addmm-split|")[1]
            print(f"  {shapes}: addmm {v['addmm_us']:.1f} µs, mm {v['mm_us']:.1f} µs ({v['addmm_us'] / v['mm_us']:.2f}x)",
                  flush=True)
