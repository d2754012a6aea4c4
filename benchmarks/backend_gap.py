"""Why a backend call can take longer than its host time plus nothing: the GPU time per call of
torch.compile(backend="streamfuse") beside streamfuse.compile, at batch 1, with the same plan.

Session 48's suite (H200, bf16) timed googlenet's backend at 1.78x and mobilenet_v3_small's at 1.83x of
streamfuse.compile, while their host times per call (~235-330 µs against ~80) stayed under the backend's
time per call: a call that waited for the GPU would add its host time to the GPU's, and back-to-back
calls would not overlap. For each model this prints, per entry point:
  - µs per call with CUDA events over back-to-back calls (as the suite times) and the host µs per call
    in short bursts (profile/timing.host_us_per_call);
  - the host µs per call over the same back-to-back loop (no synchronize inside it): close to the
    events' time means the host paced the GPU, or waited for it;
  - the bound plan called alone with the call's dynamic arguments (no Dynamo, no AOTAutograd);
  - the state of each StaticParamsGraph (folded, live, rebinds, copied outputs);
  - a torch.profiler pass last (it slows the process afterwards: benchmarks/host_in_process.py): the
    CUDA runtime calls made per call (a cudaStreamSynchronize, cudaEventSynchronize or blocking
    cudaMemcpy would show the wait), the GPU's busy time per call and the idle time between kernels.
CUDA only.

    python benchmarks/backend_gap.py --models googlenet,mobilenet_v3_small --dtype bfloat16 [--second-batch]

--second-batch makes the first call and one at batch 3 with TF32 off, as the suite's check does, before the
calls timed under the process's defaults: Dynamo then holds a graph with a symbolic batch and compiles the
batch-1 graph again for the TF32 flags it guards. The suite's backend rows (runs 174 and 180, bf16 batch 1)
were 1.8-2.4x of streamfuse.compile where this script without the flag measured 0.99-1.05x (run 181).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import streamfuse
from streamfuse.profile.timing import host_us_per_call, time_cuda_us


def loop_host_us(fn: Callable[[], Any], calls: int = 100) -> float:
    """Host µs per call over `calls` back-to-back calls with no synchronize inside the loop."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return host


def row(label: str, fn: Callable[[], Any]) -> None:
    fn()
    us = time_cuda_us(fn, reps=50)
    print(f"  {label:<34} {us:8.1f} µs per call (events)  {host_us_per_call(fn):8.1f} µs host (bursts)  "
          f"{loop_host_us(fn):8.1f} µs host (back to back)", flush=True)


def graph_state(compiled: Any) -> str:
    """Whether a bound plan replays a CUDA graph, and why not."""
    stats = compiled.stats
    return (f"graph instances {stats.get('graph_instances')}, outputs copied {stats.get('outputs_copied')}; graph "
            f"skip {compiled.graph_skip!r}, capture failure {compiled.graph_failure!r}, use_graphs {compiled.use_graphs}")


def runtime_calls(label: str, fn: Callable[[], Any], calls: int = 20) -> None:
    """CUDA runtime calls per call and the GPU's busy and idle time per call, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    from streamfuse.profile.timeline import Interval, span, union_length

    api: dict[str, list[float]] = {}
    kernels: list[Interval] = []
    for e in prof.events():
        name = e.name
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append(Interval(name, 0, e.time_range.start, e.time_range.end))
        elif name.startswith(("cuda", "cu")) and not name.startswith("cudaGetDevice"):
            api.setdefault(name, []).append(e.time_range.end - e.time_range.start)
    busy = union_length(kernels)
    idle = span(kernels) - busy
    print(f"    {label}: GPU busy {busy / calls:.1f} µs per call, idle between kernels {idle / calls:.1f} µs "
          f"per call ({len(kernels) / calls:.0f} GPU activities per call)")
    for name, durations in sorted(api.items(), key=lambda kv: -sum(kv[1])):
        print(f"      {len(durations) / calls:6.1f} per call  {sum(durations) / calls:8.1f} µs per call  {name}")


def measure(name: str, dtype: torch.dtype, profile: bool, second_batch: bool) -> None:
    import torchvision

    from streamfuse.capture.backend import StaticParamsGraph, compiled_graphs

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)().eval().to("cuda", dtype)
    x = torch.randn(1, 3, 224, 224, device="cuda").to(dtype)
    print(f"{name} b1 {str(dtype).removeprefix('torch.')}", flush=True)
    with torch.no_grad():
        sf = streamfuse.compile(model, (x,))
        torch._dynamo.reset()
        before = len(compiled_graphs)
        backend = torch.compile(model, backend="streamfuse")
        if second_batch:  # as the suite does: the first call and one at batch 3 with TF32 off (exact_fp32),
            # the timed calls under the process's defaults (Dynamo guards the TF32 flags: it compiles again)
            from streamfuse.bench.runner import exact_fp32

            with exact_fp32():
                backend(x)
                backend(torch.randn(3, 3, 224, 224, device="cuda").to(dtype))
        backend(x)
        mine = [p for g in compiled_graphs[before:] for p in ([g] if isinstance(g, StaticParamsGraph) else
                                                               getattr(g, "plans", {}).values())
                if isinstance(p, StaticParamsGraph)]
        print(f"  {len(compiled_graphs) - before} graph(s) from Dynamo, {len(mine)} with bound parameters", flush=True)
        seen: list[list[Any]] = []
        for g in mine:
            original = g.run_flat

            def spy(args: list[Any], _g: StaticParamsGraph = g, _o: Any = original) -> list[Any]:
                seen.append([_g, args])
                return _o(args)  # type: ignore[no-any-return]

            g.run_flat = spy  # type: ignore[method-assign]
        backend(x)
        for g in mine:
            del g.run_flat
        row("streamfuse.compile", lambda: sf(x))
        row("backend=streamfuse", lambda: backend(x))
        for i, (g, args) in enumerate(seen):
            if g.compiled is None:
                print(f"    graph {i}: runs unbound ({g.reason})")
                continue
            dyn = g._dynamic_of(args)
            row(f"  graph {i}'s plan alone", lambda g=g, dyn=dyn: g.compiled(*dyn))
            print(f"    graph {i}: {len(g.static)} bound, {len(dyn)} dynamic argument(s); folded {g.folded}, weight "
                  f"folds {g.weight_folds}, live {g.live}, rebinds {g.rebinds}, unbound updates "
                  f"{g.unbound_updates}; {graph_state(g.compiled)}", flush=True)
        print(f"  streamfuse.compile: graph instances {sf.stats.get('graph_instances')}, outputs copied "
              f"{sf.stats.get('outputs_copied')}", flush=True)
        if profile:
            runtime_calls("streamfuse.compile", lambda: sf(x))
            runtime_calls("backend=streamfuse", lambda: backend(x))
    torch._dynamo.reset()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="googlenet,mobilenet_v3_small,efficientnet_b0")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--no-profile", action="store_true", help="skip the torch.profiler pass")
    parser.add_argument("--second-batch", action="store_true",
                        help="call the backend at batch 3 once before timing (its graph then has a symbolic batch)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    for name in args.models.split(","):
        measure(name, getattr(torch, args.dtype), not args.no_profile, args.second_batch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
