"""Where the backend's time per call goes beside streamfuse.compile's, on real models (GPU only).

For each model, batch 1, fp32, inference: µs per call (CUDA events, back to back, as the suite times)
and host µs per call (short bursts, profile/timing.host_us_per_call) of
  - streamfuse.compile (one CUDA graph replay behind a lean call path);
  - torch.compile(backend="streamfuse");
  - torch.compile(mode="reduce-overhead"), the peer on the same host (Dynamo and AOTAutograd too);
  - torch.compile with a backend that returns the first call's outputs and does nothing else: the floor
    any torch.compile backend pays per call (Dynamo's guards and the bytecode that gathers the
    parameters as graph inputs), and the same with guard evaluation skipped
    (torch.compiler.set_stance(skip_guard_eval_unsafe=True), which a user may choose; streamfuse does not).

--profile adds a cProfile of the backend's calls (it inflates small frames); --layers the host µs spent
inside each layer of the call path (perf_counter around the methods, no profiler), the pointer check's
C++ loop against its fallback, and the host time with the garbage collector off and frozen (session 29).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import streamfuse
from streamfuse.profile.timing import host_us_per_call, time_cuda_us


def cached_output_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    out = gm(*example_inputs)
    return lambda *args: out


def measure(name: str, profile: bool = False, layers: bool = False) -> None:
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)().eval().cuda()
    x = torch.randn(1, 3, 224, 224, device="cuda")
    tensors = sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())

    def row(label: str, fn: Callable[[], Any]) -> None:
        fn()
        us, host = time_cuda_us(fn, reps=50), host_us_per_call(fn)
        print(f"  {label:<38} {us:8.1f} µs per call  {host:8.1f} µs host", flush=True)

    print(f"{name} b1 fp32 ({tensors} parameters and buffers)", flush=True)
    sf = streamfuse.compile(model, (x,))
    row("streamfuse.compile", lambda: sf(x))
    # (torch._dynamo.reset() drops every compiled frame: each torch.compile is measured before the next)
    torch._dynamo.reset()
    floor = torch.compile(model, backend=cached_output_backend)
    row("backend returning cached outputs", lambda: floor(x))
    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
        row("  same, guards skipped", lambda: floor(x))
    torch._dynamo.reset()
    # the peer a user compares with, on this host: its host path is Dynamo's and AOTAutograd's too
    reduce_overhead = torch.compile(model, mode="reduce-overhead")
    for _ in range(3):  # cudagraph trees record at the second or third call
        reduce_overhead(x)
    row("torch.compile reduce-overhead", lambda: reduce_overhead(x))
    torch._dynamo.reset()
    backend = torch.compile(model, backend="streamfuse")
    row("backend=streamfuse", lambda: backend(x))
    outputs_copied("streamfuse.compile", [sf])
    from streamfuse.capture.backend import StaticParamsGraph, compiled_graphs

    outputs_copied("backend=streamfuse", [g.compiled for g in compiled_graphs
                                           if isinstance(g, StaticParamsGraph) and g.compiled is not None])
    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
        row("  same, guards skipped", lambda: backend(x))
    if profile:
        host_profile(lambda: backend(x))
    if layers:
        pointer_check_cost(list(model.parameters()) + list(model.buffers()))
        layer_times("backend=streamfuse", lambda: backend(x))
        layer_times("streamfuse.compile", lambda: sf(x))
    torch._dynamo.reset()


def outputs_copied(label: str, plans: list[Any]) -> None:
    """How many of the plans' calls so far copied their outputs out of the graph (every handed-out
    output set still referenced when the call came: an extra copy and allocation per call)."""
    stats = [p.stats for p in plans]
    print(f"    {label}: {sum(s.get('graph_instances', 0) for s in stats)} graph instance(s), "
          f"{sum(s.get('outputs_copied', 0) for s in stats)} call(s) copied their outputs out", flush=True)


def pointer_check_cost(tensors: list[torch.Tensor], reps: int = 2000) -> None:
    """µs per check that `tensors` kept their memory (runtime/memory.PointerCheck): torch's C++ loop
    (CUDA builds) against the map over Tensor.data_ptr it falls back to."""
    import time

    from streamfuse.runtime import memory

    check = memory.PointerCheck(tensors, list(range(len(tensors))))
    loop = memory._POINTERS_EQUAL
    row = []
    for label, impl in (("C++ loop", loop), ("map over data_ptr", None)):
        if label == "C++ loop" and impl is None:
            row.append(f"{label}: not in this torch build")
            continue
        memory._POINTERS_EQUAL = impl
        assert check.same(tensors)
        t = time.perf_counter()
        for _ in range(reps):
            check.same(tensors)
        row.append(f"{label} {(time.perf_counter() - t) / reps * 1e6:.1f}")
    memory._POINTERS_EQUAL = loop
    print(f"    pointer check over {len(tensors)} tensors, µs per call: {'; '.join(row)}")


def layer_times(label: str, fn: Callable[[], Any], calls: int = 400) -> None:
    """Host µs per call spent inside each layer of the call path (inclusive; perf_counter around the
    methods, no profiler), and the host time per call with Python's garbage collector disabled and
    with every existing object frozen out of its generations (gc.freeze)."""
    import gc
    import time

    from streamfuse.capture import backend as backend_module
    from streamfuse.runtime import compiled as compiled_module
    from streamfuse.runtime import graphs as graphs_module

    targets = [(backend_module.StaticParamsGraph, "run_flat"), (compiled_module.CompiledGraph, "__call__"),
               (compiled_module.CompiledGraph, "_entry"), (compiled_module.CompiledGraph, "_call"),
               (compiled_module.CompiledGraph, "_replay"), (compiled_module.CompiledGraph, "_check_batch"),
               (graphs_module.GraphRunner, "__call__"), (graphs_module.GraphRunner, "_replay")]
    spent: dict[str, int] = {}
    saved = []
    for cls, name in targets:
        if name not in cls.__dict__:  # moved to a base class: time it where it is defined
            cls = next(c for c in cls.__mro__ if name in c.__dict__)
        original = cls.__dict__[name]
        key = f"{cls.__name__}.{name}"
        spent[key] = 0

        def timed(*a: Any, _original: Any = original, _key: str = key, **k: Any) -> Any:
            t = time.perf_counter_ns()
            try:
                return _original(*a, **k)
            finally:
                spent[_key] += time.perf_counter_ns() - t

        setattr(cls, name, timed)
        saved.append((cls, name, original))
    total = 0
    try:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        spent.update(dict.fromkeys(spent, 0))
        for i in range(calls):
            t = time.perf_counter_ns()
            fn()
            total += time.perf_counter_ns() - t
            if i % 20 == 19:
                torch.cuda.synchronize()
    finally:
        for cls, name, original in saved:
            setattr(cls, name, original)
    print(f"    {label}: host µs per call inside each layer (inclusive), {calls} calls")
    print(f"      {total / calls / 1e3:8.1f}  whole call")
    for key, ns in spent.items():
        print(f"      {ns / calls / 1e3:8.1f}  {key}")
    print(f"      gc: counts {gc.get_count()}, thresholds {gc.get_threshold()}, tracked objects {len(gc.get_objects())}")
    enabled = host_us_per_call(fn)
    gc.disable()
    disabled = host_us_per_call(fn)
    gc.enable()
    gc.freeze()
    frozen = host_us_per_call(fn)
    gc.unfreeze()
    print(f"      host µs per call: gc on {enabled:.1f}, gc off {disabled:.1f}, after gc.freeze() {frozen:.1f}")


def host_profile(fn: Callable[[], Any], calls: int = 300, top: int = 25) -> None:
    """cProfile of `calls` calls (a synchronize every 20, so the GPU's queue never blocks the host):
    the functions with the most time of their own, per call."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for i in range(calls):
        fn()
        if i % 20 == 19:
            torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # type: ignore[attr-defined]
    print(f"    cProfile, {calls} calls: own µs per call / cumulative µs per call / calls per call / function")
    for (path, line, name), (_, ncalls, own, cum, _) in rows:
        print(f"    {own / calls * 1e6:8.1f} {cum / calls * 1e6:9.1f} {ncalls / calls:7.1f}  "
              f"{Path(path).name}:{line}({name})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="shufflenet_v2_x1_0,resnet50,mobilenet_v3_small")
    parser.add_argument("--profile", action="store_true", help="cProfile the backend's calls too")
    parser.add_argument("--layers", action="store_true", help="host time inside each layer, and with the gc off")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    torch.set_grad_enabled(False)
    for name in args.models.split(","):
        measure(name, args.profile, args.layers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
