"""One Config setting off and on, on the suite's models, in one process with the timing rounds
interleaved (GPU).

    python benchmarks/setting_ab.py --set addmm_gelu_epilogue=True --models gpt2 [--batch 1,throughput]
        [--dtype float32,bfloat16] [--peer]

For each workload: streamfuse.compile with the defaults and with the setting, each checked against
eager (relative max error) with its kernel count, then three interleaved rounds of CUDA-event timing
(median µs per call of 200; the best round is printed) and, with --peer, torch.compile's
reduce-overhead mode beside them. Float32 runs with the process's TF32 defaults, as the suite times it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def compare(names: str, batch: str, dtype: str, setting: str, peer: bool) -> None:
    """`setting`: NAME=VALUE, parsed as the CLI's --set (Config.with_settings)."""
    import streamfuse
    from streamfuse.bench.models import model_workloads
    from streamfuse.bench.runner import rel_error
    from streamfuse.profile.timing import time_cuda_us

    device = torch.device("cuda")
    for w in model_workloads(names, batch, dtype):
        model, inputs = w.make(device)
        with torch.no_grad():
            want = model(*inputs)
            modes: dict[str, Any] = {}
            for label, config in (("off", streamfuse.Config()), ("on", streamfuse.Config().with_settings([setting]))):
                compiled = streamfuse.compile(model, inputs, config)
                err = rel_error(compiled(*inputs), want, floor=0.0)
                modes[label] = compiled
                print(f"{w.name} {setting if label == 'on' else 'defaults'}: rel err {err:.2e}, "
                      f"{compiled.stats['kernels']} kernels", flush=True)
            if peer:
                ro = torch.compile(model, mode="reduce-overhead")
                for _ in range(3):
                    ro(*inputs)
                modes["reduce-overhead"] = ro
            times: dict[str, list[float]] = {k: [] for k in modes}
            for _ in range(3):
                for k, f in modes.items():
                    times[k].append(time_cuda_us(lambda f=f, a=inputs: f(*a), warmup=20, reps=200))  # type: ignore[misc]
        off = min(times["off"])
        print(w.name, "  ".join(f"{k} {min(v):.1f} µs ({off / min(v):.3f}x of off)" for k, v in times.items()),
              flush=True)
        del modes, model
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", dest="setting", required=True, help="NAME=VALUE, a Config field")
    ap.add_argument("--models", required=True)
    ap.add_argument("--batch", default="1", help="comma-separated: 1, throughput")
    ap.add_argument("--dtype", default="float32", help="comma-separated: float32, bfloat16")
    ap.add_argument("--peer", action="store_true", help="also torch.compile(mode='reduce-overhead')")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    for batch in args.batch.split(","):
        for dtype in args.dtype.split(","):
            compare(args.models, batch.strip(), dtype.strip(), args.setting, args.peer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
