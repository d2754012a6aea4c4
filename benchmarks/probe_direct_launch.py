"""Probe: where the host time of a one-kernel call without a CUDA graph goes (softmax and
layer_norm 4096², the direct-launch path of runtime/steps.KernelStep). GPU only.

    python benchmarks/probe_direct_launch.py [--after-compile]
"""

from __future__ import annotations

import cProfile
import pstats
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import streamfuse
from streamfuse.profile.timing import host_us_per_call, time_cuda_us
from streamfuse.runtime.steps import KernelStep, launch_key, triton_hooks_unset


def pieces(label: str, fn, inputs: tuple[torch.Tensor, ...]) -> None:  # type: ignore[no-untyped-def]
    compiled = streamfuse.compile(fn, inputs)
    compiled(*inputs)
    (step,) = [s for s in compiled.base.steps if isinstance(s, KernelStep)]
    env: list = [None] * len(compiled.base.graph.nodes)
    for s, t in zip(compiled.base.input_slots, inputs, strict=True):
        env[s] = t
    args = list(inputs) + [torch.empty(1, device="cuda")]
    shape, dtype = step.out_meta[0]
    rows = {
        "eager": lambda: fn(*inputs),
        "compiled(*inputs)": lambda: compiled(*inputs),
        "run_flat": lambda: compiled.run_flat(list(inputs)),
        "base.run": lambda: compiled.base.run(list(inputs)),
        "check_inputs": lambda: compiled.base.check_inputs(list(inputs), compiled.call.input_names),
        "step.run(env)": lambda: step.run(env),
        "torch.empty(out)": lambda: torch.empty(shape, dtype=dtype, device="cuda"),
        "specialization key": lambda: launch_key(args),
        "triton_hooks_unset": triton_hooks_unset,
        "raw stream": lambda: torch._C._cuda_getCurrentRawStream(0),
    }
    print(f"{label}: call {time_cuda_us(lambda: compiled(*inputs)):.1f} µs, eager call "
          f"{time_cuda_us(lambda: fn(*inputs)):.1f} µs, graphs {compiled.use_graphs}")
    for name, f in rows.items():
        print(f"  {name:22} {host_us_per_call(f):7.1f} µs host")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        compiled(*inputs)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def after_others(label: str, fn, inputs: tuple[torch.Tensor, ...]) -> None:  # type: ignore[no-untyped-def]
    """The same call timed again after torch.compile's two modes ran in the process (as in
    `streamfuse bench`), then with the garbage collector's old objects frozen."""
    import gc

    compiled = streamfuse.compile(fn, inputs)
    before = (time_cuda_us(lambda: compiled(*inputs)), host_us_per_call(lambda: compiled(*inputs)))
    for mode in ("default", "reduce-overhead"):
        other = torch.compile(fn, mode=mode)
        for _ in range(20):
            other(*inputs)
        print(f"{label}: torch.compile {mode} call {time_cuda_us(lambda o=other: o(*inputs)):.1f} µs")
    after = (time_cuda_us(lambda: compiled(*inputs)), host_us_per_call(lambda: compiled(*inputs)))
    eager = time_cuda_us(lambda: fn(*inputs))
    gc.collect()
    gc.freeze()
    frozen = (time_cuda_us(lambda: compiled(*inputs)), host_us_per_call(lambda: compiled(*inputs)))
    gc.unfreeze()
    print(f"{label}: streamfuse call/host µs before {before[0]:.1f}/{before[1]:.1f}, after torch.compile "
          f"{after[0]:.1f}/{after[1]:.1f}, gc frozen {frozen[0]:.1f}/{frozen[1]:.1f}; eager call {eager:.1f}")


def main() -> int:
    torch.set_grad_enabled(False)
    x = torch.randn(4096, 4096, device="cuda")
    w, b = torch.randn(4096, device="cuda"), torch.randn(4096, device="cuda")
    pieces("softmax 4096²", lambda t: torch.softmax(t, -1), (x,))
    pieces("layer_norm 4096²", lambda t, w, b: F.layer_norm(t, (4096,), w, b), (x, w, b))
    if "--after-compile" in sys.argv:
        after_others("softmax 4096²", lambda t: torch.softmax(t, -1), (x,))
        after_others("layer_norm 4096²", lambda t, w, b: F.layer_norm(t, (4096,), w, b), (x, w, b))
    return 0


if __name__ == "__main__":
    sys.exit(main())
