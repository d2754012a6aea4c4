"""Streams + CUDA graphs benchmark, measured side by side in one run on a GPU.

    python benchmarks/streams_graphs.py [--out DIR]

1. four independent 3-layer MLPs at batch 1 through streamfuse.parallel: 4 streams vs the same
   kernels captured on one stream (max_streams=1), with eager and eager-in-a-CUDA-graph for reference;
2. a multi-branch conv block at batch 1: 4 streams vs one stream;
3. host time per call of a captured single-input model (measured before any torch.profiler session,
   and again after them);
4. the demo models: eager vs streamfuse.
Gap ratio = GPU idle between kernels / GPU busy (torch.profiler): "in call" is the median over 10
calls synchronized one at a time (the idle time inside a call), "back to back" over 20 calls issued
without synchronization (it includes the idle time between calls). Every time is taken before the
first torch.profiler session of the process, the gap ratios after all of them: once CUPTI has been
attached, four-stream graphs run slower and bimodal (benchmarks/graph_instances.py --profiler). Config.pdl (programmatic
dependent launch) is on by default; the MLP and conv rows are also measured with it off.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import streamfuse
from streamfuse import Config
from streamfuse.demo_models import DEMO_MODELS, MultiBranchConv
from streamfuse.profile.timeline import call_gap_ratio, gap_ratio, one_call, record_timeline, streams_used
from streamfuse.profile.timing import capture_graph, fork_join, host_us_per_call, time_cuda_us


def mlp(d: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.ReLU(), torch.nn.Linear(d, d), torch.nn.ReLU(),
                               torch.nn.Linear(d, d)).eval().cuda()


def eager_graph(fn: Callable[[], Any]) -> Callable[[], Any]:
    """fn captured as-is into one CUDA graph on one stream (the 'eager + CUDA graph' peer)."""
    graph, _ = capture_graph(fn)
    return graph.replay


def eager_graph_streams(fns: list[Callable[[], Any]]) -> Callable[[], Any]:
    """Each fn on its own stream inside one CUDA graph, forked from and joined to the capture stream
    (a hand-written multi-stream graph: the control for the scheduler's result)."""
    return eager_graph(fork_join(fns))


def measure(label: str, fn: Callable[[], Any], rows: list[dict[str, Any]], kernels: int | None = None) -> dict:
    """The call's time now; its gap ratios later (add_gap_ratios), once every time is taken: after a
    torch.profiler session the same four-stream graphs run slower and bimodal in this process
    (benchmarks/graph_instances.py --profiler, PERF.md session 10)."""
    row = {"mode": label, "call_us": time_cuda_us(fn, warmup=20, reps=200), "kernels": kernels, "_fn": fn}
    rows.append(row)
    return row


def add_gap_ratios(rows: list[dict[str, Any]]) -> None:
    """Gap ratios (torch.profiler timelines) of each measured row, after all timing is done."""
    for row in rows:
        fn = row.pop("_fn")
        timeline = record_timeline(fn, calls=20)
        one_by_one = record_timeline(fn, calls=10, sync_each=True)
        try:
            in_call = call_gap_ratio(one_by_one, 10)
        except ValueError:  # a call launched a varying number of GPU ops (not a graph replay)
            in_call = float("nan")
        row.update({"gap_ratio": gap_ratio(timeline), "call_gap_ratio": in_call, "streams_seen": streams_used(timeline),
                    "gpu_ops_per_call": len(timeline) / 20})


def call_timeline(label: str, fn: Callable[[], Any]) -> list[dict[str, Any]]:
    """One call's GPU intervals (profile.timeline.one_call), printed as stream start+duration."""
    chosen = [{"name": i.name[:24], "stream": i.stream, "start": round(i.start_us, 2), "dur": round(i.duration_us, 2)}
              for i in one_call(fn)]
    print(f"\none call, {label}: " + "; ".join(f"s{k['stream']} {k['start']:.1f}+{k['dur']:.1f}" for k in chosen))
    return chosen


def paired_ratio(one: Callable[[], Any], many: Callable[[], Any], rounds: int = 7) -> dict[str, float]:
    """one / many, timed alternately in `rounds` rounds (four-stream replays of short kernels vary
    by +-25% between runs, PERF.md session 8): the median ratio and its range."""
    ratios = sorted(time_cuda_us(one, warmup=5, reps=60) / time_cuda_us(many, warmup=5, reps=60)
                    for _ in range(rounds))
    return {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    card = torch.cuda.get_device_name()
    print(f"card: {card}; torch {torch.__version__}")
    config = Config(cache_dir=out_dir / "cache")
    results: dict[str, Any] = {"card": card}
    alive: list[Any] = []  # what the rows' graphs read, kept until their gap ratios are taken

    with torch.no_grad():
        # 1. four MLPs at batch 1
        d = 1024
        models = [mlp(d) for _ in range(4)]
        xs = [torch.randn(1, d, device="cuda") for _ in range(4)]
        pairs = [(m, (x,)) for m, x in zip(models, xs, strict=True)]
        par4, par1 = four_and_one(pairs, config)
        # 3 (measured first: no torch.profiler session has run yet). host time per call
        single = streamfuse.compile(models[0], (xs[0],), config)
        results["host_us_single_input_mlp"] = host_us_per_call(lambda: single(xs[0]))
        results["host_us_eager_mlp"] = host_us_per_call(lambda: models[0](xs[0]))
        reuse = streamfuse.compile(models[0], (xs[0],), config.replace(reuse_outputs=True))
        results["host_us_single_input_mlp_reuse"] = host_us_per_call(lambda: reuse(xs[0]))
        copying = streamfuse.compile(models[0], (xs[0],), config.replace(output_sets=0))
        results["host_us_single_input_mlp_copying"] = host_us_per_call(lambda: copying(xs[0]))
        unchecked = streamfuse.compile(models[0], (xs[0],), config.replace(check_inputs=False))
        results["host_us_single_input_mlp_unchecked"] = host_us_per_call(lambda: unchecked(xs[0]))
        before = streamfuse.compile(models[0], (xs[0],), config.replace(input_copy_node=False))
        before(xs[0])
        results["host_us_single_input_mlp_copy_before_replay"] = host_us_per_call(lambda: before(xs[0]))
        results["host_us_single_input_mlp_again"] = host_us_per_call(lambda: single(xs[0]))
        buf = torch.empty_like(xs[0])
        results["host_components_us"] = {  # what one call is made of, each alone
            "graph replay": host_us_per_call(replay_of(single)),
            "copy_ of the input": host_us_per_call(lambda: buf.copy_(xs[0])),
            "clone of the output": host_us_per_call(lambda: buf.clone()),
            "torch.empty": host_us_per_call(lambda: torch.empty(1, d, device="cuda")),
            "an empty Python call": host_us_per_call(lambda: None),
        }

        rows: list[dict[str, Any]] = []
        measure("eager", lambda: [m(x) for m, x in pairs_x(models, xs)], rows)
        measure("eager + CUDA graph", eager_graph(lambda: [m(x) for m, x in pairs_x(models, xs)]), rows)
        r1 = measure("streamfuse 1 stream: call", lambda: par1(*xs), rows, par1.stats["kernels"])
        r4 = measure("streamfuse parallel, 4 streams: call", lambda: par4(*xs), rows, par4.stats["kernels"])
        same1 = same_kernels_one_stream(par4.compiled, xs)
        s1 = measure("the 4-stream plan's kernels on 1 stream: graph replay", same1, rows)
        g1 = measure("streamfuse 1-stream plan (tuned alone): graph replay", replay_of(par1.compiled), rows)
        g4 = measure("streamfuse parallel, 4 streams: graph replay", replay_of(par4.compiled), rows)
        results["same_kernels_4_vs_1_replay"] = s1["call_us"] / g4["call_us"]
        results["paired same kernels: 4 MLPs d=1024 float32"] = paired_ratio(same1, replay_of(par4.compiled))
        off4, off1 = four_and_one(pairs, config.replace(pdl=False))
        o1 = measure("pdl off, 1 stream: graph replay", replay_of(off1.compiled), rows, off1.stats["kernels"])
        o4 = measure("pdl off, 4 streams: graph replay", replay_of(off4.compiled), rows, off4.stats["kernels"])
        results["pdl_off_4_vs_1_replay"] = o1["call_us"] / o4["call_us"]
        results["pdl_gain_4_streams"] = o4["call_us"] / g4["call_us"]
        results["pdl_gain_1_stream"] = o1["call_us"] / g1["call_us"]
        results["paired pdl off: 4 MLPs d=1024 float32"] = paired_ratio(replay_of(off1.compiled),
                                                                        replay_of(off4.compiled))
        measure("control: eager kernels, hand-written 4-stream graph",
                eager_graph_streams([lambda m=m, x=x: m(x) for m, x in pairs_x(models, xs)]), rows)
        # the same four MLPs with every product through cuBLAS + a separate bias/ReLU kernel (what
        # "auto" chose before the template's matrix-vector loop): twice the kernels
        t4, t1 = four_and_one(pairs, config.replace(matmul_strategy="cublas"))
        tt1 = measure("cuBLAS + epilogue: 1 stream graph replay", replay_of(t1.compiled), rows, t1.stats["kernels"])
        tt4 = measure("cuBLAS + epilogue: 4 streams graph replay", replay_of(t4.compiled), rows, t4.stats["kernels"])
        results["cublas_4_vs_1_replay"] = tt1["call_us"] / tt4["call_us"]
        results["auto_4_streams_vs_cublas_4_streams"] = tt4["call_us"] / g4["call_us"]
        for dd, dtype in ((256, torch.float32), (512, torch.float32), (1024, torch.bfloat16)):
            ms = [mlp(dd).to(dtype) for _ in range(4)]
            ins = [torch.randn(1, dd, device="cuda", dtype=dtype) for _ in range(4)]
            p4 = streamfuse.parallel([(m, (x,)) for m, x in zip(ms, ins, strict=True)], config)
            p1 = streamfuse.parallel([(m, (x,)) for m, x in zip(ms, ins, strict=True)], config.replace(max_streams=1))
            p4(*ins), p1(*ins)
            alive.extend([p4, p1, ms, ins])
            tag = f"4 MLPs d={dd} {str(dtype).removeprefix('torch.')}"
            a = measure(f"{tag}: 1 stream graph replay", replay_of(p1.compiled), rows)
            b = measure(f"{tag}: 4 streams graph replay", replay_of(p4.compiled), rows)
            results[f"mlp sweep {tag}"] = a["call_us"] / b["call_us"]
            results[f"paired {tag}"] = paired_ratio(replay_of(p1.compiled), replay_of(p4.compiled))
        results["mlps"] = {"rows": rows, "speedup_4_vs_1_call": r1["call_us"] / r4["call_us"],
                           "speedup_4_vs_1_replay": g1["call_us"] / g4["call_us"],
                           "paired_4_vs_1_replay": paired_ratio(replay_of(par1.compiled), replay_of(par4.compiled)),
                           "streams": par4.stats["streams"], "events": par4.stats["events"]}

        # 2. multi-branch conv block at batch 1
        rows = []
        for channels, size in ((32, 16), (64, 56)):
            block = MultiBranchConv(channels).eval().cuda()
            x = torch.randn(1, channels, size, size, device="cuda")
            c4 = streamfuse.compile(block, (x,), config)
            c1 = streamfuse.compile(block, (x,), config.replace(max_streams=1))
            alive.extend([c4, c1, block, x])
            # cuDNN runs float32 convolutions in TF32, each layout through its own engine (conv_layout)
            torch.testing.assert_close(c4(x), block(x), rtol=1e-2, atol=1e-2)
            tag = f"conv block c{channels} {size}x{size}"
            measure(f"{tag}: eager", lambda b=block, x=x: b(x), rows)
            measure(f"{tag}: eager + CUDA graph", eager_graph(lambda b=block, x=x: b(x)), rows)
            a = measure(f"{tag}: streamfuse 1 stream: call", lambda c=c1, x=x: c(x), rows, c1.stats["kernels"])
            b = measure(f"{tag}: streamfuse {c4.stats['streams']} streams: call", lambda c=c4, x=x: c(x), rows,
                        c4.stats["kernels"])
            ga = measure(f"{tag}: streamfuse 1 stream: graph replay", replay_of(c1), rows)
            gb = measure(f"{tag}: streamfuse {c4.stats['streams']} streams: graph replay", replay_of(c4), rows)
            results[f"speedup {tag}"] = (a["call_us"] / b["call_us"], ga["call_us"] / gb["call_us"])
            results[f"paired {tag}"] = paired_ratio(replay_of(c1), replay_of(c4))
            for label, variant in (("pdl off", config.replace(pdl=False)),
                                   ("no pdl after convolutions", config.replace(pdl_after_convolutions=False)),
                                   ("channels_last results converted back",
                                    config.replace(conv_keep_channels_last=False)),
                                   ("convolutions as recorded (NCHW)", config.replace(conv_layout="native"))):
                p4 = streamfuse.compile(block, (x,), variant)
                p1 = streamfuse.compile(block, (x,), variant.replace(max_streams=1))
                alive.extend([p4, p1])
                torch.testing.assert_close(p4(x), block(x), rtol=1e-2, atol=1e-2)
                p1(x)
                measure(f"{tag}: {label}, 1 stream: graph replay", replay_of(p1), rows)
                measure(f"{tag}: {label}, {p4.stats['streams']} streams: graph replay", replay_of(p4), rows)
                results[f"paired {label}: {tag}"] = paired_ratio(replay_of(p1), replay_of(p4))
            results[f"conv layouts {tag}"] = {k: (v.layout, v.native_us, v.channels_last_us)
                                              for k, v in c4.base.conv_layouts.items()}
        results["conv"] = rows

        # 4. demo models
        demo = []
        for name, factory in DEMO_MODELS.items():
            model, inputs = factory(torch.device("cuda"))
            compiled = streamfuse.compile(model, inputs, config)
            demo.append({"model": name, "eager_us": time_cuda_us(lambda: model(*inputs)),
                         "streamfuse_us": time_cuda_us(lambda: compiled(*inputs)),
                         "streams": compiled.stats["streams"], "kernels": compiled.stats["kernels"]})
        results["demo"] = demo

        # 5. everything that needs torch.profiler, after all timing: gap ratios, one-call timelines,
        #    and host time again (CUPTI stays attached to the process: PERF.md session 10)
        add_gap_ratios(results["mlps"]["rows"] + results["conv"])
        results["timeline 4 MLPs 1 stream"] = call_timeline("4 MLPs, 1 stream", replay_of(par1.compiled))
        results["timeline 4 MLPs 4 streams"] = call_timeline("4 MLPs, 4 streams", replay_of(par4.compiled))
        results["timeline conv c64 4 streams"] = call_timeline("conv block c64 56x56, 4 streams", replay_of(c4))
        results["timeline conv c64 1 stream"] = call_timeline("conv block c64 56x56, 1 stream", replay_of(c1))
        results["host_us_single_input_mlp_after_profiler"] = host_us_per_call(lambda: single(xs[0]))
        results["host_components_after_profiler_us"] = {"graph replay": host_us_per_call(replay_of(single))}

    print()
    print(f"{'mode':52} {'call µs':>9} {'gap in call':>12} {'back to back':>13} {'streams':>8} {'GPU ops/call':>13}")
    for r in results["mlps"]["rows"] + results["conv"]:
        print(f"{r['mode']:52} {r['call_us']:9.1f} {100 * r['call_gap_ratio']:11.1f}% {100 * r['gap_ratio']:12.1f}% "
              f"{r['streams_seen']:8d} {r['gpu_ops_per_call']:13.1f}")
    print(f"\n4 MLPs with pdl off: 4 vs 1 stream {results['pdl_off_4_vs_1_replay']:.2f}x; pdl on vs off: "
          f"{results['pdl_gain_4_streams']:.2f}x (4 streams), {results['pdl_gain_1_stream']:.2f}x (1 stream)")
    m = results["mlps"]
    print(f"\n4 MLPs through cuBLAS + epilogue kernels: 4 vs 1 stream {results['cublas_4_vs_1_replay']:.2f}x; "
          f"auto (template) vs cuBLAS, both on 4 streams: {results['auto_4_streams_vs_cublas_4_streams']:.2f}x")
    print(f"\n4 MLPs, 4 streams vs the same kernels on 1 stream: {results['same_kernels_4_vs_1_replay']:.2f}x "
          "(graph replay)")
    print(f"\n4 MLPs, 4 streams vs the 1-stream plan: {m['speedup_4_vs_1_replay']:.2f}x (graph replay), "
          f"{m['speedup_4_vs_1_call']:.2f}x (call) ({m['streams']} streams, {m['events']} events per call)")
    p = m["paired_4_vs_1_replay"]
    print(f"  paired rounds (graph replay, 1-stream plan vs 4 streams alternately): median {p['median']:.2f}x, "
          f"range {p['min']:.2f}-{p['max']:.2f}x")
    for k, v in results.items():
        if k.startswith("paired "):
            print(f"{k.removeprefix('paired ')}: paired rounds median {v['median']:.2f}x, "
                  f"range {v['min']:.2f}-{v['max']:.2f}x")
        if k.startswith("mlp sweep"):
            print(f"{k.removeprefix('mlp sweep ')}: 4 streams vs 1 stream: {v:.2f}x (graph replay)")
        if k.startswith("conv layouts"):
            print(f"{k}: " + ", ".join(f"{g} {lay} ({n:.1f} µs NCHW, {c:.1f} channels_last)" if n else f"{g} {lay}"
                                       for g, (lay, n, c) in v.items()))
        if k.startswith("speedup conv"):
            print(f"{k.removeprefix('speedup ')}: multi-stream vs 1 stream: {v[1]:.2f}x (graph replay), "
                  f"{v[0]:.2f}x (call)")
    print(f"host time per call, single-input MLP: streamfuse {results['host_us_single_input_mlp']:.1f} µs "
          f"(reuse_outputs=True: {results['host_us_single_input_mlp_reuse']:.1f} µs), "
          f"eager {results['host_us_eager_mlp']:.1f} µs, output_sets=0 (always a copy) "
          f"{results['host_us_single_input_mlp_copying']:.1f} µs, check_inputs=False "
          f"{results['host_us_single_input_mlp_unchecked']:.1f} µs, input copied before the replay "
          f"(input_copy_node=False) {results['host_us_single_input_mlp_copy_before_replay']:.1f} µs, "
          f"streamfuse again {results['host_us_single_input_mlp_again']:.1f} µs")
    print("host time per call of the pieces: " + ", ".join(f"{k} {v:.1f} µs"
                                                           for k, v in results["host_components_us"].items()))
    print(f"after torch.profiler sessions in this process: streamfuse "
          f"{results['host_us_single_input_mlp_after_profiler']:.1f} µs, graph replay "
          f"{results['host_components_after_profiler_us']['graph replay']:.1f} µs")
    for r in results["demo"]:
        print(f"demo {r['model']:20} eager {r['eager_us']:8.1f} µs  streamfuse {r['streamfuse_us']:8.1f} µs  "
              f"{r['eager_us'] / r['streamfuse_us']:.2f}x  ({r['kernels']} kernels, {r['streams']} streams)")
    (out_dir / "streams_graphs.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


def four_and_one(pairs: list[tuple[torch.nn.Module, tuple[torch.Tensor, ...]]],
                 config: Config) -> tuple[streamfuse.ParallelModels, streamfuse.ParallelModels]:
    """streamfuse.parallel of `pairs` on config's streams and on one stream, both checked against eager."""
    many, one = streamfuse.parallel(pairs, config), streamfuse.parallel(pairs, config.replace(max_streams=1))
    for p in (many, one):
        for out, (model, inputs) in zip(p(*[inputs for _, inputs in pairs]), pairs, strict=True):
            torch.testing.assert_close(out, model(*inputs), rtol=1e-3, atol=1e-3)
    return many, one


def same_kernels_one_stream(compiled: streamfuse.CompiledGraph, inputs: list[torch.Tensor]) -> Callable[[], Any]:
    """The compiled plan's own kernels (the tiles tuned for its streams) captured in plan order on
    one stream: the issue's "same kernels captured on one stream"."""
    exe, keep = compiled.base, []
    statics = [x.clone() for x in inputs]
    graph, _ = capture_graph(lambda: exe.run(statics, keep_alive=keep, one_stream=True))
    return lambda g=graph, _buffers=(statics, keep): g.replay()  # the graph reads and writes the buffers


def replay_of(compiled: streamfuse.CompiledGraph) -> Callable[[], Any]:
    """The compiled call's CUDA graph alone: the kernels as scheduled, no copies, no host path."""
    (graph,) = compiled.recorded_graphs().values()
    return graph.replay


def pairs_x(models: list[torch.nn.Module], xs: list[torch.Tensor]) -> list[tuple[torch.nn.Module, torch.Tensor]]:
    return list(zip(models, xs, strict=True))


if __name__ == "__main__":
    sys.exit(main())
