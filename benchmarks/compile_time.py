"""Where a first compile's time goes: per suite model, streamfuse.compile's stages and its first call
(Triton compiles, CUDA graph recorded), on a cold cache and again in a new process with the disk
caches warm.

    python benchmarks/compile_time.py --cache DIR --models googlenet,bert [--threads 8]
    python benchmarks/compile_time.py --cache DIR --models googlenet,bert   # again: warm

`--cache DIR` holds streamfuse's cache and Triton's (TRITON_CACHE_DIR, Triton's own variable): an
empty DIR is a cold start. torch.compile reduce-overhead's first compile is timed beside it with
`--peer` (Inductor's caches are cold only in a fresh DIR as well: TORCHINDUCTOR_CACHE_DIR).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", required=True, type=Path)
    ap.add_argument("--models", default="googlenet,convnext,vit,bert-base,gpt2")
    ap.add_argument("--batch", default="1", choices=["1", "throughput", "all"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None, help="Config.compile_threads (default: Config's)")
    ap.add_argument("--peer", action="store_true", help="also time torch.compile reduce-overhead's first compile")
    args = ap.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(args.cache / "triton")  # before triton is imported
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(args.cache / "inductor")

    import torch

    import streamfuse
    from streamfuse.bench.models import model_workloads

    cold = not (args.cache / "streamfuse").exists()
    config = streamfuse.Config(cache_dir=args.cache / "streamfuse")
    if args.threads is not None:
        config = config.replace(compile_threads=args.threads)
    device = torch.device("cuda")
    print(f"{'cold' if cold else 'warm'} caches in {args.cache}, compile_threads={config.compile_threads}")
    for w in model_workloads(args.models, args.batch, args.dtype):
        model, inputs = w.make(device)
        with torch.no_grad():
            start = time.perf_counter()
            compiled = streamfuse.compile(model, inputs, config)
            compiled(*inputs)
            torch.cuda.synchronize()
            total = time.perf_counter() - start
            stats = compiled.stats
            stages = ", ".join(f"{k} {v:.1f}" for k, v in (stats.get("compile_stages_s") or {}).items() if v >= 0.05)
            print(f"{w.name}: streamfuse {total:.1f} s = compile {stats.get('compile_s') or 0:.1f} "
                  f"+ first call {stats.get('first_call_s') or 0:.1f} [{stages}] "
                  f"kernels {stats.get('kernels')}, fallback {stats.get('fallback')}, "
                  f"capture: {stats.get('capture_path')}, {jit_variants(compiled)}", flush=True)
            if args.peer:
                torch._dynamo.reset()
                start = time.perf_counter()
                fn = torch.compile(model, mode="reduce-overhead")
                for _ in range(3):  # cudagraph trees record on the second or third call
                    fn(*inputs)
                torch.cuda.synchronize()
                print(f"{w.name}: reduce-overhead first compile {time.perf_counter() - start:.1f} s", flush=True)
        del model, compiled
        torch.cuda.empty_cache()
    return 0


def jit_variants(compiled: object) -> str:
    """Binaries Triton holds per generated kernel after the first call: 1 where the kernel compiled
    ahead (runtime/precompile.py) was the one launched, more where a launch compiled its own."""
    from streamfuse.runtime.steps import KernelStep

    counts = []
    for step in getattr(getattr(compiled, "base", None), "steps", []):
        if isinstance(step, KernelStep):
            caches = getattr(step.kernel, "device_caches", {})
            counts.append(sum(len(c[0]) for c in caches.values()))
    extra = sum(c - 1 for c in counts if c > 1)
    return f"{len(counts)} kernels, {extra} compiled again at launch"


if __name__ == "__main__":
    sys.exit(main())
