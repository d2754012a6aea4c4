"""torchvision's detection models through both entry points (they take a list of images and their
shapes depend on the data: non-maximum suppression, top-k, per-box mask pasting).

    python benchmarks/detection_check.py [--models NAME,...] [--device cuda|cpu] [--size 320]

Random weights, score thresholds 0 (so that random weights still detect something), two inputs per
model. For each of `streamfuse.compile` (which hands a list input to the backend), the backend and
`aot_eager` (torch.compile running eager's own kernels in the same graph pieces: the rounding bar),
against eager float32 (TF32 off): an exception, the number of detections, and how far each eager box
is from the nearest compiled box of the same label (in image widths). Detections are sorted by score,
so near-equal scores trade places under any change of rounding; boxes are compared as sets for that
reason. A row fails on an exception, another number of detections, or a nearest box further than
max(1e-3, twice aot_eager's). Exits 1 when any row failed.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from typing import Any

import torch

MODELS = ("fasterrcnn_mobilenet_v3_large_320_fpn", "retinanet_resnet50_fpn", "fcos_resnet50_fpn",
          "ssdlite320_mobilenet_v3_large", "ssd300_vgg16", "maskrcnn_resnet50_fpn", "keypointrcnn_resnet50_fpn")


def build(name: str, device: str) -> torch.nn.Module:
    import torchvision

    kw: dict[str, Any] = {"weights": None, "weights_backbone": None}
    kw["box_score_thresh" if "rcnn" in name else "score_thresh"] = 0.0
    torch.manual_seed(0)
    return getattr(torchvision.models.detection, name)(**kw).eval().to(device)


def distance(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], size: int) -> float:
    """The largest distance from an eager box to the nearest same-label compiled box, in image widths."""
    if not len(want["boxes"]):
        return 0.0
    d = torch.cdist(want["boxes"].double(), got["boxes"].double(), compute_mode="donot_use_mm_for_euclid_dist")
    d = d + 1e9 * (want["labels"][:, None] != got["labels"][None, :])
    return float(d.min(1).values.max()) / size


def check(name: str, device: str, size: int) -> list[tuple[str, str, bool]]:
    import streamfuse

    model = build(name, device)
    gen = torch.Generator().manual_seed(1)
    inputs = [[torch.rand(3, size, size, generator=gen).to(device)] for _ in range(2)]
    with torch.no_grad():
        want = [model(x)[0] for x in inputs]
    rows: list[tuple[str, str, float | str, list[int]]] = []
    for mode in ("aot_eager", "streamfuse", "sf-backend"):
        torch._dynamo.reset()
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                compiled = (streamfuse.compile(model, (inputs[0],)) if mode == "streamfuse" else
                            torch.compile(model, backend="streamfuse" if mode == "sf-backend" else mode))
                with torch.no_grad():
                    got = [compiled(x)[0] for x in inputs]
        except Exception as exc:  # noqa: BLE001 - reported
            rows.append((mode, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}", "raised", []))
            continue
        counts = [len(g["boxes"]) for g in got]
        if counts != [len(w["boxes"]) for w in want]:
            rows.append((mode, f"{counts} detections against eager's {[len(w['boxes']) for w in want]}", "count", counts))
            continue
        far = max(distance(g, w, size) for g, w in zip(got, want, strict=True))
        rows.append((mode, f"{time.perf_counter() - start:.1f} s", far, counts))
    bar = next((r[2] for r in rows if r[0] == "aot_eager" and isinstance(r[2], float)), 0.0)
    out = []
    for mode, what, far, counts in rows:
        ok = isinstance(far, float) and (mode == "aot_eager" or far <= max(1e-3, 2 * bar))
        shown = f"nearest box {far:.1e}" if isinstance(far, float) else far
        out.append((mode, f"{name:<40} {mode:<11} {counts} detections, {shown} ({what})", ok))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", type=int, default=320)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    failed = 0
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"detection models on {name}, torch {torch.__version__}, {args.size}x{args.size}, float32, TF32 off")
    for model in args.models.split(","):
        for _, line, ok in check(model, args.device, args.size):
            failed += not ok
            print(("   " if ok else "!! ") + line, flush=True)
    print(f"{failed} row(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
