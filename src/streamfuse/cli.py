"""The `streamfuse` command: demo and explain. Logic lives in the library; this file only drives it."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def max_error(out: Any, ref: Any) -> float:
    outs, refs = _flat(out), _flat(ref)
    if len(outs) != len(refs):
        raise AssertionError(f"{len(outs)} outputs, eager gave {len(refs)}")
    return max((float((a.double() - b.double()).abs().max()) for a, b in zip(outs, refs, strict=True)), default=0.0)


def _flat(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _flat(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _flat(v)]
    return []


def cmd_demo(args: argparse.Namespace) -> int:
    import streamfuse
    from streamfuse.demo_models import DEMO_MODELS
    from streamfuse.profile.timing import time_cuda_us

    console = Console() if sys.stdout.isatty() else Console(width=140)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype]
    if device.type == "cpu" and dtype != torch.float32:
        console.print("[yellow]CPU eager kernels for half types are slow and loose; using float32 on CPU[/]")
        dtype = torch.float32
    on_gpu = device.type == "cuda"
    table = Table(title=f"streamfuse demo on {torch.cuda.get_device_name(device) if on_gpu else 'CPU'} ({args.dtype})")
    for col in ["model", "source ops", "kernels", "fused groups", "max |err| vs eager", "executor"]:
        table.add_column(col, justify="right" if col not in ("model", "executor") else "left",
                         no_wrap=col == "model")
    if on_gpu:
        for col in ["eager µs", "streamfuse µs", "speed-up"]:
            table.add_column(col, justify="right")
    failures = 0
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("compiling and checking", total=len(DEMO_MODELS))
        for name, factory in DEMO_MODELS.items():
            progress.update(task, description=f"{name}: compiling")
            model, inputs = factory(device, dtype)
            with torch.no_grad():
                compiled = streamfuse.compile(model, inputs)
                ref = model(*inputs)
                out = compiled(*inputs)
            err = max_error(out, ref)
            tol = 1e-3 if dtype == torch.float32 else 5e-2
            ok = err <= tol * max(1.0, max(float(t.abs().max()) for t in _flat(ref)))
            failures += not ok
            s = compiled.stats
            row = [name, str(s["source_ops"]), str(s["kernels"]), str(s["fused_groups"]),
                   f"[{'green' if ok else 'red'}]{err:.2e}[/]", s["executor"]]
            if on_gpu:
                progress.update(task, description=f"{name}: timing")
                with torch.no_grad():
                    t_eager = time_cuda_us(lambda: model(*inputs))
                    t_sf = time_cuda_us(lambda: compiled(*inputs))
                row += [f"{t_eager:.1f}", f"{t_sf:.1f}", f"{t_eager / t_sf:.2f}x"]
            table.add_row(*row)
            if args.explain:
                console.print(compiled.explain(source=False))
            progress.advance(task)
    console.print(table)
    if not on_gpu:
        console.print("No GPU here: times are shown only on CUDA devices. "
                      + ("Kernels ran in Triton's interpreter." if compiled.executor == "triton"
                         else "Groups ran through the reference executor (set TRITON_INTERPRET=1 to run the "
                              "generated Triton kernels in Triton's interpreter)."))
    return 1 if failures else 0


def load_factory(spec: str) -> Any:
    if ":" not in spec:
        raise SystemExit(f"error: expected FILE.py:FACTORY, got {spec!r}")
    path_s, name = spec.rsplit(":", 1)
    path = Path(path_s)
    if not path.is_file():
        raise SystemExit(f"error: FILE {path} does not exist")
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise SystemExit(f"error: {path} has no callable {name!r} (FACTORY() must return (model, example_inputs))")
    return factory


def cmd_explain(args: argparse.Namespace) -> int:
    import streamfuse

    result = load_factory(args.target)()
    if not (isinstance(result, tuple) and len(result) == 2):
        raise SystemExit("error: FACTORY() must return (model, example_inputs)")
    model, inputs = result
    with torch.no_grad():
        compiled = streamfuse.compile(model, inputs)
    print(compiled.explain(source=not args.no_source))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamfuse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="compile the embedded models, check them against eager, time them on a GPU")
    demo.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    demo.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    demo.add_argument("--explain", action="store_true", help="also print each model's plan")
    demo.set_defaults(fn=cmd_demo)
    explain = sub.add_parser("explain", help="print the plan of FILE.py:FACTORY (FACTORY() -> (model, inputs))")
    explain.add_argument("target", metavar="FILE.py:FACTORY")
    explain.add_argument("--no-source", action="store_true", help="omit the generated Triton source")
    explain.set_defaults(fn=cmd_explain)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
