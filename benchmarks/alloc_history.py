"""A training run's whole allocator history, eager or through the backend, and where the memory sits.

    python benchmarks/alloc_history.py --models bert-base,gpt2 --modes eager,streamfuse [--steps 10] \
        [--set NAME=VALUE ...] [--out DIR]            # GPU: runs, prints, writes DIR/MODEL-MODE.pickle
    python benchmarks/alloc_history.py --read FILE.pickle   # any machine: the summary of a saved history

Unlike pool_history.py (the backend's graph pools only), the history starts before the model is
built and covers the default pool too: parameters, the optimizer's state, and the free blocks
left between them. Step 7 starts after `empty_cache`, marked in the history by one odd-sized
allocation; the summary gives the reservation from then on, each pool's segments against what is
allocated in them at the end, and what is live at the peak, by the frame of ours (or the
benchmark's) that allocated it. Session 55 (run 211) found BERT-base's excess over eager this way.
"""

from __future__ import annotations

import argparse
import collections
import pickle
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import training  # the training benchmark's workloads and modes (after the path)

MARK_BYTES = 12345679
"""The marker allocation's size (rounded by the allocator to whole 512-byte blocks)."""
MiB = 2**20


def run(name: str, mode: str, steps: int) -> dict[str, Any]:
    w = training.workloads([name], tiny=False)[0]
    device = torch.device("cuda")
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    model = training.seeded(w, device)
    fn = training.wrap(mode, model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    batch = w.batch(device, 2)
    for i in range(steps):
        torch.cuda.synchronize()
        if i == 6:
            torch.cuda.empty_cache()
            marker = torch.empty(MARK_BYTES, dtype=torch.uint8, device=device)
            del marker
        print(f"  before step {i}: allocated {torch.cuda.memory_allocated() / MiB:.0f} MiB, "
              f"reserved {torch.cuda.memory_reserved() / MiB:.0f}")
        opt.zero_grad(set_to_none=True)
        w.loss(fn, batch).backward()  # type: ignore[arg-type]
        opt.step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return snapshot  # type: ignore[no-any-return]


def _where(event: dict[str, Any]) -> str:
    frames = event.get("frames") or []
    ours = [f for f in frames if "/streamfuse/" in f["filename"] or "benchmarks/" in f["filename"]]
    f = ours[0] if ours else (frames[0] if frames else None)
    return f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" if f else "?"


def summary(snapshot: dict[str, Any]) -> str:
    lines = []
    pools: dict[tuple[Any, str], list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for seg in snapshot["segments"]:
        row = pools[(tuple(seg.get("segment_pool_id", (0, 0))), f"{seg['stream']:#x}")]
        row[0] += seg["total_size"]
        row[1] += seg["allocated_size"]
        row[2] += 1
    lines.append("segments at the end, by pool and stream ((0, 0): the default pool):")
    for (pool, stream), (total, allocated, count) in sorted(pools.items()):
        lines.append(f"  pool {pool} stream {stream}: {total / MiB:.0f} MiB in {count} segments, "
                     f"{allocated / MiB:.0f} allocated, {(total - allocated) / MiB:.0f} free")
    trace = snapshot["device_traces"][0]
    mark = max((i for i, e in enumerate(trace) if e["action"] == "alloc"
                and MARK_BYTES <= e["size"] < MARK_BYTES + 512), default=0)
    reserved = allocated = 0
    peak_reserved, peak_allocated = (0, mark), (0, mark)
    sizes: dict[int, int] = {}
    for i, e in enumerate(trace):
        action = e["action"]
        if action == "segment_alloc":
            reserved += e["size"]
        elif action == "segment_free":
            reserved -= e["size"]
        elif action == "alloc":
            sizes[e["addr"]] = e["size"]
            allocated += e["size"]
        elif action == "free_completed":
            allocated -= sizes.pop(e["addr"], 0)
        if i > mark:
            peak_reserved = max(peak_reserved, (reserved, i))
            peak_allocated = max(peak_allocated, (allocated, i))
    lines.append(f"from the mark (event {mark} of {len(trace)}): peak reserved {peak_reserved[0] / MiB:.0f} MiB, "
                 f"peak allocated {peak_allocated[0] / MiB:.0f} MiB (the history's own count)")
    live: dict[int, dict[str, Any]] = {}
    for e in trace[: peak_allocated[1] + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    by_frame: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for e in live.values():
        by_frame[_where(e)] += e["size"]
        count[_where(e)] += 1
    lines.append(f"live at the peak allocated ({sum(by_frame.values()) / MiB:.0f} MiB), by frame:")
    lines += [f"  {size / MiB:8.1f} MiB {count[k]:4d}x {k}" for k, size in by_frame.most_common(12)]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bert-base,gpt2")
    ap.add_argument("--modes", default="eager,streamfuse")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a Config field for the backend (e.g. training_warmup_pool=true)")
    ap.add_argument("--out", type=Path, default=None, help="write each run's history pickle here")
    ap.add_argument("--read", type=Path, default=None, help="summarize a saved history instead of running")
    args = ap.parse_args()
    if args.read is not None:
        print(summary(pickle.loads(args.read.read_bytes())))
        return 0
    if not torch.cuda.is_available():
        print("alloc_history.py needs a CUDA GPU (or --read FILE)", file=sys.stderr)
        return 2
    if args.steps < 8:
        print("--steps must be at least 8 (step 7 starts after the mark)", file=sys.stderr)
        return 2
    training.SETTINGS[:] = args.set
    for mode in args.modes.split(","):
        for name in args.models.split(","):
            print(f"== {name}, {mode}: {args.steps} SGD-momentum steps" + (f" ({', '.join(args.set)})" if args.set else ""))
            snapshot = run(name, mode, args.steps)
            print(summary(snapshot))
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / f"{name}-{mode}.pickle").write_bytes(pickle.dumps(snapshot))
            del snapshot
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
