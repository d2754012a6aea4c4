"""Session 45 probes (docs/bench/s45-mm.txt, s45-mm2.txt): how products with an epilogue are decided
and what each decision costs, per model at the given batch (float32 with TF32 unless --dtype), the
plans timed in turns (CUDA events, calls back to back):

    before   a measured template kept wherever it times faster than cuBLAS + the modelled epilogue
             kernel (matmul_template_margin 1.0: the rule before session 45)
    default  the defaults: a measured template of 20 µs or more must be 1.15x faster
    cublas   every product through cuBLAS (Config.matmul_strategy="cublas")

(Run 171 also had "absorbed", which charged no epilogue kernel where after cuBLAS the epilogue joins
a kernel that runs anyway, and "margin", that with the margin on every product; neither was kept.)

then each plan's product decisions and what the autotuner measured (its cache: cuBLAS alone and the
template's tiles, µs). `--linear` adds bf16 Linear(4096->4096) + bias + GELU at batch 8, 512, 4096."""
import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, "src")
import streamfuse
from streamfuse.bench.models import model_workloads
from streamfuse.bench.runner import rel_error
from streamfuse.profile.timing import time_cuda_us
from streamfuse.tune.autotune import load_cache

ap = argparse.ArgumentParser()
ap.add_argument("models", nargs="?", default="bert-base,distilbert,gpt2")
ap.add_argument("--batch", default="throughput")
ap.add_argument("--dtype", default="float32")
ap.add_argument("--plans", default="before,default,cublas")
ap.add_argument("--linear", action="store_true")
args = ap.parse_args()
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
dev = torch.device("cuda")
print(torch.cuda.get_device_name(), torch.__version__, flush=True)


def build(plan: str, fn, inputs, cache: Path):
    config = streamfuse.Config(cache_dir=cache)
    if plan == "before":
        config = config.replace(matmul_template_margin=1.0)
    if plan == "cublas":
        config = config.replace(matmul_strategy="cublas")
    return streamfuse.compile(fn, inputs, config)


def compare(name: str, fn, inputs, plans: list[str]) -> None:
    cache = Path(tempfile.mkdtemp())
    with torch.no_grad():
        ref = fn(*inputs)
        built = {p: build(p, fn, inputs, cache) for p in plans}
        print(f"== {name}", flush=True)
        for p, c in built.items():
            out = c(*inputs)
            err = rel_error(out, ref, floor=0.0)
            lines = [line.strip() for line in c.explain(source=False).splitlines()
                     if "runs through cuBLAS (" in line and "[aten]" in line or line.lstrip().startswith("k")
                     and "[matmul]" in line]
            kinds = {}
            for line in lines:
                why = line.split("(", 2)[-1][:150] if "[aten]" in line else "template " + line.split("]", 1)[-1][:80]
                kinds[why] = kinds.get(why, 0) + 1
            print(f"  {p}: rel err {err:.1e}; products: " + "; ".join(f"{v}x {k}" for k, v in kinds.items()))
        times = {p: [] for p in plans}
        for _ in range(3):
            for p, c in built.items():
                times[p].append(time_cuda_us(lambda c=c: c(*inputs)))
        base = statistics.median(times["before"]) if "before" in times else None
        print("  µs per call (median of 3 rounds; rounds): " + ", ".join(
            f"{p} {statistics.median(t):.1f}" + (f" ({base / statistics.median(t):.3f}x)" if base else "")
            + " [" + " ".join(f"{x:.1f}" for x in t) + "]" for p, t in times.items()), flush=True)
    for key, value in sorted(load_cache(cache).items()):
        if "|aten|" in key:
            print(f"  cuBLAS alone {value.get('us'):.1f} µs  {key.split('|aten|')[1][:150]}")
        elif "sf_mm" in key:
            print(f"  template {key.split('|')[1]}: best {value.get('us'):.1f} µs tile {value.get('tile')} "
                  f"problem {value.get('problem')}")


plans = args.plans.split(",")
unknown = set(plans) - {"before", "default", "cublas"}
if unknown:
    ap.error(f"--plans: unknown plan(s) {sorted(unknown)}; expected before, default or cublas")
for w in model_workloads(args.models, args.batch, args.dtype):
    model, inputs = w.make(dev)
    compare(w.name, model, inputs, plans)
    del model
    torch.cuda.empty_cache()
if args.linear:
    lin = torch.nn.Linear(4096, 4096).to(dev, torch.bfloat16)
    for batch in (8, 512, 4096):
        x = torch.randn(batch, 4096, device=dev, dtype=torch.bfloat16)
        compare(f"Linear 4096->4096 + GELU bf16 b{batch}", lambda t: F.gelu(lin(t)), (x,), plans)
