"""An optimizer step side by side in one process: eager (`foreach=True`, torch's multi-tensor
kernels), torch.compile (Inductor) and `torch.compile(optimizer.step, backend="streamfuse")` —
issue 16's optimizer target (a compiled AdamW step over 100+ tensors at most half of eager's time,
results within 1e-6 relative of eager's).

    python benchmarks/optimizer.py [--model gpt2|bert-base|mlp] [--optimizers adamw,adam,sgd] [--steps 50]
    python benchmarks/optimizer.py --tiny        # a small parameter set on any machine (smoke test)

The parameters are a real model's (random weights, fixed seed; a Hugging Face config, no download)
with fixed random gradients. Per optimizer and mode: microseconds per step (CUDA events around
`--steps` steps after warm-up, median of 5 repeats), and the check: after 5 steps from the same
parameters with the same gradients, every parameter and every optimizer state against eager's
(worst relative norm error; over 1e-6 it is noted beside the time: a compiled step computes its
bias corrections in float32 tensors where eager uses Python floats, and 1 - beta2 ** step loses
digits to cancellation — run 61: Inductor 3.8e-6, streamfuse 6.7e-6 with an exp2-based power).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from streamfuse.runtime.fallback import failure_text  # noqa: E402 - after the path

MODES = ("eager", "compile", "streamfuse")
OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
}
RTOL = 1e-6


def parameters(model: str, tiny: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    if model == "mlp" or tiny:
        layers = 4 if tiny else 60
        width = 32 if tiny else 1024
        net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        return [p.detach() for p in net.parameters()]
    from streamfuse.bench.models import MODELS

    name = {"gpt2": "gpt2 prefill", "bert-base": "bert-base"}[model]
    spec = next(s for s in MODELS if s.name == name)
    return [p.detach() for p in spec.build(False).parameters()]


def make(values: list[torch.Tensor], grads: list[torch.Tensor], device: torch.device
         ) -> list[nn.Parameter]:
    params = [nn.Parameter(v.to(device).clone()) for v in values]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.to(device).clone()
    return params


def stepper(mode: str, opt: torch.optim.Optimizer) -> Callable[[], Any]:
    if mode == "eager":
        return opt.step
    if mode == "compile":
        return torch.compile(opt.step)
    import streamfuse

    return torch.compile(opt.step, backend=streamfuse.make_backend())


def run(name: str, mode: str, values: list[torch.Tensor], grads: list[torch.Tensor], device: torch.device,
        steps: int, reference: list[torch.Tensor] | None) -> dict[str, Any]:
    result: dict[str, Any] = {"optimizer": name, "mode": mode}
    torch._dynamo.reset()
    try:
        params = make(values, grads, device)
        opt = OPTIMIZERS[name](params)
        step = stepper(mode, opt)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        result["first_step_s"] = time.perf_counter() - start
        for _ in range(4):
            step()
        state = [p.detach().clone() for p in params] + [
            v.detach().clone() for p in params for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
        if reference is not None:
            worst = max(((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
                        for a, b in zip(state, reference, strict=True))
            result["rel_err"] = worst
            if worst > RTOL:  # reported beside the time: Inductor's compiled step misses 1e-6 as well (run 61)
                result["note"] = f"over {RTOL:.0e}: worst relative norm error {worst:.2e} against eager"
        else:
            result["state"] = state
        if device.type == "cuda":
            times = []
            for _ in range(5):
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                for _ in range(steps):
                    step()
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end) * 1000 / steps)
            result["us_per_step"] = statistics.median(times)
        else:
            begin_s = time.perf_counter()
            for _ in range(steps):
                step()
            result["us_per_step"] = (time.perf_counter() - begin_s) * 1e6 / steps
    except Exception as exc:  # noqa: BLE001 - a failing mode is reported, not fatal
        result["error"] = failure_text(exc)
    finally:
        torch._dynamo.reset()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2", choices=["gpt2", "bert-base", "mlp"])
    ap.add_argument("--optimizers", default="adamw,adam,sgd")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [n for n in names if n not in OPTIMIZERS] + [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"error: unknown optimizer or mode {bad}: --optimizers takes {', '.join(OPTIMIZERS)}, "
                         f"--modes {', '.join(MODES)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    values = parameters(args.model, args.tiny)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(v.shape, generator=gen) * 1e-2 for v in values]
    total = sum(v.numel() for v in values)
    print(f"optimizer step over {len(values)} tensors ({total / 1e6:.1f} M parameters, "
          f"{'tiny' if args.tiny else args.model}) on {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}")
    print(f"{'optimizer':<8} {'mode':<11} {'us/step':>9} {'vs eager':>9} {'vs compile':>11} {'rel err':>9} {'1st step s':>10}")
    rows = []
    for name in names:
        ref = run(name, "eager", values, grads, device, args.steps, None)
        reference = ref.pop("state", None)
        results = [ref] + [run(name, m, values, grads, device, args.steps, reference) for m in modes if m != "eager"]
        base = {r["mode"]: r.get("us_per_step") for r in results}
        for r in results:
            us = r.get("us_per_step") if "error" not in r else None

            def ratio(other: str, us: float | None = us) -> str:
                b = base.get(other)
                return f"{b / us:.2f}x" if us and b else "-"

            print(f"{name:<8} {r['mode']:<11} " + (f"{us:9.1f}" if us else f"{'-':>9}")
                  + f" {ratio('eager'):>9} {ratio('compile'):>11} "
                  + (f"{r['rel_err']:9.1e}" if "rel_err" in r else f"{'-':>9}")
                  + (f" {r['first_step_s']:10.1f}" if "first_step_s" in r else f" {'-':>10}")
                  + (f"  FAILED: {r['error']}" if "error" in r else "")
                  + (f"  ({r['note']})" if "note" in r else ""))
            rows.append(r)
    if args.json is not None:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
