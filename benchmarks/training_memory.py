"""Where a training step's memory lives (issue 16: peak memory no higher than eager's): the CUDA
caching allocator's live blocks after the warm-up steps and one more step, grouped by the Python line
that allocated them, for eager and for the streamfuse backend side by side.

    python benchmarks/training_memory.py [--models resnet18,gpt2] [--steps 8] [--top 20]

For each mode: MiB allocated (live blocks) in the default pool and in the private pools CUDA graphs
record into, MiB reserved, and the largest sources of live blocks: the innermost frame inside
streamfuse's package where there is one (else the innermost Python frame), with the block count. Run
48-68 showed the backend's resnet50 step at 3856 MiB allocated against eager's peak of 3338, 481 MiB
of it not in any graph's handed-out buffers; this names them. Uses torch.cuda.memory's history
recording (stack traces of every allocation: slow, so only for this diagnosis).
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

MIB = 2**20


def origin(frames: list[dict[str, Any]]) -> str:
    """The innermost frame in streamfuse's package (the allocating line of ours), else the innermost
    frame of any Python file; frames are listed innermost first."""
    for f in frames:
        name = str(f.get("filename", ""))
        if "/streamfuse/" in name and "/benchmarks/" not in name:
            return f"{name.split('/streamfuse/')[-1]}:{f.get('line')} {f.get('name')}"
    for f in frames:
        name = str(f.get("filename", ""))
        if name.endswith(".py"):
            return f"{'/'.join(name.split('/')[-2:])}:{f.get('line')} {f.get('name')}"
    return "(no Python frame)"


def summarize(snapshot: dict[str, Any]) -> dict[str, Any]:
    """Live bytes by pool kind and by origin, from torch.cuda.memory._snapshot()."""
    by_pool: dict[str, int] = defaultdict(int)
    reserved: dict[str, int] = defaultdict(int)
    by_origin: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for seg in snapshot.get("segments", []):
        pool = seg.get("segment_pool_id") or (0, 0)
        kind = "default pool" if tuple(pool) == (0, 0) else "graph pools"
        reserved[kind] += int(seg.get("total_size", 0))
        for block in seg.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            size = int(block.get("size", 0))
            by_pool[kind] += size
            entry = by_origin[f"[{kind}] {origin(block.get('frames') or [])}"]
            entry[0] += size
            entry[1] += 1
    return {"allocated": dict(by_pool), "reserved": dict(reserved),
            "origins": sorted(by_origin.items(), key=lambda kv: -kv[1][0])}


def report(label: str, summary: dict[str, Any], top: int) -> None:
    alloc, res = summary["allocated"], summary["reserved"]
    print(f"\n{label}: allocated {sum(alloc.values()) / MIB:.0f} MiB "
          f"({', '.join(f'{k} {v / MIB:.0f}' for k, v in sorted(alloc.items()))}), reserved "
          f"{sum(res.values()) / MIB:.0f} MiB ({', '.join(f'{k} {v / MIB:.0f}' for k, v in sorted(res.items()))})")
    for where, (size, count) in summary["origins"][:top]:
        print(f"  {size / MIB:9.1f} MiB  x{count:<5d} {where}")


def _describe(obj: Any) -> str:
    name = type(obj).__name__
    if isinstance(obj, dict):
        return f"dict with keys {[str(k)[:40] for k in list(obj)[:6]]}"
    if hasattr(obj, "f_code"):
        return f"frame of {obj.f_code.co_qualname} ({obj.f_code.co_filename.split('/')[-1]}:{obj.f_lineno})"
    if isinstance(obj, type):
        return f"class {obj.__module__}.{obj.__qualname__}"
    if callable(obj) and hasattr(obj, "__qualname__"):
        return f"{name} {obj.__qualname__}"
    if isinstance(obj, (list, tuple)):
        return f"{name} of {len(obj)}: {[type(x).__name__ for x in obj[:5]]}"
    return f"{type(obj).__module__}.{name}"


def holders(depth: int = 8) -> None:
    """The backend graphs still alive after their model was dropped, and what refers to them, up to
    `depth` levels (the dropped training graphs' pools stayed allocated in runs 103 and 105; run 105
    saw the chain graph <- closure cell <- compile_aten_graph's `run`, and no further at depth 3). An
    object with no referrer that the collector sees is held from C++ (an autograd node, a tensor's
    grad_fn): printed as such."""
    from streamfuse.capture.backend import compiled_graphs

    alive = [g for g in compiled_graphs if g is not None]
    print(f"  backend graphs still alive: {len(alive)} of {len(compiled_graphs)}")
    seen: set[int] = {id(alive), id(compiled_graphs)}
    frontier: list[tuple[Any, int]] = [(g, 0) for g in alive[:2]]
    lines = 0
    while frontier and lines < 80:
        obj, level = frontier.pop()  # depth first: one chain printed whole before the next
        found = gc.get_referrers(obj)
        referrers = [r for r in found if id(r) not in seen and r is not frontier and r is not found
                     and not (isinstance(r, tuple) and r and r[0] is obj and len(r) == 2 and isinstance(r[1], int))
                     and getattr(r, "f_code", None) is not holders.__code__]
        del found
        seen.add(id(referrers))
        if not referrers and level:
            print(f"  {'  ' * level}(no referrer the collector sees: held from C++)")
        for ref in referrers[:4]:
            seen.add(id(ref))
            lines += 1
            print(f"  {'  ' * level}<- {_describe(ref)}")
            if level + 1 < depth:
                frontier.append((ref, level + 1))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet18,gpt2")
    ap.add_argument("--modes", default="eager,streamfuse")
    ap.add_argument("--steps", type=int, default=8, help="steps before the snapshot (graphs record by the sixth)")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    import training

    device = torch.device("cuda")
    for w in training.workloads(args.models.split(","), tiny=False):
        for mode in args.modes.split(","):
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.memory._record_memory_history(max_entries=200_000)
            model = training.seeded(w, device)
            step_fn = training.wrap(mode, model)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
            batch = w.batch(device, 0)
            for _ in range(args.steps):
                opt.zero_grad(set_to_none=True)
                w.loss(step_fn, batch).backward()  # type: ignore[arg-type]
                opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            between = summarize(torch.cuda.memory._snapshot())
            torch.cuda.reset_peak_memory_stats()
            value = w.loss(step_fn, batch)  # type: ignore[arg-type]
            after_forward = summarize(torch.cuda.memory._snapshot())
            value.backward()
            del value
            opt.step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / MIB
            print(f"\n== {w.name} {mode}: peak allocated during the last step {peak:.0f} MiB")
            report("between steps (gradients freed)", between, args.top)
            report("after the last step's forward", after_forward, args.top)
            del model, step_fn, opt, batch
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.synchronize()
            # what outlives the mode (run 102: resnet18's backend graphs were still allocated during
            # gpt2's eager steps): a leak, or a workspace held for good
            report("after the model, its optimizer and Dynamo's caches were dropped", summarize(torch.cuda.memory._snapshot()),
                   args.top)
            holders()
            torch.cuda.memory._record_memory_history(enabled=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
