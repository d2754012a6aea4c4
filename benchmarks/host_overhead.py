"""Host time per call of CompiledGraph call paths, and where it goes (cProfile). GPU only.

Times are host-only: short bursts of calls timed with perf_counter (the launch queue never fills),
synchronized between bursts outside the timed region."""

from __future__ import annotations

import cProfile
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import streamfuse
from streamfuse import Config
from streamfuse.profile.timing import host_us_per_call
from streamfuse.runtime import cudart


def main() -> int:
    torch.set_grad_enabled(False)
    d = 1024
    model = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.ReLU(), torch.nn.Linear(d, d)).eval().cuda()
    x = torch.randn(1, d, device="cuda")
    graphed = streamfuse.compile(model, (x,))
    copying_in = streamfuse.compile(model, (x,), Config(input_copy_node=False))
    streams = streamfuse.compile(model, (x,), Config(cuda_graphs=False))
    graphed(x)
    runner = next(iter(graphed._runners.values()))
    static_in, static_out = runner.static_inputs[0], runner.static_outputs[0]
    static_storage = static_in.untyped_storage()
    reuse = streamfuse.compile(model, (x,), Config(reuse_outputs=True))
    copying_in(x)
    inst = runner.first
    print(f"input copy: {graphed.input_copy()}")
    # the two input-copy paths alternately, five rounds each (the host's speed drifts within a run)
    pairs = [(host_us_per_call(lambda: graphed(x)), host_us_per_call(lambda: copying_in(x))) for _ in range(5)]
    print("compiled(x), copy node vs copy before replay, rounds: "
          + ", ".join(f"{a:.1f}/{b:.1f}" for a, b in pairs) + " us")
    rows = {
        "eager model(x)": lambda: model(x),
        "streamfuse graph: compiled(x)": lambda: graphed(x),
        "streamfuse graph, input copy before replay: compiled(x)": lambda: copying_in(x),
        "streamfuse graph: runner([x], 1)": lambda: runner([x], 1),
        "streamfuse graph: _check_batch": lambda: graphed._check_batch([x]),
        "graph.replay()": lambda: runner.graph.replay(),
        "static.copy_(x)": lambda: static_in.copy_(x),
        "storage copy_ (untyped storages)": lambda: static_storage.copy_(x.untyped_storage(), True),
        "torch._foreach_copy_([static], [x])": lambda: torch._foreach_copy_([static_in], [x]),
        "out.clone()": lambda: static_out.clone(),
        "torch.empty": lambda: torch.empty(1, d, device="cuda"),
        "raw stream handle": lambda: torch._C._cuda_getCurrentRawStream(0),
        "streamfuse graph, reuse_outputs: compiled(x)": lambda: reuse(x),
        "streamfuse streams: compiled(x)": lambda: streams(x),
    }
    nbytes = x.numel() * x.element_size()
    rows["cudaMemcpyAsync through ctypes"] = lambda: cudart.memcpy_d2d_async(
        static_in.data_ptr(), x.data_ptr(), nbytes, torch._C._cuda_getCurrentRawStream(0))
    if inst.copy_nodes:  # the node update alone, then with the replay
        node, exe_handle = inst.copy_nodes[0], inst.exec
        rows["set_memcpy_source (copy node update)"] = lambda: cudart.set_memcpy_source(
            exe_handle, node, static_in.data_ptr(), x.data_ptr(), nbytes)
    for label, fn in rows.items():
        print(f"{label:40} {host_us_per_call(fn):7.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        graphed(x)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    return 0


if __name__ == "__main__":
    sys.exit(main())
