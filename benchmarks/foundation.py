"""Foundation benchmark (issue: vertical fusion), measured side by side in one run on a GPU.

    python benchmarks/foundation.py [--out DIR] [--sweep]

Workloads: an 8-op pointwise chain on 64M fp32 elements, softmax and layer_norm over
[4096, 4096] fp32. Modes: eager PyTorch, torch.compile (default mode), streamfuse. For each,
the achieved bandwidth (bytes read + written once) against the measured device-to-device copy
bandwidth. --sweep also times streamfuse under a few launch configurations.
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

import streamfuse
from streamfuse import Config
from streamfuse.bench.workloads import chain8
from streamfuse.profile.timing import time_cuda_us, time_graph_us


def chain8_residual(x: torch.Tensor) -> torch.Tensor:
    """8 ops that each also read the input (a residual-style chain): eager moves 12x the bytes."""
    y = x * x
    y = y + x
    y = torch.sigmoid(y) * x
    y = y - x
    y = torch.maximum(y, x)
    y = y / (x.abs() + 1.0)
    return y


def softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, -1)


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), w, b)


def rotating(fn: Callable[..., Any], input_sets: list[tuple[torch.Tensor, ...]]) -> Callable[[], Any]:
    """Call fn on a different input set each time, so repeated calls do not measure the L2."""
    state = {"i": 0}

    def call() -> Any:
        state["i"] = (state["i"] + 1) % len(input_sets)
        return fn(*input_sets[state["i"]])

    return call


def copy_bandwidth() -> float:
    src = torch.randn(256 * 2**20, device="cuda")
    dst = torch.empty_like(src)
    t = time_cuda_us(lambda: dst.copy_(src), warmup=5, reps=30)  # not graph replay: that uses a copy engine
    return 2 * src.numel() * 4 / (t * 1e-6)


WORKLOADS: dict[str, tuple[Callable[..., Any], Callable[[int], tuple[torch.Tensor, ...]], int]] = {
    # name: (fn, make inputs(seed), bytes moved once)
    "chain8 64M fp32": (chain8, lambda s: (torch.randn(64 * 2**20, device="cuda"),), 2 * 4 * 64 * 2**20),
    "chain8 residual 64M fp32": (chain8_residual, lambda s: (torch.randn(64 * 2**20, device="cuda"),),
                                 2 * 4 * 64 * 2**20),
    "chain8 1K fp32 (launch-bound)": (chain8, lambda s: (torch.randn(1024, device="cuda"),), 2 * 4 * 1024),
    "softmax 4096x4096 fp32": (softmax, lambda s: (torch.randn(4096, 4096, device="cuda"),), 2 * 4 * 4096 * 4096),
    "layer_norm 4096x4096 fp32": (
        layer_norm,
        lambda s: (torch.randn(4096, 4096, device="cuda"), torch.randn(4096, device="cuda"),
                   torch.randn(4096, device="cuda")),
        2 * 4 * 4096 * 4096,
    ),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    card = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    print(f"card: {card}; torch {torch.__version__}; device-to-device copy: {bw / 1e12:.2f} TB/s")
    config = Config(cache_dir=out_dir / "cache")
    rows = []
    modes = ["eager", "compile", "streamfuse"]
    for name, (fn, make, nbytes) in WORKLOADS.items():
        sets = [make(s) for s in range(3)]
        with torch.no_grad():
            sf = streamfuse.compile(fn, sets[0], config)
            tc = torch.compile(fn)
            fns = {"eager": fn, "compile": tc, "streamfuse": sf}
            ref = fn(*[t.double() for t in sets[1]])
            err = {m: float((f(*sets[1]).double() - ref).abs().max()) for m, f in fns.items()}
            call = {m: time_cuda_us(rotating(f, sets)) for m, f in fns.items()}
            kernel = {m: time_graph_us(rotating(f, sets)) for m, f in fns.items()}
        row = {"workload": name, "bytes": nbytes, "kernels": sf.stats["kernels"], "max_err": err,
               "call_us": call, "kernel_us": kernel,
               "streamfuse_kernel_bw_fraction": nbytes / (kernel["streamfuse"] * 1e-6) / bw,
               "streamfuse_call_bw_fraction": nbytes / (call["streamfuse"] * 1e-6) / bw}
        if args.sweep:
            row["sweep"] = sweep(fn, sets, config)
        rows.append(row)
    print()
    print("call = back-to-back calls, host overhead included; kernel = the same call replayed from a CUDA graph")
    head = f"{'workload':30} {'mode':10} {'call µs':>9} {'kernel µs':>9} {'kernel % copy BW':>16} {'max err':>9}"
    print(head)
    for r in rows:
        for m in modes:
            frac = r["bytes"] / (r["kernel_us"][m] * 1e-6) / bw
            print(f"{r['workload']:30} {m:10} {r['call_us'][m]:9.1f} {r['kernel_us'][m]:9.1f} {100 * frac:15.1f}% "
                  f"{r['max_err'][m]:9.2e}")
        sf_call, sf_kernel = r["call_us"]["streamfuse"], r["kernel_us"]["streamfuse"]
        print(f"{'':30} streamfuse vs eager: {r['call_us']['eager'] / sf_call:.2f}x (call), "
              f"{r['kernel_us']['eager'] / sf_kernel:.2f}x (kernel); vs torch.compile: "
              f"{r['call_us']['compile'] / sf_call:.2f}x (call), {r['kernel_us']['compile'] / sf_kernel:.2f}x "
              f"(kernel); streamfuse kernels per call: {r['kernels']}")
        for label, t_us in r.get("sweep", {}).items():
            print(f"    sweep {label:40} {t_us:8.1f} µs (kernel)")
    (out_dir / "foundation.json").write_text(json.dumps({"card": card, "copy_bw": bw, "rows": rows}, indent=1))
    return 0


def sweep(fn: Callable[..., Any], sets: list[tuple[torch.Tensor, ...]], base: Config) -> dict[str, float]:
    variants = {
        "pw block 1024 warps 4": base.replace(pointwise_block=1024, pointwise_num_warps=4),
        "pw block 2048 warps 8": base.replace(pointwise_block=2048, pointwise_num_warps=8),
        "pw block 4096 warps 8": base.replace(pointwise_block=4096, pointwise_num_warps=8),
        "red elems/thread 8": base.replace(reduction_elems_per_thread=8),
        "red elems/thread 32": base.replace(reduction_elems_per_thread=32),
    }
    result = {}
    for label, cfg in variants.items():
        with torch.no_grad():
            compiled = streamfuse.compile(fn, sets[0], cfg)
            result[label] = time_graph_us(rotating(compiled, sets))
    return result


if __name__ == "__main__":
    sys.exit(main())
