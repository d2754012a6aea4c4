"""What fills a training step's CUDA-graph pools: the allocator's history over the backend's recordings.

    python benchmarks/pool_history.py [--models resnet50,gpt2] [--steps 8] [--set NAME=VALUE ...] [--out DIR]

For each model, a training step through torch.compile(backend=streamfuse) runs `--steps` times
with the caching allocator's history on (the forward and backward graphs record at about the
fourth and fifth call). Then, per private pool (profile/pools.py): its segments by stream, its peak
of live bytes, and every segment it took with what was live and free in it at that moment and the
frame of ours that asked. With `--out`, the snapshot itself (a pickle for PyTorch's memory viewer,
https://pytorch.org/memory_viz). GPU only.
"""

from __future__ import annotations

import argparse
import gc
import pickle
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import training  # the training benchmark's workloads and modes (after the path)

from streamfuse.profile.pools import growth_text, pool_growth


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,gpt2,bert-base")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a Config field for the backend (e.g. training_max_streams=4)")
    ap.add_argument("--out", type=Path, default=None, help="write each model's snapshot pickle here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("pool_history.py needs a CUDA GPU", file=sys.stderr)
        return 2
    training.SETTINGS[:] = args.set
    device = torch.device("cuda")
    for w in training.workloads(args.models.split(","), tiny=False):
        model = training.seeded(w, device)
        fn = training.wrap("streamfuse", model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        batch = w.batch(device, 2)
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
        for _ in range(args.steps):
            opt.zero_grad(set_to_none=True)
            w.loss(fn, batch).backward()  # type: ignore[arg-type]
            opt.step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        print(f"== {w.name}: {args.steps} training steps through the backend"
              + (f" ({', '.join(args.set)})" if args.set else ""))
        print(growth_text(pool_growth(snapshot, device.index or 0)))
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            path = args.out / f"{w.name.split()[0]}-pools.pickle"
            path.write_bytes(pickle.dumps(snapshot))
            print(f"wrote {path}")
        del model, fn, opt, batch, snapshot
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
