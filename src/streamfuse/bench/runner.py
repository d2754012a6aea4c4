"""Run benchmark workloads in five modes, side by side, in one process.

Modes: eager, eager captured in a CUDA graph, torch.compile (default), torch.compile
mode="reduce-overhead", streamfuse. Each mode is checked against eager before it is timed (a wrong
answer is reported as a failure, not a time); a mode that fails is reported, never fatal.
Times: CUDA events around back-to-back calls, warm-up first, median (profile/timing.py).
"""

from __future__ import annotations

import datetime
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from streamfuse.bench.workloads import Workload
from streamfuse.config import Config

MODES = ["eager", "eager+graph", "compile", "compile-ro", "streamfuse"]
TOLERANCE = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}


@dataclass
class ModeResult:
    mode: str
    us: float | None = None
    error: str | None = None
    max_rel_err: float | None = None
    kernels_per_call: float | None = None
    gap_ratio: float | None = None
    compile_s: float | None = None


@dataclass
class WorkloadResult:
    workload: str
    modes: dict[str, ModeResult] = field(default_factory=dict)

    def best_other(self) -> tuple[str, float] | None:
        times = [(m, r.us) for m, r in self.modes.items() if m != "streamfuse" and r.us is not None]
        return min(times, key=lambda t: t[1]) if times else None  # type: ignore[return-value,arg-type]

    def streamfuse_ratio(self) -> float | None:
        best, sf = self.best_other(), self.modes.get("streamfuse")
        if best is None or sf is None or sf.us is None:
            return None
        return best[1] / sf.us


def flat_tensors(x: Any) -> list[torch.Tensor]:
    """The tensors in a (nested) output, in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in flat_tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in flat_tensors(v)]
    return []


def rel_error(out: Any, ref: Any) -> float:
    outs, refs = flat_tensors(out), flat_tensors(ref)
    if len(outs) != len(refs):
        raise AssertionError(f"{len(outs)} outputs, eager has {len(refs)}")
    worst = 0.0
    for o, r in zip(outs, refs, strict=True):
        scale = max(float(r.double().abs().max()), 1.0)
        worst = max(worst, float((o.double() - r.double()).abs().max()) / scale)
    return worst


def make_mode(mode: str, workload: Workload, model: Any, inputs: tuple[torch.Tensor, ...],
              config: Config) -> Callable[[], Any]:
    import streamfuse

    if workload.parallel:
        models = list(model)
        if mode == "streamfuse":
            par = streamfuse.parallel([(m, (x,)) for m, x in zip(models, inputs, strict=True)], config)
            return lambda: par(*inputs)
        if mode in ("compile", "compile-ro"):
            models = [torch.compile(m, mode="reduce-overhead" if mode == "compile-ro" else None) for m in models]
        if mode == "compile-ro":  # several cudagraph-tree models per step: mark each invocation
            def run() -> list[Any]:
                outs = []
                for m, x in zip(models, inputs, strict=True):
                    torch.compiler.cudagraph_mark_step_begin()
                    outs.append(m(x).clone())
                return outs
        else:
            run = lambda: [m(x) for m, x in zip(models, inputs, strict=True)]
    else:
        if mode == "streamfuse":
            compiled = streamfuse.compile(model, inputs, config)
            return lambda: compiled(*inputs)
        fn = model
        if mode in ("compile", "compile-ro"):
            fn = torch.compile(model, mode="reduce-overhead" if mode == "compile-ro" else None)
        run = lambda: fn(*inputs)
    return _graphed(run) if mode == "eager+graph" else run


def _graphed(run: Callable[[], Any]) -> Callable[[], Any]:
    from streamfuse.profile.timing import capture_graph

    graph, outputs = capture_graph(run)

    def replay() -> Any:
        graph.replay()
        return outputs

    return replay


def time_us(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        from streamfuse.profile.timing import time_cuda_us

        return time_cuda_us(fn, warmup=10, reps=50)
    for _ in range(3):
        fn()
    samples = []
    for _ in range(10):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e6)
    return statistics.median(samples)


def run_mode(mode: str, workload: Workload, device: torch.device, config: Config, ref: Any,
             to_profile: list[tuple[ModeResult, Callable[[], Any]]] | None = None) -> ModeResult:
    """One mode of one workload: compiled, checked against `ref`, timed. On CUDA its gap ratio needs
    torch.profiler, which slows later four-stream graphs in the process (docs/PERF.md session 10),
    so the call is appended to `to_profile` for after the suite's timing (profiled now if None)."""
    result = ModeResult(mode)
    try:
        model, inputs = make_seeded(workload, device)
        with torch.no_grad():
            t0 = time.perf_counter()
            fn = make_mode(mode, workload, model, inputs, config)
            out = fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            result.compile_s = time.perf_counter() - t0
            result.max_rel_err = rel_error(out, ref)
            tol = TOLERANCE.get(workload.dtype, 2e-3)
            if result.max_rel_err > tol:
                result.error = f"wrong result: max relative error {result.max_rel_err:.2e} > {tol:.0e}"
                return result
            result.us = time_us(fn, device)
            if device.type == "cuda":
                if to_profile is None:
                    profile_gaps(result, fn)
                else:
                    to_profile.append((result, fn))
    except Exception as exc:  # noqa: BLE001 - a failing mode is reported, not fatal
        result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        result.us = None
    return result


def profile_gaps(result: ModeResult, fn: Callable[[], Any]) -> None:
    """Kernels per call and gap ratio of `fn` (torch.profiler timeline of 10 calls)."""
    from streamfuse.profile.timeline import gap_ratio, record_timeline

    try:
        intervals = record_timeline(fn, calls=10, warmup=2)
    except Exception:  # noqa: BLE001 - a failed timeline leaves the timed result standing, gap unknown
        return
    result.kernels_per_call = len(intervals) / 10
    result.gap_ratio = gap_ratio(intervals)


def make_seeded(workload: Workload, device: torch.device) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """The workload's model and inputs, the same in every mode (fixed seed)."""
    torch.manual_seed(0)
    return workload.make(device)


def reference(workload: Workload, device: torch.device) -> Any:
    model, inputs = make_seeded(workload, device)
    with torch.no_grad():
        if workload.parallel:
            return [m(x) for m, x in zip(model, inputs, strict=True)]
        return model(*inputs)


def run_suite(workloads: list[Workload], modes: list[str], device: torch.device, config: Config,
              out_dir: Path | None = None, progress: Callable[[str], None] | None = None) -> list[WorkloadResult]:
    results: list[WorkloadResult] = []
    to_profile: list[tuple[ModeResult, Callable[[], Any]]] = []
    for workload in workloads:
        row = WorkloadResult(workload.name)
        results.append(row)
        try:
            ref = reference(workload, device)
        except Exception as exc:  # noqa: BLE001 - e.g. torchvision missing
            for mode in modes:
                row.modes[mode] = ModeResult(mode, error=f"workload unavailable: {type(exc).__name__}: {exc}"[:300])
            ref = None
        for mode in modes if ref is not None else []:
            if progress:
                progress(f"{workload.name}: {mode}")
            if mode in ("compile", "compile-ro"):
                torch._dynamo.reset()
            if device.type != "cuda" and mode in ("eager+graph", "compile-ro"):
                row.modes[mode] = ModeResult(mode, error="needs CUDA")
                continue
            row.modes[mode] = run_mode(mode, workload, device, config, ref, to_profile)
        if out_dir is not None:
            write_json(results, out_dir / "bench.json", device)
    if to_profile and progress:
        progress("gap ratios (torch.profiler, after all timing)")
    for result, fn in to_profile:
        profile_gaps(result, fn)
    to_profile.clear()
    if out_dir is not None and results:
        write_json(results, out_dir / "bench.json", device)
    return results


def write_json(results: list[WorkloadResult], path: Path, device: torch.device) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    doc = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "card": card,
           "torch": torch.__version__, "rows": [{"workload": r.workload, "streamfuse_vs_best_other": r.streamfuse_ratio(),
                                                 "modes": {m: asdict(v) for m, v in r.modes.items()}} for r in results]}
    path.write_text(json.dumps(doc, indent=1))
