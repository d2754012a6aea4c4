"""Autotuning of the matmul template's tile (block sizes, warps, pipeline stages), and the
measured strategy choice of `Config.profile_guided`.

Each candidate tile (codegen/matmul.candidate_tiles) is compiled and timed on random inputs of the
real shapes and strides, replayed from a CUDA graph (profile/timing.time_graph_us). A
candidate that fails to compile, runs out of resources, spills registers or disagrees with the
heuristic tile's results scores as infinitely slow instead of raising. Tuning stops at
`Config.autotune_budget_s` per kernel. Results persist in
`cache_dir/autotune.json`, keyed by device, kernel source hash (which encodes shapes, strides,
dtypes and the epilogue) and tile space, so a model is tuned once per machine.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from streamfuse.codegen.cache import compile_ahead
from streamfuse.codegen.kernel import KernelSource, generate, use_pdl
from streamfuse.codegen.matmul import MatmulTile, candidate_tiles, heuristic_tile, with_tile
from streamfuse.config import Config
from streamfuse.fusion.groups import Group, GroupKind, Plan
from streamfuse.fusion.legality import matmul_dims
from streamfuse.fusion.planner import plan_fusion
from streamfuse.fusion.strategy import MatmulChoice, choose_matmuls, decide, emulates_float32
from streamfuse.ir.graph import Graph, Node
from streamfuse.profile.timing import time_concurrent_us, time_graph_us
from streamfuse.runtime.steps import NodeStep, ensure_allocator
from streamfuse.tune.ceilings import DeviceCeilings
from streamfuse.tune.progress import progress_bar

CACHE_FILE = "autotune.json"
_memo: dict[Path, dict[str, Any]] = {}


def random_operand(node: Node, device: torch.device) -> torch.Tensor:
    """A random tensor with the node's shape, dtype and strides (never zeros)."""
    assert node.dtype is not None
    span = 1 + sum((s - 1) * st for s, st in zip(node.shape, node.strides, strict=True) if s > 0)
    # drawn on the CPU with a private generator: the device's default generator may be registered
    # with a CUDA-graph capture (or have failed one), and tuning must not move the user's RNG state
    gen = torch.Generator().manual_seed(span)
    if node.dtype.is_floating_point:
        base = torch.randn(span, generator=gen, dtype=torch.float32).to(node.dtype)
    else:
        base = torch.randint(1, 7, (span,), generator=gen).to(node.dtype)
    return base.to(device).as_strided(node.shape, node.strides)


def kernel_args(source: KernelSource, device: torch.device) -> list[Any]:
    """Arguments for one launch of `source`: random inputs (with their strides) and fresh outputs."""
    args: list[Any] = []
    for node, dims in zip(source.inputs, source.input_stride_dims, strict=True):
        t = random_operand(node, device)
        args.append(t)
        args.extend(t.stride(d) for d in dims)
    args.extend(source.output_tensors(device))
    return args + ([1234, 0] if source.rng else [])


# how far a candidate tile's results may move from the heuristic tile's (summation order differs)
AGREE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


SPILLED = "registers spilled"
"""time_tile's note for a tile that ran but spilled (scored inf; its results are there to check)."""


def time_tile(kernel: Any, source: KernelSource, args: list[Any], expected: list[torch.Tensor] | None,
              copies: int = 1, why: list[str] | None = None) -> float:
    """Median µs of one launch with `source`'s tile, replayed from a CUDA graph (GPU time without the
    host's launch cost, which would otherwise swamp small kernels and make the ranking noise); inf
    if it cannot compile, run, spills, or computes something else than `expected` (the heuristic
    tile's outputs): never a wrong fast tile. With `copies` > 1: µs for that many launches at once,
    each on its own stream with its own outputs and scratch (the kernel as the stream plan runs it,
    sharing the GPU)."""

    device = next(a for a in args if isinstance(a, torch.Tensor)).device
    if source.descriptors and device.type == "cuda":
        ensure_allocator()

    def launcher(launch_args: list[Any]) -> Callable[[], Any]:
        scratch = source.scratch_tensors(device)
        return lambda: kernel[source.grid](*launch_args, *scratch, num_warps=source.num_warps,
                                           num_stages=source.num_stages, launch_pdl=source.pdl, **source.constexprs)

    launch = launcher(args)
    note = why.append if why is not None else (lambda text: None)
    try:
        compiled = launch()
        if getattr(compiled, "n_spills", 0):
            note(f"{compiled.n_spills} {SPILLED}")
            return math.inf
        if expected is not None and not _agrees(_outputs(source, args), expected):
            note("results differ from the heuristic tile's")
            return math.inf
        if copies > 1:
            return time_concurrent_us([launch] + [launcher(_fresh_outputs(source, args)) for _ in range(copies - 1)])
        return time_graph_us(launch)
    except Exception as exc:  # noqa: BLE001 - a failing candidate scores as infinitely slow, by design
        note(f"{type(exc).__name__}: {str(exc).strip()[:300]}")
        return math.inf


# how far the heuristic tile's results may move from torch's on the same inputs, as a norm relative to
# torch's: rounding (TF32 or the dtype's own products, another summation order) stays far below it; an
# indexing bug does not (the split bias read at the tile's row, session 61: 2-60% on random operands)
DISAGREE = {torch.float64: 1e-6, torch.float32: 1e-2, torch.float16: 2e-2, torch.bfloat16: 4e-2}


def reference_disagreement(group: Group, source: KernelSource, args: list[Any],
                           outputs: list[torch.Tensor]) -> str | None:
    """How `outputs` (one launch of `source` on `args`) differ from the group's ops run through torch
    on the same inputs, or None where they agree (or no reference can be computed: random numbers
    drawn in the kernel, an op that cannot run alone)."""
    if source.rng:
        return None
    inputs = [a for a in args if isinstance(a, torch.Tensor)][:len(source.inputs)]
    slot = {n: i for i, n in enumerate([*source.inputs, *group.nodes])}
    env: list[Any] = [*inputs, *([None] * len(group.nodes))]
    try:
        NodeStep(group, slot).run(env)
        expected = [env[slot[n]] for n in source.outputs]
    except Exception:  # noqa: BLE001 - no reference is not a disagreement
        return None
    for node, got, want in zip(source.outputs, outputs, expected, strict=True):
        if not isinstance(want, torch.Tensor) or want.shape != got.shape:
            return None
        want64, got64 = want.double(), got.double()
        if not bool(torch.isfinite(want64).all()):
            continue
        # relative to torch's norm, with a floor of 1e-3 RMS (an output all but zero in both)
        err = float((got64 - want64).norm() / want64.norm().clamp_min(1e-3 * want64.numel() ** 0.5))
        if not err <= DISAGREE.get(want.dtype, 1e-2):  # NaN included
            return f"computes %{node.name} {err:.2g} away from torch (relative norm) on random inputs"
    return None


def _fresh_outputs(source: KernelSource, args: list[Any]) -> list[Any]:
    """`args` with new output tensors (the inputs shared)."""
    outs = {id(t) for t in _outputs(source, args)}
    return [torch.empty_like(a) if id(a) in outs else a for a in args]


def _outputs(source: KernelSource, args: list[Any]) -> list[torch.Tensor]:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return tensors[len(source.inputs):]


def _agrees(got: list[torch.Tensor], expected: list[torch.Tensor]) -> bool:
    for g, e in zip(got, expected, strict=True):
        tol = AGREE.get(e.dtype, 0.0)
        if not torch.allclose(g.float(), e.float(), rtol=tol, atol=tol, equal_nan=True):
            return False
    return True


@dataclass
class TuneJob:
    """One template kernel to tune: its group, source and loaded @triton.jit function; `concurrency`
    and `give_up_us` as tune_matmul's."""

    group: Group
    source: KernelSource
    kernel: Any
    concurrency: int = 1
    give_up_us: float = math.inf
    disagrees: str | None = None
    """Set by tuning where the checked tile's results (the heuristic tile's wherever it ran, else the
    first candidate's that ran: `_checked`) differ from torch's on the same random inputs
    (`reference_disagreement`): the kernel is wrong and must not run (the caller runs the group
    through torch, or through cuBLAS where the choice is still open)."""


@dataclass
class _Tuning:
    """A job not found in the cache, while it is tuned."""

    index: int
    job: TuneJob
    tiles: list[MatmulTile]
    key: str
    args: list[Any] = field(default_factory=list)
    reference: KernelSource | None = None
    expected: list[torch.Tensor] | None = None
    reference_failures: list[str] = field(default_factory=list)


def tune_matmul(group: Group, source: KernelSource, kernel: Any, config: Config, device: torch.device,
                progress: bool = True, concurrency: int = 1, give_up_us: float = math.inf) -> tuple[KernelSource, float]:
    """The fastest tile for this kernel (from the disk cache when known) and its time in µs; with
    `concurrency` > 1, the fastest when that many copies run at once (time_tile's `copies`). Where the
    heuristic tile alone takes more than `give_up_us`, that tile and its time (nothing tuned or cached)."""
    return tune_matmuls([TuneJob(group, source, kernel, concurrency, give_up_us)], config, device, progress)[0]


def tune_matmuls(jobs: list[TuneJob], config: Config, device: torch.device,
                 progress: bool = True) -> list[tuple[KernelSource, float]]:
    """tune_matmul for several kernels at once: each kernel's heuristic tile is compiled in one
    parallel pool, timed, and the kernels still worth tuning have all their candidate tiles compiled
    in one more pool (Config.compile_threads threads over every kernel's candidates, not a pool per
    kernel whose last wave leaves threads idle), then timed one kernel after another. Jobs with the
    same source and tile space (a model's repeated layers) are tuned once."""
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    found: list[tuple[MatmulTile, float] | None] = [None] * len(jobs)
    pending: dict[str, _Tuning] = {}
    same: list[tuple[int, str]] = []  # (job, key of the job tuned for it)
    for i, job in enumerate(jobs):
        tiles = candidate_tiles(job.group, config, sm_count)
        key = _key(job.source, tiles, device) + (f"|x{job.concurrency}" if job.concurrency > 1 else "")
        cached = load_cache(config.cache_dir).get(key)
        if cached is not None:
            found[i] = MatmulTile(*cached["tile"]), float(cached["us"])
        elif key in pending:
            same.append((i, key))
        else:
            pending[key] = _Tuning(i, job, tiles, key)
    if pending:
        with unset_fake_temporarily():  # real tensors, even when torch.compile traces with fake ones
            _tune(list(pending.values()), found, config, device, sm_count, progress)
    for i, key in same:
        found[i] = found[pending[key].index]
        jobs[i].disagrees = pending[key].job.disagrees
    results = []
    for job, hit in zip(jobs, found, strict=True):
        assert hit is not None
        results.append((with_tile(job.source, job.group, hit[0]), hit[1]))
    return results


def tune_plan(plan: Plan, sources: dict[int, KernelSource], concurrency: dict[int, int], config: Config,
              device: torch.device, load: Callable[[KernelSource], Any]) -> set[int]:
    """Every template kernel of `plan` tuned (tune_matmuls; a kernel the stream plan runs beside
    others timed beside copies of itself, Config.autotune_concurrency), its tuned source put in
    `sources`. Returns the ids of the groups whose kernel disagreed with torch (TuneJob.disagrees),
    each with a note: those must run through torch."""
    tuned = [(i, g) for i, g in enumerate(plan.groups) if g.kind is GroupKind.MATMUL]
    jobs = [TuneJob(g, sources[g.id], load(sources[g.id]), concurrency.get(i, 1) if config.autotune_concurrency else 1)
            for i, g in tuned]
    wrong = set()
    for (_, g), job, (source, _) in zip(tuned, jobs, tune_matmuls(jobs, config, device), strict=True):
        sources[g.id] = source
        if job.disagrees is not None:
            wrong.add(g.id)
            g.note = f"runs through torch: the generated kernel {job.disagrees}"
    return wrong


def _tune(pending: list[_Tuning], found: list[tuple[MatmulTile, float] | None], config: Config,
          device: torch.device, sm_count: int, progress: bool) -> None:
    total = sum(len(t.tiles) for t in pending)
    label = f"tuning {pending[0].job.group.name}" if len(pending) == 1 else f"tuning {len(pending)} matmuls"
    with progress_bar(progress and total > 1, label, total) as step:
        for t in pending:
            t.args = kernel_args(t.job.source, device)
            t.reference = with_tile(t.job.source, t.job.group, heuristic_tile(t.job.group, config, sm_count))
        step(f"compiling {len(pending)} heuristic tiles", 0)
        _compile([(t.job.kernel, t.reference, t.args) for t in pending], device, config.compile_threads)
        tuned: list[_Tuning] = []
        for t in pending:
            assert t.reference is not None
            # why a heuristic tile scored inf goes into the cache entry (run 99: one spilled registers)
            reference_us = time_tile(t.job.kernel, t.reference, t.args, None, why=t.reference_failures)
            # checked against torch wherever it ran, spilled too (run 231: a spilled heuristic tile left
            # the template unchecked; were every tile to spill, the heuristic one would run)
            ran = math.isfinite(reference_us) or any(SPILLED in why for why in t.reference_failures)
            if ran and not _checked(t, t.reference):  # a code generation bug: no tile of this source may run
                found[t.index] = heuristic_tile(t.job.group, config, sm_count), math.inf
                step(f"{t.job.group.name}: disagrees with torch", len(t.tiles))
                continue
            if math.isfinite(reference_us) and reference_us > t.job.give_up_us:
                # not worth tuning: the heuristic tile, uncached
                found[t.index] = heuristic_tile(t.job.group, config, sm_count), reference_us
                step(f"{t.job.group.name}: not tuned", len(t.tiles))
                continue
            tuned.append(t)
        step(f"compiling {sum(len(t.tiles) for t in tuned)} candidate tiles", 0)
        _compile([(t.job.kernel, with_tile(t.job.source, t.job.group, tile), t.args)
                  for t in tuned for tile in t.tiles], device, config.compile_threads)
        for t in tuned:
            found[t.index] = _time_tiles(t, config, sm_count, step)
            t.args, t.expected = [], None  # their memory back before the next kernel's timings


def _checked(t: _Tuning, source: KernelSource) -> bool:
    """The results of `source`'s last launch on `t.args` become the tiles' reference (`t.expected`),
    once checked against torch (reference_disagreement); False, with a warning and the job marked
    (TuneJob.disagrees), where they disagree: the template is wrong in every tile, nothing is cached."""
    t.expected = [x.clone() for x in _outputs(source, t.args)]
    wrong = reference_disagreement(t.job.group, source, t.args, t.expected)
    if wrong is None:
        return True
    t.job.disagrees = wrong
    warnings.warn(f"streamfuse: the generated kernel of {t.job.group.name} {wrong}; it does not run (please "
                  "report this as a bug)", RuntimeWarning, stacklevel=3)
    return False


def _compile(kernels: list[tuple[Any, KernelSource, list[Any]]], device: torch.device, threads: int) -> None:
    """Each (kernel, source with a tile, arguments) compiled ahead in one pool."""
    compile_ahead([(kernel, args + source.scratch_tensors(device), source.grid,
                    {"num_warps": source.num_warps, "num_stages": source.num_stages, "launch_pdl": source.pdl,
                     **source.constexprs}) for kernel, source, args in kernels], device, threads)


def _time_tiles(t: _Tuning, config: Config, sm_count: int,
                step: Callable[..., None]) -> tuple[MatmulTile, float]:
    """Every candidate tile of `t` timed (until Config.autotune_budget_s), the fastest cached."""
    job = t.job
    results: dict[MatmulTile, float] = {}
    start = time.perf_counter()
    for n, tile in enumerate(t.tiles):
        if time.perf_counter() - start > config.autotune_budget_s:
            break
        step(str(tile))
        source = with_tile(job.source, job.group, tile)
        results[tile] = time_tile(job.kernel, source, t.args, t.expected, job.concurrency)
        # the heuristic tile did not run (it failed to compile or launch): the first tile that runs is
        # checked against torch and becomes the reference of the others
        if t.expected is None and math.isfinite(results[tile]) and not _checked(t, source):
            step(f"{job.group.name}: disagrees with torch", len(t.tiles) - n - 1)
            return heuristic_tile(job.group, config, sm_count), math.inf
    best = min(results, key=results.__getitem__)
    if math.isinf(results[best]):
        # nothing compiled: keep the heuristic tile, whose launch will raise the real error
        return heuristic_tile(job.group, config, sm_count), math.inf
    store_cache(config.cache_dir, t.key, {
        "tile": [best.block_m, best.block_n, best.block_k, best.num_warps, best.num_stages, best.group_m,
                 best.split_k],
        "us": results[best], "tried": {str(k): (None if math.isinf(v) else v) for k, v in results.items()},
        "problem": [*matmul_dims(job.group.contraction), job.group.contraction.itemsize],
        **({"heuristic_failed": t.reference_failures} if t.reference_failures else {})})
    return best, results[best]


def time_aten(node: Node, device: torch.device) -> float:
    """Median µs of the contraction alone through ATen (cuBLAS) on random operands, replayed from a
    CUDA graph as the template's tiles are."""
    with unset_fake_temporarily():
        args = [random_operand(a, device) if isinstance(a, Node) else a for a in node.args]
        fn: Callable[[], Any] = lambda: node.target(*args, **node.kwargs)
        return time_graph_us(fn)


def aten_us(node: Node, config: Config, device: torch.device) -> float:
    """time_aten, cached on disk per device, op, operand shapes and strides, dtype and TF32 setting."""
    operands = ";".join(f"{a.shape}{a.strides}" if isinstance(a, Node) else repr(a) for a in node.args)
    key = (f"{torch.cuda.get_device_name(device)}|aten|{node.op}|{operands}|{node.dtype}"
           f"|tf32={torch.backends.cuda.matmul.allow_tf32}")
    cached = load_cache(config.cache_dir).get(key)
    if cached is None:
        cached = {"us": time_aten(node, device)}
        store_cache(config.cache_dir, key, cached)
    return float(cached["us"])


def measure_choices(graph: Graph, config: Config, ceilings: DeviceCeilings, device: torch.device,
                    load: Callable[[KernelSource], Any]) -> dict[Node, MatmulChoice]:
    """Config.profile_guided: each supported contraction timed both ways on this GPU. The template
    is planned with its epilogue, tuned and timed; cuBLAS is timed alone, plus the cost model's
    epilogue kernel (bytes / bandwidth + one launch in a graph)."""
    modelled = choose_matmuls(graph, config, ceilings)
    # the planner follows each choice's strategy: plan with the template forced to get its groups
    forced = config.replace(matmul_strategy="triton")
    plan = plan_fusion(graph, forced, choose_matmuls(graph, forced, ceilings))
    return {**modelled, **_measure(plan, modelled, config, ceilings, device, load)}


def check_templates(plan: Plan, choices: dict[Node, MatmulChoice], config: Config, ceilings: DeviceCeilings,
                    device: torch.device, load: Callable[[KernelSource], Any]
                    ) -> tuple[dict[Node, MatmulChoice], bool]:
    """Config.check_templates: the products `plan` runs in the template by prediction, tuned as
    planned and timed against cuBLAS alone plus the modelled epilogue. Returns the choices with
    those measured decisions in, and whether any went to cuBLAS (the plan must be made again)."""
    predicted = {g.contraction for g in plan.groups if g.contraction is not None
                 and choices[g.contraction].strategy == "triton" and not choices[g.contraction].measured}
    if config.matmul_strategy != "auto" or not predicted:
        return choices, False
    measured = _measure(plan, choices, config, ceilings, device, load, only=predicted)
    return {**choices, **measured}, any(m.strategy != "triton" for m in measured.values())


def _measure(plan: Plan, modelled: dict[Node, MatmulChoice], config: Config, ceilings: DeviceCeilings,
             device: torch.device, load: Callable[[KernelSource], Any],
             only: set[Node] | None = None) -> dict[Node, MatmulChoice]:
    """For each template group of `plan` (whose contraction is in `only`, if given): the template
    tuned and timed with its epilogue against cuBLAS alone plus the modelled epilogue kernel."""
    constants = plan.graph.constant_nodes()
    groups = [g for g in plan.groups if g.contraction is not None and (only is None or g.contraction in only)]
    cublas_us = {g.contraction: aten_us(g.contraction, config, device) for g in groups}
    jobs = []
    for group in groups:
        node = group.contraction
        source = generate(group, config, "cuda", ceilings.sm_count, use_pdl(config, device), constants)
        # checking a prediction: a template far behind cuBLAS with its untuned tile is not tuned
        give_up = (math.inf if only is None
                   else config.check_templates_give_up * (cublas_us[node] + modelled[node].epilogue_us))
        jobs.append(TuneJob(group, source, load(source), give_up_us=give_up))
    timed = tune_matmuls(jobs, config, device)
    return {g.contraction: decide(cublas_us[g.contraction], modelled[g.contraction].epilogue_us, triton_us,
                                  measured=True, has_epilogue=len(g.nodes) > 1, config=config,
                                  alone_ok=emulates_float32(g.contraction, config))
            for g, (_, triton_us) in zip(groups, timed, strict=True)}


def _key(source: KernelSource, tiles: list[MatmulTile], device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    space = ";".join(str(t) for t in tiles)
    return f"{name}|{source.fn_name}|{_digest(space)}"


def _digest(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:12]


def load_cache(cache_dir: Path) -> dict[str, Any]:
    path = cache_dir / CACHE_FILE
    if path not in _memo:
        try:
            data = json.loads(path.read_text())
            _memo[path] = data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            _memo[path] = {}
    return _memo[path]


def store_cache(cache_dir: Path, key: str, value: dict[str, Any]) -> None:
    path = cache_dir / CACHE_FILE
    data = load_cache(cache_dir)
    data[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache only costs re-tuning next time
