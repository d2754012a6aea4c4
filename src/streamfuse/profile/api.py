"""`streamfuse.profile()`: profile whatever runs inside the block (eager PyTorch, torch.compile
output, streamfuse), and `predict()`: the same report from the cost model, without a GPU.

    with streamfuse.profile("my model", calls=20) as prof:
        for _ in range(20):
            model(x)
    prof.report          # ProfileReport: gap ratio, per stream, per kernel, NVML samples, advice
    prof.print()         # terminal summary
    prof.save("out/")    # trace JSON (one lane per stream), PNG timeline, HTML report, JSON
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from streamfuse.profile.known import kernel_info
from streamfuse.profile.report import CEILINGS, Ceilings, DeviceSample, KernelInfo, ProfileReport, build_report


class Profile:
    """Filled in when the `with streamfuse.profile(...)` block ends."""

    def __init__(self, label: str):
        self.label = label
        self.report: ProfileReport | None = None

    def print(self) -> None:
        from rich.console import Console

        from streamfuse.profile.outputs import render_summary

        assert self.report is not None, "the profile block has not finished"
        Console().print(render_summary(self.report))

    def save(self, out_dir: str | Path, stem: str | None = None) -> dict[str, Path]:
        from streamfuse.profile.outputs import save_report

        assert self.report is not None, "the profile block has not finished"
        return save_report(self.report, Path(out_dir), stem)


def device_ceilings(name: str) -> Ceilings:
    for key, ceilings in CEILINGS.items():
        if key in name:
            return ceilings
    return CEILINGS["H200"]


@contextmanager
def profile(label: str = "run", calls: int = 1, nvml: bool = True, sample_ms: float = 5.0) -> Iterator[Profile]:
    """Profile the GPU work issued inside the block (CUDA only; `calls` says how many calls the block
    makes, for per-call figures)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    if not torch.cuda.is_available():
        raise RuntimeError("streamfuse.profile() measures a GPU and none is present; "
                           "streamfuse.predict(compiled) gives the cost model's predicted report instead")
    result = Profile(label)
    sampler = _NvmlSampler(sample_ms / 1e3) if nvml else None
    torch.cuda.synchronize()
    if sampler:
        sampler.start()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield result
        torch.cuda.synchronize()
    samples = sampler.stop() if sampler else []
    intervals = _intervals(prof)
    name = torch.cuda.get_device_name()
    info = {n: i for n in {iv.name for iv in intervals} if (i := kernel_info(n)) is not None}
    result.report = build_report(label, name, intervals, predicted=False, calls=calls,
                                 ceilings=device_ceilings(name), info=info, samples=samples)


def predict(compiled: Any, gpu: str = "H200", calls: int = 1, label: str | None = None,
            eager: bool = False) -> ProfileReport:
    """The report a GPU would give, predicted by the cost model on the plan's streams. With
    eager=True, model eager PyTorch instead: the same graph unfused, one stream, Python launches."""
    from streamfuse.sim.timeline import EAGER_LAUNCH_US, predict_intervals

    if gpu not in CEILINGS:
        raise ValueError(f"gpu must be one of {sorted(CEILINGS)}, got {gpu!r}")
    ceilings = CEILINGS[gpu]
    if eager:
        import streamfuse

        compiled = streamfuse.CompiledGraph(_unfused(compiled), compiled.call)
        intervals = predict_intervals(compiled, ceilings, calls, launch_us=EAGER_LAUNCH_US, one_stream=True)
    else:
        intervals = predict_intervals(compiled, ceilings, calls)
    info = _plan_info(compiled)
    return build_report(label or ("eager" if eager else "streamfuse"), ceilings.name, intervals, predicted=True,
                        calls=calls, ceilings=ceilings, info=info)


def _plan_info(compiled: Any) -> dict[str, KernelInfo]:
    """Bytes and flops per kernel, from the plan's shapes (what the predicted intervals are named by)."""
    from streamfuse.schedule.cost import group_bytes, group_flops
    from streamfuse.sim.timeline import kernel_name

    return {kernel_name(compiled, g): KernelInfo(bytes=group_bytes(g), flops=group_flops(g))
            for g in compiled.plan.groups if g.launches}


def _unfused(compiled: Any) -> Any:
    from streamfuse.runtime.executable import build_executable

    base = compiled.base
    return build_executable(base.graph, base.config.replace(fuse=False, max_streams=1, executor="reference"),
                            base.device)


def _intervals(prof: Any) -> list[Any]:
    import json
    import tempfile

    from streamfuse.profile.timeline import intervals_from_trace

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return intervals_from_trace(json.loads(path.read_text()))


class _NvmlSampler:
    """GPU utilization, SM clock and memory in use, sampled on a thread through NVML."""

    def __init__(self, period_s: float):
        self.period_s = period_s
        self.samples: list[DeviceSample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            import torch

            from streamfuse.profile.busy import nvml_device

            self._nvml, self._handle = nvml_device(torch.cuda.current_device())
        except Exception:  # noqa: BLE001 - no NVML (or no permission): report without samples
            return
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        nv = self._nvml
        while not self._stop.is_set():
            try:
                util = nv.nvmlDeviceGetUtilizationRates(self._handle).gpu
                clock = nv.nvmlDeviceGetClockInfo(self._handle, nv.NVML_CLOCK_SM)
                mem = nv.nvmlDeviceGetMemoryInfo(self._handle).used / 2**20
            except Exception:  # noqa: BLE001
                return
            self.samples.append(DeviceSample(time.perf_counter() - self._t0, float(util), float(clock), float(mem)))
            self._stop.wait(self.period_s)

    def stop(self) -> list[DeviceSample]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        return self.samples
