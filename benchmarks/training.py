"""One training step (forward, backward, SGD update) side by side in one process: eager, torch.compile
(Inductor, default mode) and `torch.compile(backend="streamfuse")` — issue 16's benchmark.

    python benchmarks/training.py [--models resnet18,resnet50,bert-base,gpt2] [--steps 20] [--json FILE]
    python benchmarks/training.py --tiny          # one-layer text configs on any machine (a smoke test)

Per model and mode: milliseconds per step (median over `--steps`, after eight warm-up steps that
compile and record graphs), first-step seconds (compile included), peak memory of a step (CUDA's max
allocated during the timed steps, model and optimizer state included; and max reserved, which also
counts what CUDA graphs keep in their pools between replays; the warm-up's own peak is in the JSON,
`warmup_peak_mib`); "step MiB" is the peak over what was allocated before the mode built its timed
model (the reference gradients, and anything the mode's own gradient check left allocated, which is
printed apart); "step+pools" adds the free blocks of CUDA graphs' private pools to "step MiB" (a
graph writes them on every replay, and with Config.training_shared_pool the forward's saved
activations lie there), the footprint to compare with eager's "step MiB"; and the check: after seven
forward + backward calls
from the same weights on the same batch (so the backend's CUDA graphs are replaying), every
parameter's gradient against eager's (relative norm; float32 with TF32 off for the check, TF32 as the
process's defaults for the timing) and against eager in float64. A mode whose gradients are further
from float64's than max(1e-3, twice eager float32's own error) is reported as a failure, not a time
(run 60: resnet50's worst gradient was 2-3% from eager float32's for Inductor and streamfuse alike,
so float32 against float32 cannot tell a bug from rounding there; float64 is the arbiter). Mode sf-nograph is the backend with Config.backend_cuda_graphs=False.

Workloads (random weights, fixed seeds): resnet18 at batch 16 (64x64), resnet50 at batch 32
(224x224; mobilenet_v3_small, efficientnet_b0 and googlenet the same, on request, dropout off), BERT-base and GPT-2 small at 8 x 128 tokens; the loss is cross-entropy on random labels
(vision) or the model's output projected on a fixed random direction (text: the whole network's
backward either way).
Vision models need torchvision (the device machine has it).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from streamfuse.bench.models import nonzero_parameters  # noqa: E402 - after the path
from streamfuse.bench.runner import exact_fp32  # noqa: E402 - after the path
from streamfuse.runtime.fallback import failure_text  # noqa: E402

MODES = ("eager", "compile", "streamfuse", "sf-nograph")
WARMUP_STEPS = 8
"""Steps before the timed ones: the backend's training graphs record by the sixth call, so the
timed steps and their peak memory are the steady state (the warm-up's peak is reported apart)."""
CHECK_STEPS = 7
"""Forward and backward calls before the gradients are compared: the backend's training graphs
record their CUDA graphs at about the fourth (forward) and sixth (backward) call, so the last
gradients come from replayed graphs."""
GRAD_RTOL = 1e-3


@dataclass
class Workload:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.device, int], tuple[torch.Tensor, ...]]
    """(device, seed) -> the step's inputs (the last one is the vision label)."""
    loss: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]


def _vision(name: str, batch: int, size: int) -> Workload:
    def build() -> nn.Module:
        import torchvision

        kwargs = {"aux_logits": False, "init_weights": True} if name == "googlenet" else {}
        return deterministic(getattr(torchvision.models, name)(weights=None, num_classes=1000, **kwargs))

    def inputs(device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(seed)
        return (torch.randn(batch, 3, size, size, generator=gen).to(device),
                torch.randint(0, 1000, (batch,), generator=gen).to(device))

    return Workload(f"{name} b{batch} {size}x{size}", build, inputs,
                    lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))


def _text(name: str, tiny: bool) -> Workload:
    from streamfuse.bench.models import MODELS

    spec = next(s for s in MODELS if s.name == name)
    batch, tokens = (2, 16) if tiny else (8, 128)

    def build() -> nn.Module:
        return deterministic(spec.build(tiny))  # the check compares gradients

    def inputs(device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(seed)
        vocab = 256 if tiny else 30000
        return (torch.randint(0, vocab, (batch, tokens), generator=gen).to(device),)

    return Workload(f"{name.split()[0]} b{batch}x{tokens}", build, inputs, _projected_loss)


def deterministic(model: nn.Module) -> nn.Module:
    """Dropout and stochastic depth off (p = 0; attention dropout rates kept as float attributes, such
    as SDPA's dropout_p, too): a mask drawn by another generator would make gradients differ. And no
    parameter left all zeros (nonzero_parameters: a zero head makes every other gradient 0)."""
    nonzero_parameters(model)
    for m in model.modules():
        if "Dropout" in type(m).__name__ or type(m).__name__ == "StochasticDepth":
            m.p = 0.0  # type: ignore[assignment]
        for key, value in vars(m).items():
            if ("drop" in key or key == "stochastic_depth_prob") and isinstance(value, float):
                setattr(m, key, 0.0)
    return model


def _projected_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The output against a fixed random direction (not its mean square: a model ending in a
    LayerNorm has a mean square of ~1 whatever its weights, so every gradient would be noise)."""
    out = model(batch[0])
    out = out.float() if out.dtype in (torch.float16, torch.bfloat16) else out
    key = (tuple(out.shape), out.device, out.dtype)
    direction = _DIRECTIONS.get(key)
    if direction is None:  # drawn once: GPT-2's logits hold 51 M values (CPU randn ~0.4 s per step in run 64)
        direction = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device, out.dtype)
        _DIRECTIONS[key] = direction
    return (out * direction).mean()


_DIRECTIONS: dict[tuple[Any, ...], torch.Tensor] = {}
_CHECKED: list[weakref.ref[nn.Module]] = []
"""The gradient checks' models: one still alive after the check is reported (its memory would count)."""


def workloads(names: list[str], tiny: bool) -> list[Workload]:
    table: dict[str, Callable[[], Workload]] = {
        "resnet18": lambda: _vision("resnet18", 16, 64),
        "resnet50": lambda: _vision("resnet50", 32, 224),
        "mobilenet_v3_small": lambda: _vision("mobilenet_v3_small", 32, 224),
        "efficientnet_b0": lambda: _vision("efficientnet_b0", 32, 224),
        "googlenet": lambda: _vision("googlenet", 32, 224),
        "bert-base": lambda: _text("bert-base", tiny),
        "gpt2": lambda: _text("gpt2 prefill", tiny),
        "roberta-base": lambda: _text("roberta-base", tiny),
        "distilbert": lambda: _text("distilbert", tiny),
        "t5": lambda: _text("t5-small encoder", tiny),
    }
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"error: --models takes {', '.join(table)}; got {', '.join(unknown)}")
    return [table[n]() for n in names]


SETTINGS: list[str] = []
"""Config fields (NAME=VALUE, --set) for the streamfuse modes."""
COMPILE_OPTIMIZER: list[bool] = [False]
"""--compile-optimizer: the compiled modes compile the optimizer step too, each with its own compiler."""


def wrap(mode: str, model: nn.Module) -> Callable[..., Any]:
    import streamfuse

    if mode == "compile":
        return torch.compile(model)  # type: ignore[return-value]
    if mode in ("streamfuse", "sf-nograph"):
        return torch.compile(model, backend=streamfuse.make_backend(mode_config(mode)))  # type: ignore[return-value]
    return model


def mode_config(mode: str) -> Any:
    """The streamfuse.Config of a backend mode: --set's settings; sf-nograph without CUDA graphs
    (before/after for runtime/replay.py)."""
    import streamfuse

    return streamfuse.Config(backend_cuda_graphs=mode != "sf-nograph").with_settings(SETTINGS)


def optimizer_step(mode: str, opt: torch.optim.Optimizer) -> Callable[[], Any]:
    """The optimizer's step as `mode` runs it: eager's (foreach) unless --compile-optimizer, where the
    compiled modes compile it with their own compiler (README: `torch.compile(optimizer.step,
    backend="streamfuse")`; the `_foreach_*` updates then run as a few fused kernels)."""
    import streamfuse

    if not COMPILE_OPTIMIZER[0] or mode == "eager":
        return opt.step
    if mode == "compile":
        return torch.compile(opt.step)  # type: ignore[return-value]
    return torch.compile(opt.step, backend=streamfuse.make_backend(mode_config(mode)))  # type: ignore[return-value]


def seeded(w: Workload, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return w.build().to(device).train()


def gradients(w: Workload, mode: str, device: torch.device, calls: int = 1, dtype: torch.dtype = torch.float32
              ) -> dict[str, torch.Tensor]:
    """Gradients of the loss at the seeded weights, from the last of `calls` forward + backward calls
    (float64: eager in double precision, the reference both float32 runs are measured against)."""
    model = seeded(w, device).to(dtype)
    _CHECKED.append(weakref.ref(model))
    fn = wrap(mode, model)
    batch = tuple(t.to(dtype) if t.is_floating_point() else t for t in w.batch(device, 1))
    for _ in range(calls):
        model.zero_grad(set_to_none=True)
        w.loss(fn, batch).backward()  # type: ignore[arg-type]
    return {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """The relative norm error ||got - want|| / ||want||."""
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def worst_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Worst relative norm error over the parameters whose gradient is not ~0 (1e-8 of the largest
    gradient norm: exactly zero ones, such as a bias before a training batch-norm, are rounding noise)."""
    largest = max(r.norm() for r in want.values())
    errors = {n: relative(got[n], g) for n, g in want.items() if n in got and g.norm() > 1e-8 * largest}
    name = max(errors, key=errors.__getitem__)
    return errors[name], name


def run_mode(w: Workload, mode: str, device: torch.device, steps: int, reference: dict[str, torch.Tensor],
             exact: dict[str, torch.Tensor], eager_error: float, profile: bool = False) -> dict[str, Any]:
    """`profile`: after timing, one more step under torch.profiler (the GPU kernels of a step)."""
    result: dict[str, Any] = {"mode": mode}
    torch._dynamo.reset()
    try:
        if mode != "eager" and reference:  # --no-check passes no reference
            with exact_fp32():
                got = gradients(w, mode, device, CHECK_STEPS)
            worst, where = worst_error(got, reference)
            result["grad_rel_err"] = worst
            result["grad_err_fp64"], where64 = worst_error(got, exact)
            missing = set(reference) ^ set(got)
            # the bar: eager's own float32 error against float64, or 1e-3 if that is smaller (issue 16)
            bar = max(GRAD_RTOL, 2 * eager_error)
            if missing or result["grad_err_fp64"] > bar:
                result["error"] = (f"gradients off: worst relative norm error {result['grad_err_fp64']:.2e} against "
                                   f"float64 eager ({where64}), over {bar:.1e} (eager float32: {eager_error:.1e}); "
                                   f"{worst:.2e} against float32 eager ({where})"
                                   + (f"; missing for {sorted(missing)[:3]}" if missing else ""))
                return result
            torch._dynamo.reset()
            gc.collect()  # the check's graphs (and their pools) go before the timed model is built
            if device.type == "cuda":
                torch.cuda.empty_cache()
        _DIRECTIONS.clear()  # the checks' directions (GPT-2's float64 one: 412 MB) are not the timed mode's memory
        if device.type == "cuda":
            # what is allocated before the timed model exists: the reference gradients (float32 and
            # float64) in every mode, and whatever the mode's own gradient check left behind. The
            # step's own memory is the peak over this (run 68: "before" differed by 0.2-2.7 GB between
            # modes, most of it not held by the timed model's graphs)
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            result["start_mib"] = torch.cuda.memory_allocated(device) / 2**20
            result["start_reserved_mib"] = torch.cuda.memory_reserved(device) / 2**20
            result["check_models_alive"] = sum(r() is not None for r in _CHECKED)
        model = seeded(w, device)
        fn = wrap(mode, model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        update = optimizer_step(mode, opt)
        batch = w.batch(device, 2)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            w.loss(fn, batch).backward()  # type: ignore[arg-type]
            update()

        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        step()
        sync(device)
        result["first_step_s"] = time.perf_counter() - start
        for _ in range(WARMUP_STEPS - 1):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
            # the warm-up's peak: compiles, and the backend recording its CUDA graphs (a warm-up run
            # beside the previous step's buffers), once per process
            result["warmup_peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(steps):
            sync(device)
            start = time.perf_counter()
            step()
            sync(device)
            times.append(time.perf_counter() - start)
        result["ms_per_step"] = 1000 * statistics.median(times)
        if device.type == "cuda":
            result["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
            result["step_mib"] = result["peak_mib"] - result["start_mib"]
            # a CUDA graph's temporaries stay reserved in its pool between replays: reserved memory
            # is the fair comparison for a mode that replays graphs
            result["reserved_mib"] = torch.cuda.max_memory_reserved(device) / 2**20
            # reserved against reserved (both count the allocator's free blocks, fragmentation
            # included), where "step+pools" sets our pools' free blocks against eager's allocated
            # bytes: the timed steps' peak reservation over what was reserved before the model existed
            result["step_reserved_mib"] = result["reserved_mib"] - result["start_reserved_mib"]
            # a graph pool's free blocks are not "allocated", yet the graph writes them on every replay
            # (with Config.training_shared_pool the forward's saved activations lie in blocks the
            # backward's capture freed): the step's footprint counts the private pools whole
            private = [seg for seg in torch.cuda.memory_snapshot()
                       if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)]
            pool_total = sum(seg["total_size"] for seg in private)
            pool_free = pool_total - sum(seg["allocated_size"] for seg in private)
            result["graph_pools_mib"] = pool_total / 2**20
            result["step_footprint_mib"] = result["step_mib"] + pool_free / 2**20
            # which streams' blocks the pools hold (a freed block is reused only on its own stream)
            by_stream: dict[str, list[float]] = {}
            for seg in private:
                row = by_stream.setdefault(f"{seg['stream']:#x}", [0.0, 0.0])
                row[0] += seg["total_size"] / 2**20
                row[1] += (seg["total_size"] - seg["allocated_size"]) / 2**20
            result["graph_pools_by_stream_mib"] = {k: {"total": v[0], "free": v[1]} for k, v in by_stream.items()}
            try:  # diagnostics: a failure here must not cost the mode its measured row
                if profile:
                    import streamfuse
                    from streamfuse.profile.outputs import summary_text

                    with streamfuse.profile(mode, calls=1, nvml=False) as prof:
                        step()
                    assert prof.report is not None
                    result["gpu_profile"] = summary_text(prof.report, top=15, per="step")
                result["memory_phases"] = memory_phases(lambda: w.loss(fn, batch), opt, device, update)
                if mode == "streamfuse":
                    result["graph_memory"] = graph_memory()
                    result["graph_history"] = graph_history()
            except Exception as exc:  # noqa: BLE001
                result["diagnostics_error"] = failure_text(exc)
    except Exception as exc:  # noqa: BLE001 - a failing mode is reported, not fatal
        result["error"] = failure_text(exc)
    finally:
        torch._dynamo.reset()
    return result


def graph_memory() -> list[dict[str, Any]]:
    """What each live training graph of the backend keeps between steps (runtime/pinned.PinnedGraph.memory),
    in MiB: where a mode's peak above eager's sits."""
    from streamfuse.capture.backend import compiled_graphs
    from streamfuse.runtime.replay import ReplayGraph

    rows = []
    for g in compiled_graphs:
        for instance in (g.graph, g.spare) if isinstance(g, ReplayGraph) else ():
            if instance is None:
                continue
            held = instance.memory()
            rows.append({"role": g.role + (" (second instance)" if instance is g.spare else ""),
                         "recordings": g.replay_stats.recordings,
                         **{k: (v / 2**20 if k in ("handed_out", "copied_out", "input_buffers", "reserved_block") else v)
                            for k, v in held.items()}})
    return rows


def memory_phases(loss: Callable[[], torch.Tensor], opt: torch.optim.Optimizer, device: torch.device,
                  update: Callable[[], Any]) -> dict[str, float]:
    """MiB allocated after each phase of one more step (where a mode's peak above eager's comes from)."""
    def mib() -> float:
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device) / 2**20

    opt.zero_grad(set_to_none=True)  # as each timed step starts (the last one left its gradients)
    phases = {"before": mib()}
    torch.cuda.reset_peak_memory_stats(device)
    value = loss()
    phases["after forward"] = mib()
    phases["forward peak"] = torch.cuda.max_memory_allocated(device) / 2**20
    torch.cuda.reset_peak_memory_stats(device)
    value.backward()
    del value
    phases["after backward"] = mib()
    phases["backward peak"] = torch.cuda.max_memory_allocated(device) / 2**20
    update()  # the mode's optimizer step (optimizer_step)
    phases["after step"] = mib()
    opt.zero_grad(set_to_none=True)
    phases["after zero_grad"] = mib()
    return phases


def graph_history() -> list[str]:
    """Each live training graph's replay summary and history (records, moves, re-observations)."""
    from streamfuse.capture.backend import compiled_graphs
    from streamfuse.runtime.replay import ReplayGraph

    return [g.explain(source=False).split("\nstreamfuse plan")[0] for g in compiled_graphs if isinstance(g, ReplayGraph)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet18,resnet50,bert-base,gpt2")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="one-layer text configs, short sequences (CPU smoke test)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--profile", action="store_true",
                    help="after timing, one more step per mode under torch.profiler: kernels, GPU busy time, top kernels")
    ap.add_argument("--history", action="store_true", help="print each backend training graph's replay history and each mode's memory by phase")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a Config field for the streamfuse modes (e.g. training_shared_pool=false)")
    ap.add_argument("--compile-optimizer", action="store_true",
                    help="the compiled modes compile the SGD step too (each with its own compiler; eager keeps foreach SGD)")
    ap.add_argument("--no-check", action="store_true",
                    help="skip the gradient checks (nothing allocated before the timed model: with one mode per "
                         "process, its 'step reserved' line is the step's whole reservation, the allocator's free blocks included)")
    args = ap.parse_args()
    SETTINGS[:] = args.set
    COMPILE_OPTIMIZER[0] = args.compile_optimizer
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"error: --modes takes {', '.join(MODES)}; got {args.modes!r}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    rows = []
    print(f"training step (forward + backward + SGD{', the SGD step compiled in the compiled modes' if args.compile_optimizer else ''})"
          f" on {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}")
    print(f"{'workload':<24} {'mode':<11} {'ms/step':>9} {'vs eager':>9} {'vs compile':>11} {'peak MiB':>9} {'step MiB':>9} "
          f"{'rsrvd MiB':>9} {'step+pools':>10} "
          f"{'grad err':>9} {'vs fp64':>9} {'1st step s':>10}")
    for w in workloads(names, args.tiny):
        reference: dict[str, torch.Tensor] = {}
        exact: dict[str, torch.Tensor] = {}
        eager_error = 0.0
        try:
            if not args.no_check:
                with exact_fp32():
                    reference = gradients(w, "eager", device)
                    exact = gradients(w, "eager", device, dtype=torch.float64)
        except ImportError as exc:
            print(f"{w.name:<24} unavailable: {exc}")
            continue
        if reference:
            eager_error, where = worst_error(reference, exact)
            print(f"{w.name:<24} eager float32 gradients against float64: worst relative norm error {eager_error:.1e} "
                  f"({where})")
        results = [run_mode(w, m, device, args.steps, reference, exact, eager_error, args.profile) for m in modes]
        base = {r["mode"]: r.get("ms_per_step") for r in results}
        for r in results:
            ms = r.get("ms_per_step")

            def ratio(other: str) -> str:
                b = base.get(other)
                return f"{b / ms:.2f}x" if ms and b else "-"

            cells = [f"{ms:9.2f}" if ms else f"{'-':>9}", f"{ratio('eager'):>9}", f"{ratio('compile'):>11}",
                     f"{r['peak_mib']:9.0f}" if "peak_mib" in r else f"{'-':>9}",
                     f"{r['step_mib']:9.0f}" if "step_mib" in r else f"{'-':>9}",
                     f"{r['reserved_mib']:9.0f}" if "reserved_mib" in r else f"{'-':>9}",
                     f"{r['step_footprint_mib']:10.0f}" if "step_footprint_mib" in r else f"{'-':>10}",
                     f"{r['grad_rel_err']:9.1e}" if "grad_rel_err" in r else f"{'-':>9}",
                     f"{r['grad_err_fp64']:9.1e}" if "grad_err_fp64" in r else f"{'-':>9}",
                     f"{r['first_step_s']:10.1f}" if "first_step_s" in r else f"{'-':>10}"]
            print(f"{w.name:<24} {r['mode']:<11} " + " ".join(cells)
                  + (f"  FAILED: {r['error']}" if "error" in r else ""))
            start = r.get("start_mib")
            eager_start = next((e.get("start_mib") for e in results if e["mode"] == "eager"), None)
            if start is not None and eager_start is not None and start - eager_start > 1:
                print(f"{'':<24}   {start - eager_start:.0f} MiB more allocated than in eager's mode before the timed "
                      f"model was built (left over from this mode's gradient check; {r.get('check_models_alive')} "
                      "checked model(s) still alive)")
            if args.history and r.get("memory_phases"):
                print(f"{'':<24}   MiB allocated: start {start or 0:.0f}, "
                      + ", ".join(f"{k} {v:.0f}" for k, v in r["memory_phases"].items()))
            if "gpu_profile" in r:
                print("\n".join(f"{'':<24}   {line}" for line in r["gpu_profile"].splitlines()))
            for text in r.get("graph_history", []) if args.history else []:
                print("\n".join(f"{'':<24}   {line}" for line in text.splitlines()[:12]))
            for g in r.get("graph_memory", []):
                print(f"{'':<24}   {g['role']} graph keeps {g['handed_out']:.0f} MiB handed out, {g['copied_out']:.0f} "
                      f"MiB copied out; {g['input_buffers']:.0f} MiB of copied inputs land in its pool ({g['inputs_read_in_place']} "
                      f"inputs read in place, {g['inputs_copied']} copied; {g['recordings']} recording(s))"
                      + ("; forward and backward share one pool, so the handed-out bytes overlap" if g.get("shares_pool") else "")
                      + (f"; took a {g['reserved_block']:.0f} MiB block first" if g.get("reserved_block", 0) > 0 else ""))
            if (args.history or args.no_check) and "step_reserved_mib" in r:
                print(f"{'':<24}   step reserved {r['step_reserved_mib']:.0f} MiB (peak reserved during the timed steps "
                      "over reserved before the model was built; includes the allocator's free blocks)")
            if args.history and r.get("graph_pools_by_stream_mib"):
                print(f"{'':<24}   graph pools by stream (MiB total/free): " + ", ".join(
                    f"{k} {v['total']:.0f}/{v['free']:.0f}" for k, v in r["graph_pools_by_stream_mib"].items()))
            rows.append({"workload": w.name, **r})
    if args.json is not None:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
