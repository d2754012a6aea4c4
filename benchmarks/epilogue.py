"""Fusion-depth benchmark (issue 3), measured side by side in one run on a GPU.

    python benchmarks/epilogue.py [--out DIR]

1. bf16 Linear 4096->4096 + bias + GELU at batch 8, 512, 4096: cuBLAS GEMM alone (F.linear), eager
   GEMM + GELU, and streamfuse (auto strategy, and each strategy forced).
2. conv + batch-norm + ReLU (ResNet-like: 64 channels, 56x56, 3x3), batch 1 and 32, fp32 and bf16:
   eager against streamfuse (BN folded into the weights, and not folded).
3. 32 small independent pointwise ops: streamfuse's one packed launch against the same 32 kernels
   launched separately (horizontal fusion off), both replayed from CUDA graphs, and against eager.

Times are GPU time per call from CUDA-graph replay (no host overhead), median of many; errors are
the max abs difference from a float64 reference, next to eager's own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from foundation import rotating

import streamfuse
from streamfuse import Config
from streamfuse.fusion.groups import GroupKind
from streamfuse.profile.timing import time_cuda_us, time_graph_us


def max_err(out: Any, ref: torch.Tensor) -> float:
    outs = out if isinstance(out, (list, tuple)) else [out]
    return max(float((o.double() - r).abs().max()) for o, r in zip(outs, ref if isinstance(ref, list) else [ref],
                                                                       strict=True))


def kernel_table(fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...], calls: int = 20) -> list[str]:
    """The GPU kernels one call of `fn` launches, with their mean time over `calls` calls (torch's
    profiler, CUDA activity): where a fused plan's time goes beside eager's."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        fn(*inputs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn(*inputs)
            torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.count]
    rows.sort(key=lambda e: -e.device_time_total)
    return [f"{e.device_time_total / calls:8.1f} µs/call  x{e.count / calls:4.1f}  {e.key[:90]}" for e in rows[:8]]


def linear_gelu(config: Config, kernels: bool = False) -> list[dict[str, Any]]:
    rows = []
    dtype = torch.bfloat16
    lin = torch.nn.Linear(4096, 4096).to(device="cuda", dtype=dtype)
    w, b = lin.weight.detach(), lin.bias.detach()
    gemm = lambda x: F.linear(x, w, b)
    eager = lambda x: F.gelu(F.linear(x, w, b))
    for batch in (8, 512, 4096):
        sets = [(torch.randn(batch, 4096, device="cuda", dtype=dtype),) for _ in range(3)]
        fns: dict[str, Callable[..., Any]] = {"cuBLAS GEMM alone": gemm, "eager GEMM+GELU": eager}
        # reference point, not a streamfuse strategy: cuBLASLt's own bias+GELU epilogue, which is the
        # tanh approximation (so it is compared with eager's tanh GELU, not the exact one above)
        fns["ref: cuBLASLt bias+GELU(tanh) epilogue"] = lambda x: torch._addmm_activation(b, x, w.t(), use_gelu=True)
        fns["ref: eager GEMM+GELU(tanh)"] = lambda x: F.gelu(F.linear(x, w, b), approximate="tanh")
        plans = {}
        for label, strategy in (("streamfuse auto", "auto"), ("streamfuse triton", "triton"),
                                ("streamfuse cublas", "cublas")):
            sf = streamfuse.compile(eager, sets[0], config.replace(matmul_strategy=strategy))
            fns[label] = sf
            plans[label] = describe(sf)
        sf = streamfuse.compile(eager, sets[0], config.replace(profile_guided=True))
        fns["streamfuse profile-guided"], plans["streamfuse profile-guided"] = sf, describe(sf)
        ref = F.gelu(F.linear(sets[1][0].double(), w.double(), b.double()))
        with torch.no_grad():
            err = {m: max_err(f(*sets[1]), ref) for m, f in fns.items()}
            kernel = {m: time_graph_us(rotating(f, sets)) for m, f in fns.items()}
        gemm_us = kernel["cuBLAS GEMM alone"]
        if kernels:
            for m in ("cuBLAS GEMM alone", "eager GEMM+GELU", "streamfuse auto"):
                print(f"batch {batch}, {m}: kernels per call", *kernel_table(fns[m], sets[2]), sep="\n  ", flush=True)
        rows.append({"workload": f"Linear 4096->4096 + bias + GELU bf16, batch {batch}", "kernel_us": kernel,
                     "max_err": err, "plans": plans,
                     "auto_vs_gemm_alone": kernel["streamfuse auto"] / gemm_us,
                     "auto_vs_eager": kernel["eager GEMM+GELU"] / kernel["streamfuse auto"]})
    return rows


def describe(sf: Any) -> str:
    groups = [g for g in sf.plan.groups if g.kind is not GroupKind.ALIAS]
    text = " + ".join(g.kind.value for g in groups)
    for g in groups:
        if g.kind is GroupKind.MATMUL:
            c = sf.sources[g.id].constexprs
            src = sf.sources[g.id]
            text += (f" [tile {c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{src.num_warps} s{src.num_stages}"
                     f" split-K {c.get('SPLIT_K', 1)}]")
    choices = list(sf.plan.matmul_choices.values())
    if choices:
        text += f"; {choices[0].reason}"
    return text


def conv_bn_relu(config: Config) -> list[dict[str, Any]]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for batch in (1, 32):
            model = torch.nn.Sequential(torch.nn.Conv2d(64, 64, 3, padding=1, bias=False), torch.nn.BatchNorm2d(64),
                                        torch.nn.ReLU())
            with torch.no_grad():
                model[1].running_mean.uniform_(-0.5, 0.5)
                model[1].running_var.uniform_(0.5, 1.5)
                model[1].weight.uniform_(0.5, 1.5)
                model[1].bias.uniform_(-0.5, 0.5)
            model = model.eval().to(device="cuda", dtype=dtype)
            sets = [(torch.randn(batch, 64, 56, 56, device="cuda", dtype=dtype),) for _ in range(3)]
            with torch.no_grad():
                fns = {"eager": model,
                       "streamfuse (BN folded)": streamfuse.compile(model, sets[0], config),
                       "streamfuse (BN epilogue)": streamfuse.compile(model, sets[0],
                                                                     config.replace(fold_batchnorm=False))}
                wide = __import__("copy").deepcopy(model).double()
                ref = wide(sets[1][0].double())
                err = {m: max_err(f(*sets[1]), ref) for m, f in fns.items()}
                kernel = {m: time_graph_us(rotating(f, sets)) for m, f in fns.items()}
            launches = {m: f.stats["kernels"] for m, f in fns.items() if m != "eager"}
            rows.append({"workload": f"conv3x3 64ch 56x56 + BN + ReLU {str(dtype)[6:]}, batch {batch}",
                         "kernel_us": kernel, "max_err": err, "launches": launches,
                         "folded_vs_eager": kernel["eager"] / kernel["streamfuse (BN folded)"]})
    return rows


def small_ops(config: Config) -> list[dict[str, Any]]:
    def many(*xs: torch.Tensor) -> list[torch.Tensor]:
        return [torch.sigmoid(x) * 2.0 + x for x in xs]

    xs = tuple(torch.randn(64, 256, device="cuda") for _ in range(32))
    packed = streamfuse.compile(many, xs, config)
    separate = streamfuse.compile(many, xs, config.replace(horizontal_fusion=False, max_streams=1))
    ref = [torch.sigmoid(x.double()) * 2.0 + x.double() for x in xs]
    fns = {"eager (96 ops)": many, "streamfuse 32 launches": separate, "streamfuse 1 packed launch": packed}
    err = {m: max_err(f(*xs), ref) for m, f in fns.items()}
    kernel = {m: time_graph_us(lambda f=f: f(*xs)) for m, f in fns.items()}
    call = {m: time_cuda_us(lambda f=f: f(*xs)) for m, f in fns.items()}
    return [{"workload": "32 independent pointwise ops, 64x256 fp32 each", "kernel_us": kernel, "call_us": call,
             "max_err": err, "launches": {"packed": packed.stats["kernels"], "separate": separate.stats["kernels"]},
             "packed_vs_separate_kernel": kernel["streamfuse 32 launches"] / kernel["streamfuse 1 packed launch"],
             "packed_vs_eager_call": call["eager (96 ops)"] / call["streamfuse 1 packed launch"]}]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--only-linear", action="store_true", help="the Linear + GELU rows alone")
    parser.add_argument("--kernels", action="store_true", help="print each Linear + GELU mode's kernels (profiler)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = Config(cache_dir=out_dir / "cache")
    print(f"card: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    rows = linear_gelu(config, args.kernels)
    if not args.only_linear:
        rows += conv_bn_relu(config) + small_ops(config)
    for r in rows:
        print(f"\n{r['workload']}")
        for m, t in r["kernel_us"].items():
            extra = f"  call {r['call_us'][m]:8.1f} µs" if "call_us" in r else ""
            print(f"  {m:28} kernel {t:9.1f} µs{extra}  max err {r['max_err'][m]:.2e}")
        for key in ("plans", "launches"):
            if key in r:
                for m, v in r[key].items():
                    print(f"  {key[:-1]} {m}: {v}")
        for key, v in r.items():
            if isinstance(v, float):
                print(f"  {key}: {v:.3f}")
    (out_dir / "epilogue.json").write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
