"""Issue 17's shape check: text models called with random (batch, sequence length) pairs through
`streamfuse.compile` and `torch.compile(backend="streamfuse")`, every output against eager's.

    python benchmarks/shapes.py [--models gpt2,bert-base,llama] [--pairs 20] [--max-batch 64]
                                [--max-len 512] [--budget-s 150] [--json FILE]
    python benchmarks/shapes.py --tiny        # one-layer configs on any machine (a smoke test)

Per model and entry point: how many pairs ran, how many matched eager (float32 with TF32 off,
1e-4 relative to the output's largest magnitude), the worst error, the compilations made (plans
built: streamfuse.compile's specializations, the backend's concrete plans of its symbolic graphs)
and kept, the fallback warnings (streamfuse warns once per reason that something runs eagerly, e.g. new shapes past Config.max_specializations_built),
and the seconds spent (compiles included). Both entry points see the same pairs in the same order.
`--budget-s` stops a model's sweep once that many seconds went by (the pairs that ran are reported),
so a device call can cover three models. Models: GPT-2 small, BERT-base, a 0.85 B Llama
(grouped-query attention, RoPE), random weights, no download (streamfuse/bench/models.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import streamfuse  # noqa: E402 - after the path
from streamfuse.bench.models import MODELS  # noqa: E402
from streamfuse.bench.runner import describe, exact_fp32, rel_error  # noqa: E402

SPECS = {"gpt2": "gpt2 prefill", "bert-base": "bert-base", "llama": "llama gqa"}
POSITIONS = {"gpt2": 1024, "bert-base": 512, "llama": 2048}
RTOL = 1e-4
ENTRIES = ("streamfuse.compile", "backend")


def pairs(n: int, max_batch: int, max_len: int, seed: int) -> list[tuple[int, int]]:
    gen = torch.Generator().manual_seed(seed)
    return [(int(torch.randint(1, max_batch + 1, (), generator=gen)), int(torch.randint(1, max_len + 1, (), generator=gen)))
            for _ in range(n)]


def backend_compiles(first: int) -> tuple[int, int]:
    """(plans built, plans kept) by the backend's graphs registered since `first`."""
    from streamfuse.capture import backend

    built = kept = 0
    for g in backend.compiled_graphs[first:]:
        if isinstance(g, backend.SymbolicGraph):
            built, kept = built + g.built, kept + len(g.plans)
        elif g is not None:
            built, kept = built + 1, kept + 1
    return built, kept


def stage_seconds(plans: list[Any]) -> dict[str, float]:
    """Compile seconds by stage (capture, planning, tuning, kernel compile, ...) summed over the kept
    plans that report them (CompiledGraph.stats["compile_stages_s"]): where a new shape's compile goes."""
    total: dict[str, float] = {}
    for plan in plans:
        plan = getattr(plan, "compiled", None) or plan  # the backend's StaticParamsGraph wraps its plan
        stats = getattr(plan, "stats", None)
        stages = stats.get("compile_stages_s", {}) if isinstance(stats, dict) else {}
        for stage, seconds in stages.items():
            total[stage] = total.get(stage, 0.0) + seconds
    return total


def kept_plans(entry: str, compiled: Any, first: int) -> list[Any]:
    from streamfuse.capture import backend

    if entry == "streamfuse.compile":
        return [compiled, *compiled.specializations.values()] if isinstance(compiled, streamfuse.CompiledGraph) else []
    plans: list[Any] = []
    for g in backend.compiled_graphs[first:]:
        plans += list(g.plans.values()) if isinstance(g, backend.SymbolicGraph) else [g] if g is not None else []
    return plans


def sweep(name: str, shapes: list[tuple[int, int]], device: torch.device, tiny: bool, budget_s: float) -> dict[str, Any]:
    from streamfuse.capture import backend

    spec = next(s for s in MODELS if s.name == SPECS[name])
    torch.manual_seed(0)
    model = spec.build(tiny).eval().to(device)
    vocab = int(model.vocab_size)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randint(1, vocab, shape, generator=gen).to(device) for shape in shapes]
    result: dict[str, Any] = {"model": name, "pairs": shapes}
    torch._dynamo.reset()
    for entry in ENTRIES:
        row: dict[str, Any] = {"ran": 0, "matched": 0, "worst_err": 0.0, "fallbacks": 0, "failures": []}
        start = time.perf_counter()
        first = len(backend.compiled_graphs)
        compiled: Any = None
        with exact_fp32(), torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", streamfuse.StreamfuseFallbackWarning)
            for ids in inputs:
                if time.perf_counter() - start > budget_s:
                    break
                row["ran"] += 1
                try:
                    if compiled is None:
                        compiled = (streamfuse.compile(model, (ids,)) if entry == "streamfuse.compile"
                                    else torch.compile(model, backend="streamfuse"))
                    ref = model(ids)
                    err = rel_error(compiled(ids), ref)
                except Exception as exc:  # noqa: BLE001 - reported per pair, the sweep goes on
                    row["failures"].append(f"{tuple(ids.shape)}: {describe(exc)}")
                    continue
                row["worst_err"] = max(row["worst_err"], err)
                if err <= RTOL:
                    row["matched"] += 1
                else:
                    row["failures"].append(f"{tuple(ids.shape)}: relative error {err:.2e} > {RTOL:.0e}")
            if device.type == "cuda":
                torch.cuda.synchronize()
        row["seconds"] = time.perf_counter() - start
        row["fallbacks"] = sum(issubclass(w.category, streamfuse.StreamfuseFallbackWarning) for w in caught)
        row["stages_s"] = {k: round(v, 2) for k, v in stage_seconds(kept_plans(entry, compiled, first)).items()}
        if entry == "streamfuse.compile" and isinstance(compiled, streamfuse.CompiledGraph):
            stats = compiled.stats
            row["built"], row["kept"] = stats.get("specializations_built", 0) + 1, stats.get("specializations", 0) + 1
        else:
            row["built"], row["kept"] = backend_compiles(first)
        result[entry] = row
        del compiled
        torch._dynamo.reset()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2,bert-base,llama")
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="seconds per model and entry point")
    ap.add_argument("--tiny", action="store_true", help="one-layer configs, batch <= 4, length <= 16")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    if not names or any(n not in SPECS for n in names):
        raise SystemExit(f"error: --models takes {', '.join(SPECS)}; got {args.models!r}")
    if args.pairs < 1 or args.max_batch < 1 or args.max_len < 1:
        raise SystemExit("error: --pairs, --max-batch and --max-len must be at least 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    max_batch, max_len = (min(args.max_batch, 4), min(args.max_len, 16)) if args.tiny else (args.max_batch, args.max_len)
    print(f"{args.pairs} random (batch, length) pairs per model, batch 1-{max_batch}, length 1-{max_len}, on "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}; tolerance {RTOL:.0e} (fp32, TF32 off)")
    print(f"{'model':<10} {'entry':<19} {'ran':>4} {'match':>6} {'worst err':>10} {'built':>6} {'kept':>5} "
          f"{'fallback warnings':>17} {'seconds':>8}")
    results = []
    for name in names:
        shapes = pairs(args.pairs, max_batch, min(max_len, POSITIONS[name]), args.seed)
        r = sweep(name, shapes, device, args.tiny, args.budget_s)
        results.append(r)
        for entry in ENTRIES:
            row = r[entry]
            print(f"{name:<10} {entry:<19} {row['ran']:>4} {row['matched']:>6} {row['worst_err']:>10.1e} "
                  f"{row['built']:>6} {row['kept']:>5} {row['fallbacks']:>17} {row['seconds']:>8.1f}")
            if row.get("stages_s"):
                print("    compile seconds of the kept plans by stage: "
                      + ", ".join(f"{k} {v:.1f}" for k, v in sorted(row["stages_s"].items(), key=lambda kv: -kv[1])))
            for failure in row["failures"][:5]:
                print(f"    FAILED {failure}")
    if args.json is not None:
        args.json.write_text(json.dumps({"rtol": RTOL, "results": results}, indent=2))
    return 0 if all(not r[e]["failures"] for r in results for e in ENTRIES) else 1


if __name__ == "__main__":
    raise SystemExit(main())
