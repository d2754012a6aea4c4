"""The `streamfuse` command: demo and explain. Logic lives in the library; this file only drives it."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from streamfuse.bench.runner import flat_tensors
from streamfuse.tune.ceilings import DeviceCeilings

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def max_error(out: Any, ref: Any) -> float:
    outs, refs = flat_tensors(out), flat_tensors(ref)
    if len(outs) != len(refs):
        raise AssertionError(f"{len(outs)} outputs, eager gave {len(refs)}")
    return max((float((a.double() - b.double()).abs().max()) for a, b in zip(outs, refs, strict=True)), default=0.0)


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
    table = Table(title=f"streamfuse demo on {torch.cuda.get_device_name(device) if on_gpu else 'CPU'} ({str(dtype).removeprefix('torch.')})")
    for col in ["model", "source ops", "kernels", "fused groups", "streams", "max |err| vs eager", "executor"]:
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
            ok = err <= tol * max(1.0, max(float(t.abs().max()) for t in flat_tensors(ref)))
            failures += not ok
            s = compiled.stats
            row = [name, str(s["source_ops"]), str(s["kernels"]), str(s["fused_groups"]), str(s["streams"]),
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


def _positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (argparse names the option in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {value}")
    return value


def load_factory(spec: str) -> Any:
    if ":" not in spec:
        raise SystemExit(f"error: expected FILE.py:FACTORY, got {spec!r}")
    path_s, name = spec.rsplit(":", 1)
    path = Path(path_s)
    if not path.is_file():
        raise SystemExit(f"error: FILE {path} does not exist")
    if path.suffix != ".py":
        raise SystemExit(f"error: FILE must be a Python file (FILE.py:FACTORY), got {path}")
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    if module_spec is None or module_spec.loader is None:
        raise SystemExit(f"error: FILE {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's file: one line naming it and what it raised
        raise SystemExit(f"error: importing {path} raised {type(exc).__name__}: {exc}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise SystemExit(f"error: {path} has no callable {name!r} (FACTORY() must return (model, example_inputs))")
    return factory


def model_and_inputs(spec: str) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """FACTORY() of FILE.py:FACTORY, checked: (model, example inputs as a tuple of tensors)."""
    from streamfuse.capture.export import normalize_inputs

    factory = load_factory(spec)
    try:
        result = factory()
    except Exception as exc:  # noqa: BLE001 - the user's factory: one line naming it and what it raised
        raise SystemExit(f"error: FACTORY {spec} raised {type(exc).__name__}: {exc}") from None
    if not (isinstance(result, tuple) and len(result) == 2):
        raise SystemExit("error: FACTORY() must return (model, example_inputs)")
    model, inputs = result
    if not callable(model):
        raise SystemExit(f"error: FACTORY() must return (model, example_inputs); its model is a {type(model).__name__}")
    try:
        return model, normalize_inputs(inputs)
    except ValueError as exc:
        raise SystemExit(f"error: FACTORY() returned bad example inputs: {exc}") from None


def cmd_explain(args: argparse.Namespace) -> int:
    import streamfuse

    model, inputs = model_and_inputs(args.target)
    with torch.no_grad():
        compiled = streamfuse.compile(model, inputs)
    print(compiled.explain(source=not args.no_source))
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    import streamfuse
    from streamfuse.bench.runner import make_mode
    from streamfuse.bench.workloads import Workload
    from streamfuse.profile.api import predict, profile
    from streamfuse.profile.outputs import render_summary, save_report

    console = Console() if sys.stdout.isatty() else Console(width=160)
    model, inputs = model_and_inputs(args.target)
    modes = [m.strip() for m in args.compare.split(",") if m.strip()]
    unknown = [m for m in modes if m not in ("eager", "compile", "streamfuse")]
    if unknown:
        raise SystemExit(f"error: --compare takes eager, compile and streamfuse; got {', '.join(unknown)}")
    out = Path(args.out)
    reports = []
    if torch.cuda.is_available():
        workload = Workload(args.target, lambda d: (model, inputs))
        for mode in modes:
            with torch.no_grad():
                fn = make_mode(mode, workload, model, inputs, streamfuse.Config())
                for _ in range(3):
                    fn()
                with profile(mode, calls=args.calls) as prof:
                    for _ in range(args.calls):
                        fn()
            reports.append(prof.report)
    else:
        console.print(f"[yellow]No GPU here: the reports are [bold]predicted[/] by the cost model for an {args.gpu} "
                      "(streamfuse's plan on its streams; eager as the unfused graph with Python launches). "
                      "torch.compile cannot be predicted and is skipped.[/]")
        with torch.no_grad():
            compiled = streamfuse.compile(model, inputs)
        for mode in modes:
            if mode == "compile":
                continue
            reports.append(predict(compiled, args.gpu, calls=args.calls, label=mode, eager=mode == "eager"))
    for report in reports:
        console.print(render_summary(report))
        paths = save_report(report, out, report.label)
        console.print(f"wrote {', '.join(str(p) for p in paths.values())}")
    if len(reports) > 1:
        table = Table(title="comparison (" + ("predicted" if reports[0].predicted else "measured") + ")")
        for col in ("mode", "µs per call (GPU span)", "kernels per call", "gap ratio", "streams"):
            table.add_column(col, justify="left" if col == "mode" else "right")
        for r in reports:
            t = r.totals
            table.add_row(r.label, f"{t['span_us'] / max(t['calls'], 1):.1f}", f"{t['kernels_per_call']:.0f}",
                          f"{100 * t['gap_ratio']:.1f}%", f"{t['streams']:.0f}")
        console.print(table)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import datetime

    from rich.markup import escape

    import streamfuse
    from streamfuse.bench.models import MODELS, model_workloads
    from streamfuse.bench.report import bar_chart, bench_table, failures, models_table, row_summary, streamfuse_table
    from streamfuse.bench.runner import MODES, run_suite
    from streamfuse.bench.workloads import WORKLOADS, suite

    console = Console() if sys.stdout.isatty() else Console(width=200)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    tiny = not cuda if args.tiny is None else args.tiny
    name = args.suite or ("all" if cuda else "quick")
    models_suite = name == "models"
    try:
        workloads = model_workloads(args.models, args.batch, args.dtype, tiny) if models_suite else suite(name)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    out = Path(args.out)
    try:
        config = streamfuse.Config(cache_dir=out / "cache").with_settings(args.set)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    if args.list:
        for w in workloads if models_suite else WORKLOADS:
            console.print(f"{w.name:40} suites: {', '.join(w.suites)}")
        if not models_suite:
            console.print("models (--suite models, filtered by --models, --batch, --dtype): "
                          + ", ".join(spec.name for spec in MODELS))
        return 0
    if args.modes:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        unknown = [m for m in modes if m not in MODES]
        if unknown or not modes:
            raise SystemExit(f"error: --modes takes {', '.join(MODES)}; got {args.modes!r}")
    elif cuda:
        modes = MODES
    else:
        modes = ["eager", "streamfuse", "sf-backend"] if models_suite else ["eager", "streamfuse"]
    if not cuda:
        console.print("[yellow]No GPU here: CPU wall-clock times (generated kernels in Triton's interpreter or the "
                      "reference executor); not GPU figures. Run on a CUDA machine for the real suite.[/]")
    gaps = not models_suite if args.gaps is None else args.gaps
    rounds = args.rounds if args.rounds is not None else (5 if cuda and len(modes) > 1 else 1)
    settings = {"suite": name, "modes": modes, "reps": args.reps, "rounds": rounds, "gaps": gaps,
                "tf32_when_timed": bool(args.tf32),
                "config": args.set}
    if models_suite:
        settings |= {"models": args.models, "batch": args.batch, "dtype": args.dtype, "tiny": tiny}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("bench", total=len(workloads) * (len(modes) + (rounds > 1)))

        def step(label: str) -> None:
            progress.update(task, description=label, advance=1)

        saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(args.tf32)
        try:
            results = run_suite(workloads, modes, device, config, out, step,
                                cold_cache=models_suite, gaps=gaps, reps=args.reps, settings=settings,
                                finished=lambda row: progress.console.print(escape(row_summary(row))),
                                explain_dir=out / "explain" if args.explain else None, rounds=rounds)
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    card = torch.cuda.get_device_name() if cuda else "CPU"
    label = f"{name}, tiny configs" if models_suite and tiny else name
    title = f"streamfuse bench ({label}) on {card}, {datetime.date.today().isoformat()}, torch {torch.__version__}"
    if models_suite:
        console.print(models_table(results, modes, title))
        console.print(streamfuse_table(results, "streamfuse modes: checks (TF32 off) and compile times"))
    else:
        console.print(bench_table(results, modes, title))
    for line in failures(results):
        console.print(f"[red]failed:[/] {escape(line)}")
    chart = bar_chart(results, modes, out / "bench.png", title)
    console.print(f"wrote {out / 'bench.json'} and {chart}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from streamfuse.config import Config
    from streamfuse.tune.ceilings import builtin_for, cache_path, load_cached, measure, save

    console = Console() if sys.stdout.isatty() else Console(width=120)
    if not torch.cuda.is_available():
        console.print("[yellow]No GPU here: nothing to measure. Predictions and reports use the built-in "
                      "table's figures below; run `streamfuse calibrate` on a CUDA machine to measure.[/]")
        console.print(ceilings_table(builtin_for(None)))
        return 0
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    path = cache_path(Path(args.cache_dir) if args.cache_dir else Config().cache_dir, name)
    ceilings = None if args.force else load_cached(path)
    if ceilings is None:
        ceilings = measure(device, progress=True)
        save(path, ceilings)
        console.print(f"wrote {path}")
    else:
        console.print(f"cached in {path} (--force measures again)")
    console.print(ceilings_table(ceilings, builtin_for(name)))
    return 0


def ceilings_table(ceilings: DeviceCeilings, reference: DeviceCeilings | None = None) -> Table:
    """The figures of a tune.ceilings.DeviceCeilings, beside the built-in row they replace."""
    table = Table(title=f"{ceilings.name} ({ceilings.arch}, {ceilings.sm_count} SMs): {ceilings.source}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    if reference is not None:
        table.add_column(f"built-in ({reference.name})", justify="right")
    rows: list[tuple[str, Callable[[DeviceCeilings], str]]] = [
        ("device-to-device copy, GB/s (read + written)", lambda c: f"{c.copy_gbps:,.0f}")]
    rows += [(f"cuBLAS {key} matmul, TFLOP/s", lambda c, key=key: f"{c.matmul_tflops[key]:,.1f}")
             for key in ceilings.matmul_tflops]
    rows += [("eager launch, µs per kernel", lambda c: f"{c.launch_us:.2f}"),
             ("kernel in a CUDA graph, µs", lambda c: f"{c.graph_kernel_us:.2f}")]
    for label, fmt in rows:
        table.add_row(label, fmt(ceilings), *([fmt(reference)] if reference is not None else []))
    return table


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
    prof = sub.add_parser("profile", help="profile FILE.py:FACTORY: timeline, gap ratio, per kernel, report files")
    prof.add_argument("target", metavar="FILE.py:FACTORY")
    prof.add_argument("--compare", default="eager,compile,streamfuse",
                      help="comma-separated modes: eager, compile, streamfuse")
    prof.add_argument("--out", default="streamfuse-profile", help="directory for trace, PNG, HTML and JSON")
    prof.add_argument("--calls", type=_positive_int, default=10, help="calls profiled per mode")
    prof.add_argument("--gpu", default="H200", choices=["H200", "H100", "A100"],
                      help="GPU whose ceilings a predicted (no-GPU) report uses")
    prof.set_defaults(fn=cmd_profile)
    bench = sub.add_parser("bench", help="the benchmark suite: eager, CUDA graph, torch.compile (x2), "
                           "streamfuse.compile, torch.compile(backend='streamfuse')")
    bench.add_argument("--suite", default=None,
                       help="all, quick or models (default: all on a GPU, quick on CPU); models: torchvision and "
                            "Hugging Face models from random weights, batch 1 and throughput, float32 and bfloat16")
    bench.add_argument("--list", action="store_true", help="list the workloads and their suites")
    bench.add_argument("--out", default="streamfuse-bench", help="directory for bench.json and bench.png")
    bench.add_argument("--models", default=None, metavar="NAME[,NAME]",
                       help="models suite: only models whose names, or a word in them, start with one of these "
                            "(e.g. resnet,bert: bert-base, not distilbert)")
    bench.add_argument("--batch", default="all", choices=["1", "throughput", "all"],
                       help="models suite: batch 1, the throughput batch (32 images, 8 sequences), or both")
    bench.add_argument("--dtype", default="all", choices=["float32", "bfloat16", "all"], help="models suite")
    bench.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=None,
                       help="models suite: one-layer transformer configs and short inputs (default: on without a GPU)")
    bench.add_argument("--modes", default=None, help="comma-separated modes (default: all six on a GPU)")
    bench.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                       help="a Config setting for the streamfuse modes (repeatable), e.g. --set max_streams=1")
    bench.add_argument("--rounds", type=_positive_int, default=None,
                       help="time the modes side by side in this many rounds, each mode its share of --reps per round, "
                            "after all are built (default: 5 on CUDA; 1 times each mode as soon as it is built)")
    bench.add_argument("--reps", type=_positive_int, default=None, help="timed calls per mode (default: 50 on CUDA, 10 on CPU)")
    bench.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True,
                       help="time float32 with TF32 allowed for matmuls and convolutions (default; the correctness "
                            "checks always run with TF32 off)")
    bench.add_argument("--gaps", action=argparse.BooleanOptionalAction, default=None,
                       help="kernels per call and gap ratio by torch.profiler on CUDA, after all timing "
                            "(default: on, off for the models suite, where it keeps every model alive to the end)")
    bench.add_argument("--explain", action="store_true",
                       help="write the plan each streamfuse mode timed (explain(), measured choices included) to "
                            "OUT/explain/WORKLOAD.MODE.txt, to compare the two entry points, or two runs")
    bench.set_defaults(fn=cmd_bench)
    calibrate = sub.add_parser("calibrate", help="measure this GPU's ceilings (copy, matmul, launch costs) "
                               "and cache them per device name")
    calibrate.add_argument("--force", action="store_true", help="measure again even if a cached result exists")
    calibrate.add_argument("--cache-dir", default=None, help="cache directory (default: Config().cache_dir)")
    calibrate.set_defaults(fn=cmd_calibrate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
