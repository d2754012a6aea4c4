"""Run benchmark workloads in six modes, side by side, in one process.

Modes: eager, eager captured in a CUDA graph, torch.compile (default), torch.compile
mode="reduce-overhead", streamfuse (streamfuse.compile) and sf-backend (torch.compile(backend=
streamfuse.make_backend(config))). Each mode is checked against eager before it is timed (a wrong
answer is reported as a failure, not a time); a mode that fails is reported, never fatal.
The check (compile, first call, eager reference) runs with TF32 off (`exact_fp32`); what is timed
is built again under the process's defaults where they allow TF32 (compilers and graph captures
bake the setting in when they build). The peers (eager, torch.compile) are then built once, under
the defaults, and not checked. Times: CUDA events around back-to-back calls, warm-up first, median
(profile/timing.py).

The streamfuse modes also report the kernels their plans launch per call, a check at a second
batch size where the workload gives one (`Workload.second_inputs`), and with `cold_cache` the
first compile on a fresh, empty Config.cache_dir and a second compile of a new model object on the
now warm cache, in the same process (so Triton's and torch's in-process caches are warm as well).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import gc
import json
import math
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from streamfuse.bench.timing import describe, guarded, note_warnings, time_interleaved, time_us
from streamfuse.bench.workloads import Workload
from streamfuse.config import Config

MODES = ["eager", "eager+graph", "compile", "compile-ro", "streamfuse", "sf-backend"]
SF_MODES = ("streamfuse", "sf-backend")
CUDA_MODES = ("eager+graph", "compile-ro")
TOLERANCE = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}
NOTES = {
    "max_rel_err": "max|out - ref| / max(max|ref|, rel_floor) per output tensor, worst over outputs; eager is "
                   "the reference; computed with TF32 off (torch.backends.cuda.matmul.allow_tf32 and "
                   "torch.backends.cudnn.allow_tf32 False), times taken with the process's defaults; "
                   "not computed (null) for a peer mode built under defaults that allow TF32",
    "compile_s": "build and first call; for the streamfuse modes with cold_cache, on a fresh empty "
                 "Config.cache_dir per workload and mode, seeded with the device's calibration (measured once per device, "
                 "not per model)",
    "compile_warm_s": "in-process: the same model built again (a new object) and compiled again with the same, "
                      "now warm, cache_dir (for sf-backend after torch._dynamo.reset()); Triton's kernel cache "
                      "and torch's in-process caches are warm too",
    "dynamo_s": "sf-backend: the part of compile_s / compile_warm_s spent in torch.compile's own frame "
                "compilation (Dynamo's bytecode tracing, guards and AOTAutograd's tracing: "
                "torch._dynamo.utils.compile_times '_compile.compile_inner'), which reduce-overhead pays too; "
                "streamfuse's own part is the rest",
    "us_spread": "with interleaved timing (settings.rounds > 1: the modes of a workload timed side by side, "
                 "in rounds, the order rotated each round): (slowest - fastest round's median µs) / us",
    "planned_kernels": "launches in the streamfuse plan(s) per call (CompiledGraph.stats['kernels'], summed over "
                       "the backend's graphs); kernels_per_call is measured by torch.profiler on CUDA",
    "second_batch": "the streamfuse modes called at this other batch size with the same compiled object; "
                    "second_rel_err against eager at that batch",
    "f32_rel_err": "a bfloat16/float16 result of a checked mode over the tolerance from eager's: its error and eager's "
                   "(eager_f32_rel_err) against the same model and inputs in float32 (TF32 off), the result "
                   "nearer the true value; the check passes where streamfuse is at most F32_ERROR_FACTOR (2) times "
                   "farther from it than eager",
}
LOW_PRECISION = (torch.float16, torch.bfloat16)
F32_ERROR_FACTOR = 2.0
"""How much farther than eager's a 16-bit result may be from the float32 model. Eager rounds every
intermediate to 16 bits and a fused kernel rounds where its chain ends, so the two land on different
sides of the true value; PyTorch's own benchmark harness accepts 3x eager's RMSE against float64 for
bfloat16 (torch._dynamo.utils.same), and this check uses max relative error, which is stricter."""


@dataclass
class ModeResult:
    mode: str
    us: float | None = None
    error: str | None = None
    max_rel_err: float | None = None
    kernels_per_call: float | None = None
    gap_ratio: float | None = None
    compile_s: float | None = None
    planned_kernels: int | None = None
    compile_warm_s: float | None = None
    dynamo_s: float | None = None
    dynamo_warm_s: float | None = None
    second_batch: int | None = None
    second_rel_err: float | None = None
    second_error: str | None = None
    us_spread: float | None = None
    """Interleaved timing (run_suite's rounds > 1): (slowest - fastest round's median) / us."""
    fallback: str | None = None
    """A streamfuse mode that ran (part of) the model eagerly: the StreamfuseFallbackWarning's text."""
    f32_rel_err: float | None = None
    eager_f32_rel_err: float | None = None
    """Where a low-precision result was over the tolerance from eager's (at the example batch or the
    second): its error and eager's against the model in float32 (NOTES["f32_rel_err"])."""


@dataclass
class WorkloadResult:
    workload: str
    modes: dict[str, ModeResult] = field(default_factory=dict)

    info: dict[str, Any] = field(default_factory=dict)
    tolerance: float | None = None

    def best_other(self) -> tuple[str, float] | None:
        times = [(m, r.us) for m, r in self.modes.items() if m not in SF_MODES and r.us is not None]
        return min(times, key=lambda t: t[1]) if times else None  # type: ignore[return-value,arg-type]

    def streamfuse_ratio(self) -> float | None:
        best, sf = self.best_other(), self.modes.get("streamfuse")
        if best is None or sf is None or sf.us is None:
            return None
        return best[1] / sf.us

    def ratio(self, mode: str, other: str) -> float | None:
        """Speed-up of `mode` over `other` (other's time / mode's time); None unless both were timed."""
        a, b = self.modes.get(mode), self.modes.get(other)
        if a is None or b is None or a.us is None or b.us is None:
            return None
        return b.us / a.us


def flat_tensors(x: Any) -> list[torch.Tensor]:
    """The tensors in a (nested) output, in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in flat_tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in flat_tensors(v)]
    return []


def rel_error(out: Any, ref: Any, floor: float = 1.0) -> float:
    """max|out - ref| / max(max|ref|, floor), worst over the output tensors (floor 0: the plain ratio)."""
    outs, refs = flat_tensors(out), flat_tensors(ref)
    if len(outs) != len(refs):
        raise AssertionError(f"{len(outs)} outputs, eager has {len(refs)}")
    if refs and not any(bool(r.any()) for r in refs):
        raise AssertionError("eager's outputs are all zeros, so no result could fail this check "
                             "(a zero-initialised last layer? streamfuse.bench.models.nonzero_parameters)")
    worst = 0.0
    for o, r in zip(outs, refs, strict=True):
        if o.shape != r.shape:
            raise AssertionError(f"output of shape {tuple(o.shape)}, eager gave {tuple(r.shape)}")
        if r.numel() == 0:
            continue
        diff = float((o.double() - r.double()).abs().max())
        scale = max(float(r.double().abs().max()), floor)
        worst = max(worst, diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf")))
    return worst


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """TF32 off for cuBLAS and cuDNN (and so for streamfuse's codegen, which reads the flag) inside."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def sf_compile(mode: str, model: Any, inputs: tuple[torch.Tensor, ...], config: Config) -> Callable[..., Any]:
    """A streamfuse mode's compiled callable (same positional tensors as model): streamfuse.compile,
    or torch.compile with the streamfuse backend (compiled lazily, at the first call)."""
    import streamfuse

    if mode == "streamfuse":
        return streamfuse.compile(model, inputs, config)
    if mode == "sf-backend":
        return torch.compile(model, backend=streamfuse.make_backend(config))  # type: ignore[no-any-return]
    raise ValueError(f"not a streamfuse mode: {mode!r}")


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
        if mode == "sf-backend":
            models = [sf_compile(mode, m, x, config) for m, x in zip(models, inputs, strict=True)]
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
        if mode in SF_MODES:
            compiled = sf_compile(mode, model, inputs, config)
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


def tolerance(workload: Workload) -> float:
    return workload.tolerance if workload.tolerance is not None else TOLERANCE.get(workload.dtype, 2e-3)


def judge(result: ModeResult, workload: Workload, err: float, out: Any, ref: Any, model: Any,
          inputs: tuple[Any, ...]) -> str | None:
    """The failure text for a result `err` away from eager's `ref`, or None where it passes: within the
    tolerance, or (bfloat16, float16) over it but at most F32_ERROR_FACTOR times farther than eager
    from the same model computed in float32: in 16 bits eager rounds every intermediate, while a fused
    kernel keeps its chain in float32 and rounds once, so the two differ by eager's own error
    (bert-base bf16 at batch 3: 2.07e-2 from eager, 1.2e-2 from float32 against eager's 1.6e-2 on the
    CPU, session 30)."""
    tol = tolerance(workload)
    if err <= tol:
        return None
    if workload.dtype in LOW_PRECISION and not workload.parallel:
        ours, theirs = float32_errors(model, inputs, out, ref, workload.rel_floor)
        worst = max(ours, result.f32_rel_err or 0.0)
        result.f32_rel_err, result.eager_f32_rel_err = worst, max(theirs, result.eager_f32_rel_err or 0.0)
        if ours <= F32_ERROR_FACTOR * theirs:
            return None
        return (f"wrong result: max relative error {err:.2e} > {tol:.0e}, and {ours:.2e} from float32, over "
                f"{F32_ERROR_FACTOR:g}x eager's {theirs:.2e}")
    return f"wrong result: max relative error {err:.2e} > {tol:.0e}"


def float32_errors(model: Any, inputs: tuple[Any, ...], out: Any, ref: Any, floor: float) -> tuple[float, float]:
    """(`out`'s error, eager `ref`'s error) against the model and its floating inputs in float32."""
    twin = copy.deepcopy(model).float()
    args = [t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs]
    with torch.no_grad(), exact_fp32():
        truth = twin(*args)
    del twin
    return rel_error(out, truth, floor), rel_error(ref, truth, floor)


def run_mode(mode: str, workload: Workload, device: torch.device, config: Config, ref: Any,
             to_profile: list[tuple[ModeResult, Callable[[], Any]]] | None = None, *, gaps: bool = True,
             reps: int | None = None, warm_compile: bool = False, explain_dir: Path | None = None,
             pending: list[tuple[ModeResult, Callable[[], Any]]] | None = None) -> ModeResult:
    """One mode of one workload: compiled, checked against `ref` (TF32 off), timed. On CUDA its gap ratio
    needs torch.profiler, which slows later four-stream graphs in the process (docs/PERF.md session 10),
    so the call is appended to `to_profile` for after the suite's timing (profiled now if None; never
    if not `gaps`). The streamfuse modes then run their extra checks (module docstring). A fallback to
    eager (StreamfuseFallbackWarning) is recorded in `fallback` and reported as a failure. explain_dir:
    the timed build's plans (`explain(source=False)`, every graph of the backend's) are written there,
    one file per workload and streamfuse mode, to compare the two entry points' choices, or two runs'.
    pending: where given, the timing is left to the caller (time_interleaved): the built callable is
    appended to it, and no torch.compile state is reset (that would drop the other modes' builds), so
    `warm_compile` (which must reset it) is the caller's too."""
    result = ModeResult(mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run_mode(result, workload, device, config, ref, to_profile, gaps, reps, warm_compile, explain_dir, pending)
    note_warnings(result, caught)
    return result


def _run_mode(result: ModeResult, workload: Workload, device: torch.device, config: Config, ref: Any,
              to_profile: list[tuple[ModeResult, Callable[[], Any]]] | None, gaps: bool, reps: int | None,
              warm_compile: bool, explain_dir: Path | None,
              pending: list[tuple[ModeResult, Callable[[], Any]]] | None) -> None:
    from streamfuse.capture.backend import compiled_graphs

    mode = result.mode
    # a peer (eager, torch.compile) that would be built twice, checked with TF32 off and timed as built
    # under the defaults, is built once, under the defaults, and not checked: the checks are
    # streamfuse's, and a second Inductor build cost 5-20 s per model on the suite
    retime = retime_with_defaults(workload, device)
    peer_once = mode not in SF_MODES and retime
    try:
        model, inputs = make_seeded(workload, device)
        with torch.no_grad():
            with contextlib.nullcontext() if peer_once else exact_fp32():
                first_graph = len(compiled_graphs)
                dynamo0 = dynamo_seconds()
                t0 = time.perf_counter()
                compiled: Callable[..., Any] | None = None
                if mode in SF_MODES and not workload.parallel:
                    compiled = sf_compile(mode, model, inputs, config)
                    fn = lambda: compiled(*inputs)  # noqa: E731
                else:
                    fn = make_mode(mode, workload, model, inputs, config)
                out = fn()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                result.compile_s = time.perf_counter() - t0
                if mode == "sf-backend":
                    result.dynamo_s = dynamo_seconds() - dynamo0
                result.max_rel_err = None if peer_once else rel_error(out, ref, workload.rel_floor)
                if result.max_rel_err is not None:
                    result.error = judge(result, workload, result.max_rel_err, out, ref, model, inputs)
                del out
            if mode == "streamfuse" and compiled is not None:
                result.planned_kernels = int(compiled.stats.get("kernels") or 0)  # type: ignore[attr-defined]
            elif mode == "sf-backend":
                result.planned_kernels = sum(int(g.stats.get("kernels") or 0) for g in compiled_graphs[first_graph:]
                                             if hasattr(g, "stats"))
            if result.error is not None:
                return
            if compiled is not None and workload.second_inputs is not None:
                check_second_batch(result, workload, model, compiled, device)
            if warm_compile and mode in SF_MODES and pending is None:
                compile_again(result, workload, device, config)
            if retime and not peer_once:
                # compilers and graph captures bake TF32 in when they build (kernel choice, dot precision):
                # what is timed is built again under the process's defaults, as a user would run it (a
                # new backend object, so Dynamo's cache does not answer for it; the reset frees the checked
                # build, and is skipped when interleaving, where it would drop the other modes' builds)
                del fn, compiled
                if mode in ("compile", "compile-ro", "sf-backend") and pending is None:
                    torch._dynamo.reset()
                model, inputs = make_seeded(workload, device)
                first_graph = len(compiled_graphs)
                if mode in SF_MODES and not workload.parallel:
                    compiled = sf_compile(mode, model, inputs, config)
                    fn = lambda: compiled(*inputs)  # noqa: E731
                else:
                    fn = make_mode(mode, workload, model, inputs, config)
                fn()
            if pending is None:
                result.us = time_us(fn, device, reps)
            else:
                pending.append((result, fn))
            if explain_dir is not None and mode in SF_MODES and not workload.parallel:
                plans = [compiled] if mode == "streamfuse" else list(compiled_graphs[first_graph:])
                from streamfuse.profile.outputs import safe_stem

                write_explain(explain_dir / f"{safe_stem(workload.name)}.{mode}.txt", plans)
            if device.type == "cuda" and gaps:
                if to_profile is None:
                    profile_gaps(result, fn)
                else:
                    to_profile.append((result, fn))
    except Exception as exc:  # noqa: BLE001 - a failing mode is reported, not fatal
        result.error = describe(exc)
        result.us = None


def write_explain(path: Path, plans: list[Any]) -> None:
    """The plans a mode timed, as explain() prints them (measured choices included), one after another."""
    texts = [p.explain(source=False) for p in plans if hasattr(p, "explain")]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(texts) if texts else "no streamfuse plan was built (see the mode's error)\n")


def seed_calibration(source: Path, cache_dir: Path, device: torch.device) -> None:
    """A cold cache_dir still knows the device's ceilings: calibration is once per device (measured
    into `source` first), not part of any model's first compile."""
    if device.type != "cuda":
        return
    from streamfuse.tune.ceilings import cache_path, ceilings_for

    ceilings_for(device, source, calibrate=True)  # measured once, then read back
    name = torch.cuda.get_device_name(device)
    path = cache_path(source, name)
    if path.exists():
        target = cache_path(cache_dir, name)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)


def retime_with_defaults(workload: Workload, device: torch.device) -> bool:
    """The mode checked with TF32 off must be built again for timing: a float32 workload on CUDA
    where the process's defaults allow TF32 (for matmuls or convolutions)."""
    return (device.type == "cuda" and workload.dtype == torch.float32
            and (torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32))


def check_second_batch(result: ModeResult, workload: Workload, model: Any, compiled: Callable[..., Any],
                       device: torch.device) -> None:
    """The compiled callable at the workload's second batch size, against eager there (TF32 off)."""
    assert workload.second_inputs is not None
    try:
        with exact_fp32():
            inputs = workload.second_inputs(model, device)
            result.second_batch = int(inputs[0].shape[0])
            ref = model(*inputs)
            out = compiled(*inputs)
            result.second_rel_err = rel_error(out, ref, workload.rel_floor)
            result.second_error = judge(result, workload, result.second_rel_err, out, ref, model, inputs)
    except Exception as exc:  # noqa: BLE001 - reported beside the mode's (valid) time
        result.second_error = describe(exc)


def compile_again(result: ModeResult, workload: Workload, device: torch.device, config: Config) -> None:
    """Seconds to build and call the mode again on a new model object, same (now warm) cache_dir."""
    try:
        if result.mode == "sf-backend":
            torch._dynamo.reset()  # else Dynamo's in-memory cache would answer
        model, inputs = make_seeded(workload, device)
        with exact_fp32():
            dynamo0 = dynamo_seconds()
            t0 = time.perf_counter()
            make_mode(result.mode, workload, model, inputs, config)()
            if device.type == "cuda":
                torch.cuda.synchronize()
            result.compile_warm_s = time.perf_counter() - t0
            if result.mode == "sf-backend":
                result.dynamo_warm_s = dynamo_seconds() - dynamo0
    except Exception as exc:  # noqa: BLE001 - reported beside the mode's (valid) time
        result.second_error = "; ".join(filter(None, [result.second_error, f"warm compile: {describe(exc)}"]))


def dynamo_seconds() -> float:
    """Seconds torch.compile has spent compiling frames in this process so far (Dynamo's tracing and
    guards, AOTAutograd, and the backend's own compile function: streamfuse's binds lazily, at the
    first call, so what it does is almost all outside this figure)."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    return sum(float(v) for n, v in zip(names, values, strict=True) if n == "_compile.compile_inner")


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
    with torch.no_grad(), exact_fp32():
        if workload.parallel:
            return [m(x) for m, x in zip(model, inputs, strict=True)]
        return model(*inputs)


def run_suite(workloads: list[Workload], modes: list[str], device: torch.device, config: Config,
              out_dir: Path | None = None, progress: Callable[[str], None] | None = None, *,
              cold_cache: bool = False, gaps: bool = True, reps: int | None = None,
              settings: dict[str, Any] | None = None,
              finished: Callable[[WorkloadResult], None] | None = None,
              explain_dir: Path | None = None, rounds: int = 1) -> list[WorkloadResult]:
    """Every mode of every workload; bench.json rewritten after each workload when out_dir is given.

    cold_cache: the streamfuse modes compile on a fresh, empty cache_dir per workload and mode, then
    once more on it warm (ModeResult.compile_warm_s). gaps: measure kernels per call and gap ratios with
    torch.profiler on CUDA (after all timing; that keeps every mode's compiled callable alive until the
    end). reps: timed calls per mode (time_us's default if None). settings: recorded in the JSON.
    finished: called with each workload's row as soon as its modes have run. explain_dir: run_mode's.
    rounds: above 1, a workload's modes are all built first and then timed side by side in that many
    rounds (time_interleaved), torch.compile's state reset only as each workload starts; 1 times each
    mode as soon as it is built, one mode after another."""
    if rounds < 1:
        raise ValueError(f"rounds: expected a positive number of timing rounds, got {rounds}")
    results: list[WorkloadResult] = []
    to_profile: list[tuple[ModeResult, Callable[[], Any]]] = []
    cold_root = Path(tempfile.mkdtemp(prefix="streamfuse-bench-cold-")) if cold_cache else None
    try:
        for index, workload in enumerate(workloads):
            row = WorkloadResult(workload.name, info=dict(workload.info), tolerance=tolerance(workload))
            results.append(row)
            try:
                ref = reference(workload, device)
            except Exception as exc:  # noqa: BLE001 - e.g. torchvision missing
                for mode in modes:
                    row.modes[mode] = ModeResult(mode, error=f"workload unavailable: {describe(exc)}"[:300])
                ref = None
            pending: list[tuple[ModeResult, Callable[[], Any]]] | None = [] if rounds > 1 else None
            configs: dict[str, Config] = {}
            if pending is not None:
                torch._dynamo.reset()
            for mode in modes:
                if progress:
                    progress(f"{workload.name}: {mode}")
                if ref is None:
                    continue
                if mode in ("compile", "compile-ro", "sf-backend") and pending is None:
                    torch._dynamo.reset()
                if device.type != "cuda" and mode in CUDA_MODES:
                    row.modes[mode] = ModeResult(mode, error="needs CUDA")
                    continue
                mode_config = config
                if cold_root is not None and mode in SF_MODES:
                    mode_config = config.replace(cache_dir=cold_root / f"{index}-{mode}")
                    seed_calibration(config.cache_dir, mode_config.cache_dir, device)
                configs[mode] = mode_config
                row.modes[mode] = run_mode(mode, workload, device, mode_config, ref, to_profile, gaps=gaps, reps=reps,
                                           warm_compile=cold_root is not None, explain_dir=explain_dir,
                                           pending=pending)
            if pending:
                if progress:
                    progress(f"{workload.name}: timing {len(pending)} modes side by side")
                with torch.no_grad():  # as run_mode times: inference, as a user runs it
                    time_interleaved(pending, device, reps, rounds)
                    if cold_root is not None:  # after the timing: it resets torch.compile's state
                        for result, _ in pending:
                            if result.mode in SF_MODES and result.error is None:
                                again = functools.partial(compile_again, result, workload, device, configs[result.mode])
                                guarded(result, again)
                pending.clear()
            ref = None
            # (the registry holds graphs weakly: they go with their workload)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if out_dir is not None:
                write_json(results, out_dir / "bench.json", device, settings)
            if finished is not None:
                finished(row)
        if to_profile and progress:
            progress("gap ratios (torch.profiler, after all timing)")
        with torch.no_grad():  # the calls run_mode timed
            for result, fn in to_profile:
                profile_gaps(result, fn)
        to_profile.clear()
    finally:
        if cold_root is not None:
            shutil.rmtree(cold_root, ignore_errors=True)
    if out_dir is not None and results:
        write_json(results, out_dir / "bench.json", device, settings)
    return results


def geomean_vs(results: list[WorkloadResult], mode: str, other: str = "compile-ro") -> dict[str, tuple[float, int]]:
    """Geometric mean of `mode`'s speed-up over `other` per batch kind (info["batch_kind"]: "batch 1",
    "throughput"; "all" for rows without one), with the number of workloads where both were timed."""
    by_kind: dict[str, list[float]] = {}
    for r in results:
        ratio = r.ratio(mode, other)
        if ratio is not None and ratio > 0:
            by_kind.setdefault(str(r.info.get("batch_kind", "all")), []).append(ratio)
    return {kind: (math.exp(sum(map(math.log, v)) / len(v)), len(v)) for kind, v in by_kind.items()}


def write_json(results: list[WorkloadResult], path: Path, device: torch.device,
               settings: dict[str, Any] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    rows = [{"workload": r.workload, **({"info": r.info} if r.info else {}), "tolerance": r.tolerance,
             "streamfuse_vs_best_other": r.streamfuse_ratio(),
             "streamfuse_vs_reduce_overhead": r.ratio("streamfuse", "compile-ro"),
             "backend_vs_reduce_overhead": r.ratio("sf-backend", "compile-ro"),
             "modes": {m: asdict(v) for m, v in r.modes.items()}} for r in results]
    geomeans = {f"{mode}_vs_reduce_overhead": {kind: {"geomean": g, "workloads": n}
                                                for kind, (g, n) in geomean_vs(results, mode).items()}
                for mode in SF_MODES}
    doc = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "card": card,
           "torch": torch.__version__, **({"settings": settings} if settings else {}), "notes": NOTES,
           "geomeans": geomeans, "rows": rows}
    path.write_text(json.dumps(doc, indent=1))

