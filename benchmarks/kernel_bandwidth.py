"""Every generated kernel of the suite models, with its achieved bandwidth against the copy ceiling
(issue 15's guard against pathological kernels: one GoogLeNet kernel ran at 5 GB/s for 496 µs).

    python benchmarks/kernel_bandwidth.py [--models googlenet,bert] [--batch 1] [--dtype float32]
                                          [--floor 0.1] [--min-us 5] [--top 0] [--set NAME=VALUE] [--peer] [--tf32]

For each model: streamfuse.compile, then `streamfuse.profile` over a few calls (after all timing,
since a profiler session slows later multi-stream graphs in the process). A generated kernel that
takes at least --min-us per call and moves its bytes at less than --floor of the copy bandwidth is
listed as suspect; the last line counts them. --top N also lists the N kernels of any kind (cuDNN,
cuBLAS, generated) that take the most time per call, and the time per call of each kind of generated
kernel (its name's prefix: sf_pw, sf_red, ...). --peer also profiles torch.compile(mode="reduce-overhead")
on the same inputs and prints both sides' kernel time per call by class (matmul, attention, generated,
other) and their longest kernels: where the two plans differ. Profile in a process of its own.
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=None)
    ap.add_argument("--batch", default="1")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--floor", type=float, default=0.1, help="suspect below this fraction of copy bandwidth")
    ap.add_argument("--min-us", type=float, default=5.0, help="ignore kernels shorter than this (launch-bound)")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--top", type=int, default=0, help="also list the N kernels taking the most time per call")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a Config field")
    ap.add_argument("--peer", nargs="?", const="reduce-overhead", default=None, choices=["reduce-overhead", "backend"],
                    help="also profile torch.compile(mode='reduce-overhead'), or with `--peer backend` "
                         "torch.compile(backend='streamfuse') (both entry points on one plan: where they differ)")
    ap.add_argument("--tf32", action="store_true", help="allow TF32 for float32 matmuls and convolutions, as "
                                                        "`streamfuse bench` times them")
    args = ap.parse_args()

    import torch

    import streamfuse
    from streamfuse.bench.models import model_workloads

    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
    config = streamfuse.Config().with_settings(args.set)
    suspects = total = 0
    for w in model_workloads(args.models, args.batch, args.dtype):
        model, inputs = w.make(device)
        with torch.no_grad():
            compiled = streamfuse.compile(model, inputs, config)
            for _ in range(3):
                compiled(*inputs)
            torch.cuda.synchronize()
            with streamfuse.profile(w.name, calls=args.calls, nvml=False) as prof:
                for _ in range(args.calls):
                    compiled(*inputs)
        assert prof.report is not None
        mine = [k for k in prof.report.kernels if k.name.startswith("sf_") and k.bytes]
        total += len(mine)
        print(f"{w.name}: {len(mine)} generated kernels profiled")
        print(f"  {_busy_line(prof.report.totals, args.calls)}")
        layout = getattr(compiled.base, "network_layout", None)
        if layout is not None:
            print(f"  {layout.describe()}")
        if args.top:
            per_call = sorted(prof.report.kernels, key=lambda k: -k.total_us)
            whole = sum(k.total_us for k in per_call) / args.calls
            print(f"  kernel time per call {whole:.1f} µs; the {args.top} longest (µs per call, launches per call):")
            for k in per_call[:args.top]:
                rate = f", {k.achieved_gbps:.0f} GB/s" if k.achieved_gbps else ""
                print(f"    {k.total_us / args.calls:8.1f}  x{k.calls / args.calls:g}  {k.name[:90]}{rate}")
            kinds: dict[str, float] = {}
            for k in per_call:
                kind = "_".join(k.name.split("_")[:2]) if k.name.startswith("sf_") else "other"
                kinds[kind] = kinds.get(kind, 0.0) + k.total_us / args.calls
            print("  per kind: " + ", ".join(f"{kind} {us:.1f}" for kind, us in sorted(kinds.items())))
        for k in sorted(mine, key=lambda k: k.bandwidth_fraction or 0.0):
            mean = k.total_us / max(k.calls, 1)
            low = (k.bandwidth_fraction or 0.0) < args.floor and mean >= args.min_us
            suspects += low
            if low or mean >= 20 * args.min_us:
                print(f"  {'SUSPECT ' if low else ''}{k.name}: {mean:.1f} µs, {k.achieved_gbps or 0:.0f} GB/s "
                      f"({100 * (k.bandwidth_fraction or 0):.1f}% of copy), {k.bytes / 1e6:.2f} MB, "
                      f"occupancy {k.occupancy}, limiter {k.limiter}")
        if args.peer:
            peer = (torch.compile(model, mode="reduce-overhead") if args.peer == "reduce-overhead"
                    else torch.compile(model, backend=streamfuse.make_backend(config)))
            with torch.no_grad():
                for _ in range(5):
                    peer(*inputs)
                torch.cuda.synchronize()
                if args.peer == "backend":  # timed in turns, as the suite times each (CUDA events, back to back)
                    from streamfuse.profile.timing import time_cuda_us
                    mine_fn, peer_fn = (lambda c=compiled, x=inputs: c(*x)), (lambda p=peer, x=inputs: p(*x))
                    rounds = [(time_cuda_us(mine_fn), time_cuda_us(peer_fn)) for _ in range(3)]
                    print("  µs per call, streamfuse.compile / backend, three rounds: "
                          + ", ".join(f"{a:.1f} / {b:.1f}" for a, b in rounds))
                with streamfuse.profile(f"{w.name} {args.peer}", calls=args.calls, nvml=False) as peer_prof:
                    for _ in range(args.calls):
                        peer(*inputs)
            assert peer_prof.report is not None
            print(f"  {args.peer}: {_busy_line(peer_prof.report.totals, args.calls)}")
            _compare(prof.report.kernels, peer_prof.report.kernels, args.calls, max(args.top, 12), args.peer)
            del peer
        del model, compiled
        torch.cuda.empty_cache()
    print(f"{suspects} suspect kernel(s) of {total} generated (below {args.floor:.0%} of copy bandwidth, "
          f">= {args.min_us} µs)")
    return 0


def _busy_line(totals: dict[str, float], calls: int) -> str:
    """The GPU's busy time per call (the union of kernel intervals: kernels that overlap, on other
    streams or started early by programmatic dependent launch, count once) and the gap ratio."""
    return (f"GPU busy {totals['busy_us'] / calls:.1f} µs per call over a span of {totals['span_us'] / calls:.1f}, "
            f"gap ratio {100 * totals['gap_ratio']:.1f}%")


def kernel_class(name: str) -> str:
    """A kernel's class by its name: cuBLAS/CUTLASS matmuls, attention, generated (streamfuse's sf_*,
    Inductor's triton_*), convolutions (cuDNN), the rest."""
    low = name.lower()
    if low.startswith(("sf_", "triton")):  # before the others: Inductor names its kernels by the ops they fuse
        return "generated"
    if any(t in low for t in ("flash", "fmha", "attention", "attn", "sdpa")):
        return "attention"
    if any(t in low for t in ("conv", "cudnn", "implicit", "winograd", "fprop", "dgrad", "wgrad")):
        return "convolution"  # before matmul: cuDNN's implicit-GEMM convolutions name a gemm
    if any(t in low for t in ("gemm", "cutlass", "xmma", "cublas", "sm90_", "gemv", "matmul", "splitk", "nvjet")):
        return "matmul"
    return "other"


def _compare(mine: list, peer: list, calls: int, top: int, name: str = "reduce-overhead") -> None:
    """Both plans' kernel time per call by class, then the peer's longest kernels (--top lists ours)."""
    def by_class(kernels: list) -> dict[str, tuple[float, float]]:
        out: dict[str, tuple[float, float]] = {}
        for k in kernels:
            us, n = out.get(kernel_class(k.name), (0.0, 0.0))
            out[kernel_class(k.name)] = (us + k.total_us / calls, n + k.calls / calls)
        return out
    a, b = by_class(mine), by_class(peer)
    print(f"  kernel time per call by class (µs, launches): streamfuse | {name}")
    for cls in sorted(set(a) | set(b)):
        (ua, na), (ub, nb) = a.get(cls, (0.0, 0.0)), b.get(cls, (0.0, 0.0))
        print(f"    {cls:12s} {ua:9.1f} x{na:<6g} | {ub:9.1f} x{nb:<6g}  ({ua - ub:+.1f})")
    ta, tb = sum(u for u, _ in a.values()), sum(u for u, _ in b.values())
    print(f"    {'total':12s} {ta:9.1f}         | {tb:9.1f}          ({ta - tb:+.1f})")
    print(f"  {name}: the {top} longest (µs per call, launches per call)")
    for k in sorted(peer, key=lambda k: -k.total_us)[:top]:
        print(f"    {k.total_us / calls:8.1f}  x{k.calls / calls:g}  {k.name[:100]}")
    per_name: dict[str, list[float]] = {}
    for side, kernels in enumerate((mine, peer)):
        for k in kernels:
            per_name.setdefault(k.name[:100], [0.0, 0.0])[side] += k.total_us / calls
    print(f"  the {top} kernels whose time per call differs most (µs: streamfuse | {name})")
    for kname, (ua, ub) in sorted(per_name.items(), key=lambda kv: -abs(kv[1][0] - kv[1][1]))[:top]:
        print(f"    {ua:8.1f} | {ub:8.1f}  ({ua - ub:+.1f})  {kname}")


if __name__ == "__main__":
    sys.exit(main())
