"""Which setting makes a suite model's result wrong: compile it under Config variants and print each
one's error against eager.

    python benchmarks/config_bisect.py [--model regnet_y_400mf] [--batch 1]
        [--variants "pointwise_conv_mm=false;matmul_strategy=cublas;autotune=false"] [--dump DIR]

Float32 with TF32 off (as the suite checks), random weights and inputs as `streamfuse bench --suite
models` builds them. Each variant is a comma-separated list of Config fields (NAME=VALUE); the
defaults always run first. Printed per variant: max relative error against eager float32 and against
eager float64 (the arbiter where float32 rounding is in doubt). `--dump DIR` writes each variant's
`explain()` with its kernel sources, and the tuning cache, for reading off the device machine.
Session 61 found regnet_y_400mf's bias bug this way (PERF.md, run 226). Runs on the CPU too, with the
generated kernels in Triton's interpreter under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import time
from pathlib import Path
from typing import Any

import torch

import streamfuse
from streamfuse.bench import models
from streamfuse.bench.runner import exact_fp32, rel_error
from streamfuse.config import Config


def parse_variant(text: str) -> dict[str, Any]:
    """"a=1,b=x" -> Config fields, each value converted to its default's type."""
    fields = {f.name for f in dataclasses.fields(Config)}
    defaults = Config()
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in fields:
            raise SystemExit(f"error: --variants: {name!r} is not a Config field")
        current = getattr(defaults, name)
        if isinstance(current, bool):
            out[name] = value.lower() in ("1", "true", "on", "yes")
        elif isinstance(current, (int, float)):
            out[name] = type(current)(value)
        else:
            out[name] = value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="regnet_y_400mf", help="a suite model's full name")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--variants", default="", help="';'-separated variants, each 'NAME=VALUE,...'")
    ap.add_argument("--dump", type=Path, help="folder for each variant's explain() and the tuning cache")
    args = ap.parse_args()
    specs = {s.name: s for s in models.MODELS}
    if args.model not in specs:
        raise SystemExit(f"error: --model takes one of {', '.join(specs)}; got {args.model!r}")
    spec = specs[args.model]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with exact_fp32():
        torch.manual_seed(0)
        model = models.nonzero_parameters(spec.build(False)).eval().to(device)
        inputs = models.make_inputs(spec, model, args.batch, False, device, torch.float32, seed=1)
        with torch.no_grad():
            ref = model(*inputs)
            model.double()
            ref64 = model(*(t.double() if t.is_floating_point() else t for t in inputs))
            model.float()
        print(f"eager float32 against float64: {rel_error(ref, ref64):.2e}", flush=True)
        for variant in ["", *filter(None, args.variants.split(";"))]:
            start = time.perf_counter()
            compiled = streamfuse.compile(model, inputs, config=Config(**parse_variant(variant)))
            with torch.no_grad():
                out = compiled(*inputs)
            print(f"[{variant or 'defaults'}] error {rel_error(out, ref):.2e}, against float64 "
                  f"{rel_error(out, ref64):.2e} ({time.perf_counter() - start:.1f} s, {type(compiled).__name__})",
                  flush=True)
            if args.dump:
                args.dump.mkdir(parents=True, exist_ok=True)
                name = (variant or "defaults").replace("=", "-").replace(",", "_")
                (args.dump / f"{args.model}-{name}.txt").write_text(compiled.explain(source=True))
    if args.dump:
        for f in Config().cache_dir.glob("*.json"):
            shutil.copy(f, args.dump)


if __name__ == "__main__":
    main()
