"""Device ceilings: the best this GPU does at moving bytes, multiplying matrices and launching kernels.

Every estimate in streamfuse divides work by these numbers (schedule/cost.py, sim/, profile/ reports).
Datasheet rates are only leads, so on a GPU `measure()` runs a few seconds of microbenchmarks and
`ceilings_for()` keeps the result on disk, one JSON file per device name, and in memory. Without a
GPU (CI, predicting on a laptop) the built-in table stands in.

The built-in H200 row holds GPU_FACTS.md's measured figures, which `measure()` is compared against:
copy ~4.23 TB/s (read + written), bf16 8192³ matmul ~771 TFLOP/s, eager launch ~9.6 µs per op, kernel
inside a replayed CUDA graph ~1.1 µs. On that H200 `measure()` gave (2026-11-30, torch 2.11): copy
4.17-4.19 TB/s, float32 51.4, float16 650-770, bf16 645-800 TFLOP/s, eager launch 7.5-11.9 µs, graph
kernel 1.0-1.17 µs, in 1.5 s. The matmul spread is the clock: under sustained tensor-core load the SM
clock falls from 1980 to ~1500 MHz within a quarter second (bf16 800 -> ~670 TFLOP/s, at about half
the power limit), so a few warm-up calls time the burst rate and a longer warm-up the sustained one.
measure() warms each benchmark up for WARMUP_S and so reports the sustained rate: within ~5% run to
run, where the burst rate depends on how long the GPU sat idle before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import os
import re
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streamfuse.profile.timing import recording
from streamfuse.tune.progress import progress_bar

FORMAT = 1
"""Version of the cache file's layout; a file of another version is ignored (and re-measured)."""

MATMUL_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16,
                                         "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DeviceCeilings:
    """One device's measured (or tabled) limits."""

    name: str
    """torch.cuda.get_device_name(), e.g. "NVIDIA H200"."""
    arch: str
    """Compute capability as "sm_90"."""
    sm_count: int
    copy_gbps: float
    """Device-to-device copy: (bytes read + bytes written) / s / 1e9."""
    matmul_tflops: dict[str, float]
    """Dense cuBLAS matmul rate per dtype ("float32", "float16", "bfloat16"), TFLOP/s. float32 runs
    with torch's matmul precision setting as found (TF32 off by default)."""
    launch_us: float
    """Per small kernel launched eagerly from PyTorch, launch to launch (host-bound)."""
    graph_kernel_us: float
    """Per small kernel inside a replayed CUDA graph."""
    source: str
    """"built-in table" or "measured on <device> at <ISO time>"."""

    def bytes_per_us(self) -> float:
        return self.copy_gbps * 1e3

    def flops_per_us(self, dtype: torch.dtype) -> float:
        """The matmul rate for `dtype` in flop/µs; float32's for dtypes not measured (what a kernel
        computing in float32 registers, as Triton does for half types' pointwise math, gets)."""
        key = str(dtype).removeprefix("torch.")
        rate = self.matmul_tflops.get(key, self.matmul_tflops["float32"])
        return rate * 1e6


# H200: GPU_FACTS.md (copy, bf16 matmul, both launch costs); float32 as measured by measure() on the
# same machine (51.4 TFLOP/s at 4096³, TF32 off, flat from 2048³ to 8192³); float16 as bf16 (measured
# alike: 770 at burst clocks, like GPU_FACTS' bf16 figure).
# H100 and A100: datasheet-level leads, not measured here (copy ≈ what HBM reaches of its peak, matmul ≈
# what cuBLAS reaches of the dense peak; launch costs are host-bound, as on the H200). Run
# `streamfuse calibrate` on such a card for its real figures.
BUILTIN: dict[str, DeviceCeilings] = {
    "H200": DeviceCeilings("NVIDIA H200", "sm_90", 132, 4230.0,
                           {"float32": 51.0, "float16": 771.0, "bfloat16": 771.0}, 9.6, 1.1, "built-in table"),
    "H100": DeviceCeilings("NVIDIA H100 SXM", "sm_90", 132, 3000.0,
                           {"float32": 51.0, "float16": 700.0, "bfloat16": 700.0}, 9.6, 1.1, "built-in table"),
    "A100": DeviceCeilings("NVIDIA A100 SXM", "sm_80", 108, 1750.0,
                           {"float32": 19.0, "float16": 280.0, "bfloat16": 280.0}, 9.6, 1.5, "built-in table"),
}


def builtin_for(name: str | None) -> DeviceCeilings:
    """The table row whose key the device name contains ("NVIDIA H100 80GB HBM3" -> H100); H200 otherwise."""
    upper = (name or "").upper()
    for key, ceilings in BUILTIN.items():
        if key in upper:
            return ceilings
    return BUILTIN["H200"]


# ------------------------------------------------------------------------------------------- cache


def cache_path(cache_dir: Path, device_name: str) -> Path:
    """cache_dir/calibration/<device name with anything but letters, digits, '.', '-' made '_'>.json."""
    safe = re.sub(r"[^A-Za-z0-9.-]+", "_", device_name).strip("_") or "unknown"
    return Path(cache_dir) / "calibration" / f"{safe}.json"


def to_json(c: DeviceCeilings) -> dict[str, Any]:
    return {"format": FORMAT, **dataclasses.asdict(c)}


def from_json(data: Any) -> DeviceCeilings | None:
    """The ceilings a cache file holds, or None when it is not a complete file of this FORMAT."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None
    try:
        rates = data["matmul_tflops"]
        if not isinstance(rates, dict) or set(rates) != set(MATMUL_DTYPES):
            return None
        c = DeviceCeilings(
            name=_typed(data["name"], str), arch=_typed(data["arch"], str), sm_count=_typed(data["sm_count"], int),
            copy_gbps=_positive(data["copy_gbps"]), matmul_tflops={k: _positive(v) for k, v in rates.items()},
            launch_us=_positive(data["launch_us"]), graph_kernel_us=_positive(data["graph_kernel_us"]),
            source=_typed(data["source"], str))
    except (KeyError, TypeError, ValueError):
        return None
    return c


def load_cached(path: Path) -> DeviceCeilings | None:
    """The ceilings cached at `path`; None when it is missing, unreadable, corrupt or of an old format."""
    try:
        return from_json(json.loads(Path(path).read_text()))
    except (OSError, ValueError):
        return None


def save(path: Path, c: DeviceCeilings) -> None:
    """Write atomically (temp file + rename): processes calibrating at once never leave half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(to_json(c), f, indent=2)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _typed(value: Any, kind: type) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(f"expected {kind.__name__}, got {value!r}")
    return value


def _positive(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"expected a positive number, got {value!r}")
    return float(value)


# ------------------------------------------------------------------------------- lookup with memo

_MEMO: dict[tuple[str, bool], DeviceCeilings] = {}
_LOCK = threading.Lock()


def ceilings_for(device: torch.device | None, cache_dir: Path, calibrate: bool) -> DeviceCeilings:
    """The ceilings to plan with for `device`: on CUDA the cached measurement, else a fresh one
    (written to the cache) when `calibrate`, else the built-in row for the device's name; on CPU or
    None the built-in H200 row (what predictions assume). Remembered per process: repeated calls are free."""
    if device is None or torch.device(device).type != "cuda":
        return builtin_for(None)
    device = torch.device(device)
    name = torch.cuda.get_device_name(device)
    path = cache_path(cache_dir, name)
    key = (str(path), calibrate)
    with _LOCK:
        if key in _MEMO:
            return _MEMO[key]
        found = load_cached(path)
        if found is None and calibrate:
            found = measure(device)
            with contextlib.suppress(OSError):  # a read-only cache dir costs a re-measure next process
                save(path, found)
        if found is None:
            found = builtin_for(name)
        _MEMO[key] = found
        return found


# ---------------------------------------------------------------------------------- measurement

COPY_BYTES = 256 * 2**20
"""Size of the copied tensor: far past the 50 MB L2, so the copy streams through HBM."""
MATMUL_SIZES = {"float32": 4096, "float16": 8192, "bfloat16": 8192}
"""Square sizes at which cuBLAS is on its plateau (a 4096³ float32 product already runs ~3 ms)."""
TINY_KERNELS = 200
"""Kernels per timed batch of tiny launches (and per captured graph)."""
WARMUP_S = 0.2
"""Seconds each microbenchmark runs before it is timed (module loads, cuBLAS handles, clocks)."""


def measure(device: torch.device, progress: bool = True) -> DeviceCeilings:
    """Microbenchmark `device` (a few seconds): copy bandwidth, cuBLAS matmul rate per dtype, eager
    launch cost, per-kernel cost inside a replayed CUDA graph. Each figure is the median of several
    repetitions after a warm-up, timed with CUDA events."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"measure() needs a CUDA device, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    props = torch.cuda.get_device_properties(device)
    steps: list[tuple[str, Callable[[], float]]] = [
        ("copy bandwidth", _copy_gbps),
        *((f"{key} matmul", functools.partial(_matmul_tflops, MATMUL_DTYPES[key], MATMUL_SIZES[key]))
          for key in MATMUL_DTYPES),
        ("eager launches", _eager_launch_us),
        ("CUDA graph launches", _graph_kernel_us),
    ]
    figures: dict[str, float] = {}
    with torch.cuda.device(device), progress_bar(progress, f"calibrating {name}", len(steps)) as step:
        for label, bench in steps:
            step(label)
            figures[label] = bench()
            torch.cuda.synchronize()
    return DeviceCeilings(
        name=name, arch=f"sm_{props.major}{props.minor}", sm_count=props.multi_processor_count,
        copy_gbps=figures["copy bandwidth"],
        matmul_tflops={key: figures[f"{key} matmul"] for key in MATMUL_DTYPES},
        launch_us=figures["eager launches"], graph_kernel_us=figures["CUDA graph launches"],
        source=f"measured on {name} at {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}")


def _median_ms(fn: Callable[[], None], reps: int = 20, warmup_s: float = WARMUP_S) -> float:
    """Median over `reps` of the GPU time of one fn() call, bracketed by CUDA events; calls are
    issued back to back (no sync in between), so the queue never drains between repetitions.
    The warm-up runs for a while rather than a few calls: an idle GPU's clocks take tens of
    milliseconds to rise (three warm-up matmuls left the bf16 rate 10% low on an H200)."""
    start_s = time.perf_counter()
    calls = 0
    while calls < 2 or time.perf_counter() - start_s < warmup_s:
        fn()
        torch.cuda.synchronize()
        calls += 1
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def _copy_gbps(inner: int = 10) -> float:
    src = torch.randn(COPY_BYTES // 4, device="cuda")
    dst = torch.empty_like(src)

    def copies() -> None:
        for _ in range(inner):
            dst.copy_(src)

    ms = _median_ms(copies)
    return 2 * COPY_BYTES * inner / (ms * 1e-3) / 1e9


def _matmul_tflops(dtype: torch.dtype, n: int) -> float:
    a = torch.randn(n, n, device="cuda", dtype=dtype)  # random data: zeros run measurably faster
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    out = torch.empty(n, n, device="cuda", dtype=dtype)
    ms = _median_ms(lambda: torch.mm(a, b, out=out))
    return 2 * n**3 / (ms * 1e-3) / 1e12


def _eager_launch_us() -> float:
    """Tiny out-of-place ops issued from Python as eager code does (allocation included); the GPU
    finishes each long before the next arrives, so the events measure the host's launch-to-launch time."""
    x = torch.randn(256, device="cuda")

    def launches() -> None:
        for _ in range(TINY_KERNELS):
            torch.add(x, 1.0)

    return _median_ms(launches) * 1e3 / TINY_KERNELS


def _graph_kernel_us(replays: int = 10) -> float:
    """TINY_KERNELS tiny kernels captured in one CUDA graph, replayed back to back: GPU time per kernel."""
    x = torch.randn(256, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture, as torch.cuda.graphs advises
        for _ in range(3):
            x.add_(1.0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with recording(graph, thread_local=False):
        for _ in range(TINY_KERNELS):
            x.add_(1.0)

    def replay() -> None:
        for _ in range(replays):
            graph.replay()

    return _median_ms(replay) * 1e3 / (replays * TINY_KERNELS)
