"""Training correctness over the model suite through `torch.compile(backend="streamfuse")` (issue 16).

    python benchmarks/train_check.py [--models all|NAME,...] [--calls 6] [--json FILE]
    python benchmarks/train_check.py --tiny     # one-layer text configs, short sequences (CPU smoke test)
    python benchmarks/train_check.py --autocast bfloat16    # mixed-precision training
    python benchmarks/train_check.py --timm default         # timm architectures beyond the suite

For each suite model (streamfuse.bench.models: torchvision classifiers and Hugging Face
architectures from configs, random weights, fixed seeds), in training mode with dropout and
stochastic depth off (the check compares gradients, and a mask drawn by another generator differs):
`--calls` training steps in lockstep of four copies of the model (five for vision models, with eager
float32 in channels_last too): eager float32, which takes an SGD
step (lr 1e-2, momentum 0.9) after each, and eager float64 and the backend's in float32 and in
float64, which take the eager copy's weights and buffers in place before each step. So every step
compares one forward + backward at the same weights, the backend's training graphs record their
CUDA graphs within the first calls and the last steps replay them, and the weights the graphs read
change in place between calls. Against float64 eager at the same weights, for every parameter's
gradient (relative norm), the loss and every buffer after the step (batch-norm running statistics,
updated in place by the graphs; relative norm):

- the backend in float64, at every step: over 1e-6 fails (float64 rounding does not reach it; a
  wrong plan, a stale weight or a lost update does, at any conditioning);
- the backend in float32, its worst over the steps: over max(tolerance, twice eager float32's worst)
  fails (tolerances 1e-3 gradients and buffers, 1e-4 loss; a deep network's float32 gradients can be
  further than 1e-3 from float64's in eager itself). For vision models eager float32 runs twice, in
  NCHW and in channels_last, and the worse of the two sets the bar (check() says why).

Float32 with TF32 off throughout; `--autocast bfloat16` runs the float32 copies' forward under
torch.autocast (mixed-precision training; the float64 copy runs without it). Vision models take 4
images (2 with --tiny) at the suite's tiny size (64x64, 96 for inception_v3; ViT-B/16 is built for
224); text models 2 x 32 tokens at full depth (one-layer configs and 2 x 8 tokens with --tiny).
Prints one line per model as it finishes; exits 1 when any model failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from training import _projected_loss, deterministic, relative, worst_error

from streamfuse.bench.models import MODELS, ModelSpec
from streamfuse.bench.runner import exact_fp32
from streamfuse.runtime.fallback import failure_text

LOSS_RTOL = 1e-4
STATE_RTOL = 1e-3
GRAD_RTOL = 1e-3
F64_RTOL = 1e-6
SKIPPED = ("gpt2 decode",)
"""Suite workloads with no training counterpart here (one token: gpt2 prefill trains the same model)."""
TIMM_MODELS = ("resnest14d", "skresnet18", "res2net50_14w_8s", "mobilevit_xxs", "efficientvit_b0", "levit_128s",
               "fastvit_t8", "poolformer_s12", "coat_lite_tiny", "mobilenetv4_conv_small", "ghostnet_100", "rexnet_100",
               "hrnet_w18_small", "dla34", "repvgg_a0", "nf_resnet26", "edgenext_xx_small", "caformer_s18",
               "mvitv2_tiny", "gcvit_xxtiny", "sequencer2d_s", "tiny_vit_5m_224", "maxvit_nano_rw_256", "nest_tiny",
               "twins_svt_small", "eva02_tiny_patch14_224", "mambaout_femto", "starnet_s050")
"""`--timm default`: timm architectures outside the suite with other building blocks (split attention,
selective kernels, mobile ViTs, linear attention, reparameterised convolutions, weight-standardised
convolutions, pooling and attention mixers, multiscale and window attention, LSTMs, rotary ViTs).
All 28 matched eager in float64 through the backend on the CPU (session 38, reference executor)."""


def _runs_at(model: nn.Module, size: int) -> bool:
    """The model's eager forward takes 2 images of size x size (on the CPU, at this size cheap)."""
    try:
        with torch.no_grad():
            model.eval()(torch.randn(2, 3, size, size))
    except Exception:  # noqa: BLE001 - any failure: the architecture needs another size
        return False
    return True


def timm_spec(name: str) -> ModelSpec:
    """A timm architecture as a vision workload: random weights, dropout and drop-path off, 64x64
    images where the model takes an `img_size` (else its pretrained config's size if that is fixed,
    or 64)."""
    import timm  # absent on some machines: --timm then says so

    drops = {"drop_rate": 0.0, "drop_path_rate": 0.0}  # not every model takes them; deterministic() zeroes them too
    head = {"num_classes": 1000}  # some default configs have none (eva02_tiny: 0, features out)
    candidates = [head | drops | {"img_size": 64}, head | {"drop_rate": 0.0, "img_size": 64}, head | {"img_size": 64},
                  head | drops, head | {"drop_rate": 0.0}, head]
    for options in candidates:
        try:
            timm.create_model(name, pretrained=False, **options)
            break
        except TypeError:  # an argument this architecture does not take
            continue
    cfg = timm.models.get_pretrained_cfg(name)
    if "img_size" in options:
        size = 64
    else:
        size = cfg.input_size[-1] if cfg is not None and cfg.fixed_input_size else 64
    if size == 64 and cfg is not None and not _runs_at(timm.create_model(name, pretrained=False, **options), 64):
        size = cfg.input_size[-1]  # halonet26t's blocks do not divide a 64x64 image's features: eager asserts

    def build(tiny: bool) -> nn.Module:
        return timm.create_model(name, pretrained=False, **options)

    return ModelSpec(name=f"timm:{name}", kind="vision", build=build, size=size, tiny_size=size)


def batch_of(spec: ModelSpec, tiny: bool, device: torch.device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1)
    if spec.kind == "vision":
        # ViT-B/16 is built for its size (64 with --tiny, models._vit), the others run at the tiny size
        fixed = spec.name.startswith("timm:") or (spec.name == "vit_b_16" and not tiny)
        size = spec.size if fixed else spec.input_size(True)
        images = 2 if tiny else 4
        return (torch.randn(images, 3, size, size, generator=gen).to(device),
                torch.randint(0, 1000, (images,), generator=gen).to(device))
    tokens = 8 if tiny else 32
    return (torch.randint(0, 256 if tiny else 30000, (2, tokens), generator=gen).to(device),)


def loss_of(spec: ModelSpec, fn: Any, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if spec.kind == "vision":
        return nn.functional.cross_entropy(fn(batch[0]), batch[1])
    return _projected_loss(fn, batch)


class ExactHardActivations(torch.overrides.TorchFunctionMode):
    """F.hardswish and F.hardsigmoid as their formulas, for the float64 reference. ATen computes both
    with a float constant `1.0f / 6.0f` (CUDA forward and backward, CPU hardsigmoid backward), so its
    float64 result carries float32's rounding of 1/6 (3e-8 relative per op): eager float64's gradient
    of `hardsigmoid` on the CPU is 3e-8 from `grad / 6`, and through mobilenet_v3_large's batch norms
    on the H200 the backend in float64, which divides by 6 exactly, was 1.4e-6 from it (run 152).
    Out of place even when asked for in place: the result is what the modules return."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is nn.functional.hardswish:
            x = args[0]
            return x * (x + 3).clamp(0, 6) / 6
        if func is nn.functional.hardsigmoid:
            return (args[0] + 3).clamp(0, 6) / 6
        return func(*args, **kwargs)


class Run:
    """One copy of the seeded model, in training mode, eager or through the backend."""

    def __init__(self, spec: ModelSpec, tiny: bool, device: torch.device, dtype: torch.dtype, config: Any = None,
                 autocast: torch.dtype | None = None, channels_last: bool = False):
        """`channels_last`: the model's weights and the images in that memory format (vision models; a
        second, equally valid float32 computation, whose distance from float64 samples float32's noise)."""
        torch.manual_seed(0)
        self.spec, self.dtype, self.autocast = spec, dtype, autocast
        self.model = deterministic(spec.build(tiny)).to(device, dtype).train()
        self.fn: Any = self.model
        if config is not None:
            import streamfuse

            self.fn = torch.compile(self.model, backend=streamfuse.make_backend(config))
        self.batch = tuple(t.to(dtype) if t.is_floating_point() else t for t in batch_of(spec, tiny, device))
        if channels_last:  # 4-D weights only: Module.to(memory_format=...) fails on a Conv3d's (lambda_resnet26t)
            for t in [*self.model.parameters(), *self.model.buffers()]:
                if t.dim() == 4:
                    t.data = t.data.contiguous(memory_format=torch.channels_last)
            self.batch = (self.batch[0].contiguous(memory_format=torch.channels_last),) + self.batch[1:]

    def step(self) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Forward and backward at the current weights: the loss, the gradients, the state after."""
        self.model.zero_grad(set_to_none=True)
        device = self.batch[0].device.type
        exact = self.dtype is torch.float64 and self.fn is self.model  # the eager float64 reference
        with torch.autocast(device, self.autocast or torch.float32, enabled=self.autocast is not None), \
                ExactHardActivations() if exact else contextlib.nullcontext():
            loss = loss_of(self.spec, self.fn, self.batch)
        loss.backward()
        grads = {n: p.grad.detach().double().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        return float(loss.detach()), grads, floating_state(self.model)

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Every floating parameter and buffer set to `state`, in place (the memory the graphs read)."""
        with torch.no_grad():
            for name, t in self.model.state_dict().items():
                if name in state:
                    t.copy_(state[name])


def floating_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().double().clone() for n, t in model.state_dict().items() if t.is_floating_point()}


def state_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Worst relative norm error over the buffers and parameters (absolute for ones ~0)."""
    errors = {n: relative(got[n], t) if t.norm() > 1e-6 else float((got[n] - t).norm()) for n, t in want.items()}
    name = max(errors, key=errors.__getitem__)
    return errors[name], name


def _errors(loss: float, grads: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
            exact: tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]) -> dict[str, Any]:
    """A copy's step against the float64 eager copy's at the same weights."""
    exact_loss, exact_grads, exact_state = exact
    grad, where = worst_error(grads, exact_grads)
    state_err, state_where = state_error(state, exact_state)
    return {"grad": grad, "grad_at": where, "loss": abs(loss - exact_loss) / max(abs(exact_loss), 1e-30),
            "state": state_err, "state_at": state_where, "missing": sorted(set(grads) ^ set(exact_grads))[:3]}


def check(spec: ModelSpec, tiny: bool, device: torch.device, calls: int, config: Any = None,
          autocast: torch.dtype | None = None) -> dict[str, Any]:
    """Lockstep: before every step the other copies take the eager float32 copy's weights and buffers
    (in place), so each step compares one forward + backward at the same weights (separate
    trajectories drift apart: batch-norm over a few values per channel amplifies float32 rounding,
    and eager float32 itself left float64's loss by 8% after one SGD step of resnet50 at batch 2,
    64x64, session 36). The eager copy takes an SGD step (lr 1e-2, momentum 0.9) after each.

    Two judgements against eager float64:
    - the backend in float64, at every step: within F64_RTOL (rounding cannot reach that; a wrong
      plan, a stale weight or a lost update does);
    - the backend in float32: its worst error over the steps within max(tolerance, twice float32's
      noise), the noise being the worst over the steps of eager float32, and for vision models also
      of eager float32 in channels_last (a second valid summation order). Float32's distance from
      float64 comes in bursts: a near-zero input to a ReLU or a near-tie in a max-pool goes the other
      way at one step, and that step's gradients jump (shufflenet_v2 on the CPU, session 37: eager
      NCHW 2.7e-5 and channels_last 1.1e-2 on one batch-norm bias at the same step, the other way
      round at the next). So one eager sample under-states the noise, and a per-step bar failed
      rounding that float64 showed correct (regnet, session 36).
    `config`: the backend's (default: streamfuse.Config()). `autocast`: the float32 copies run their
    forward under torch.autocast to that dtype (mixed precision), the float64 ones without."""
    import streamfuse

    row: dict[str, Any] = {"model": spec.name, "steps": []}
    problems: list[str] = []
    config = config or streamfuse.Config()
    with exact_fp32():
        ref = Run(spec, tiny, device, torch.float32, autocast=autocast)
        exact = Run(spec, tiny, device, torch.float64)
        copies = {"eager_cl": Run(spec, tiny, device, torch.float32, autocast=autocast, channels_last=True)} \
            if spec.kind == "vision" else {}
        torch._dynamo.reset()
        got = Run(spec, tiny, device, torch.float32, config, autocast=autocast)
        got64 = Run(spec, tiny, device, torch.float64, config)
        opt = torch.optim.SGD(ref.model.parameters(), lr=1e-2, momentum=0.9)
        start = time.perf_counter()
        for call in range(calls):
            weights = floating_state(ref.model)
            for other in (exact, got, got64, *copies.values()):
                other.load(weights)
            eager = ref.step()
            truth = exact.step()
            errors = {"eager": _errors(*eager, truth), "float32": _errors(*got.step(), truth),
                      "float64": _errors(*got64.step(), truth)}
            errors |= {name: _errors(*run.step(), truth) for name, run in copies.items()}
            row["steps"].append(errors)
            for name, e in errors.items():
                if e["missing"]:
                    problems.append(f"step {call + 1}: {name} gradients present in one run only: {e['missing']}")
            e = errors["float64"]
            if max(e["grad"], e["loss"], e["state"]) > F64_RTOL:
                problems.append(f"step {call + 1}: the backend in float64 is off from eager float64: gradient of "
                                f"{e['grad_at']} {e['grad']:.1e}, loss {e['loss']:.1e}, {e['state_at']} {e['state']:.1e}")
            opt.step()
        row["seconds"] = time.perf_counter() - start
    torch._dynamo.reset()
    for copy in ("eager", "float32", "float64", *copies):
        for key in ("grad", "loss", "state"):
            row[f"{copy}_{key}"] = max(s[copy][key] for s in row["steps"])
    for key, tol in (("grad", GRAD_RTOL), ("loss", LOSS_RTOL), ("state", STATE_RTOL)):
        row[f"noise_{key}"] = max(row[f"{copy}_{key}"] for copy in ("eager", *copies))
        bar = max(tol, 2 * row[f"noise_{key}"])
        if row[f"float32_{key}"] > bar:
            worst = max(range(calls), key=lambda i: row["steps"][i]["float32"][key])
            at = row["steps"][worst]["float32"].get(f"{key}_at", "")
            problems.append(f"float32 {key} error {row[f'float32_{key}']:.2e} (step {worst + 1}{', ' + at if at else ''}) "
                            f"over {bar:.1e} (eager float32's worst {row[f'noise_{key}']:.1e})")
    if problems:
        row["error"] = "; ".join(problems[:4]) + (f" (+{len(problems) - 4} more)" if len(problems) > 4 else "")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="all", help="suite names (streamfuse bench --suite models), comma-separated")
    ap.add_argument("--calls", type=int, default=6, help="training steps per run (graphs replay from about the fourth)")
    ap.add_argument("--tiny", action="store_true", help="one-layer text configs (CPU smoke test)")
    ap.add_argument("--autocast", choices=("bfloat16", "float16"), default=None,
                    help="forward under torch.autocast to this dtype (mixed-precision training), judged against float64")
    ap.add_argument("--timm", default=None, help="timm architectures instead of the suite: 'default' (TIMM_MODELS) "
                    "or names, comma-separated (needs timm)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a Config field for the backend (e.g. train_channels_last=true)")
    args = ap.parse_args()
    import streamfuse

    try:
        config = streamfuse.Config().with_settings(args.set)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    if args.calls < 1:
        raise SystemExit(f"error: --calls takes a positive number of steps; got {args.calls}")
    specs = [s for s in MODELS if s.name not in SKIPPED]
    if args.models != "all":
        wanted = [n.strip() for n in args.models.split(",") if n.strip()]
        known = {s.name for s in specs}
        unknown = [n for n in wanted if n not in known]
        if unknown:
            raise SystemExit(f"error: --models takes {', '.join(sorted(known))} or all; got {', '.join(unknown)}")
        by_name = {s.name: s for s in specs}
        specs = [by_name[n] for n in wanted]  # in the order given
    if args.timm is not None:
        if args.models != "all":
            raise SystemExit("error: --timm replaces the suite; leave --models out")
        names = TIMM_MODELS if args.timm == "default" else [n.strip() for n in args.timm.split(",") if n.strip()]
        try:
            specs = [timm_spec(n) for n in names]
        except ImportError as exc:
            raise SystemExit(f"error: --timm needs timm installed ({exc})") from None
        except RuntimeError as exc:  # timm's "Unknown model"
            raise SystemExit(f"error: --timm: {exc}") from None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = f"float32 under {args.autocast} autocast" if args.autocast else "float32"
    print(f"training check through the backend ({args.calls} SGD steps, {precision}, TF32 off) on "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}", flush=True)
    print("worst over the steps, relative to eager float64 at the same weights (backend float32 / eager float32, "
          "NCHW and channels_last / backend float64):")
    print(f"{'model':<20} {'gradients':>27} {'loss':>27} {'state':>27} {'seconds':>8}", flush=True)
    rows = []
    for spec in specs:
        try:
            row = check(spec, args.tiny, device, args.calls, config,
                        autocast=getattr(torch, args.autocast) if args.autocast else None)
        except ImportError as exc:
            print(f"{spec.name:<20} unavailable: {exc}", flush=True)
            continue
        except Exception as exc:  # noqa: BLE001 - a crash is this model's result, the sweep goes on
            row = {"model": spec.name, "error": f"raised {failure_text(exc)}"}
        rows.append(row)
        if "float32_grad" in row:
            cells = [" / ".join(f"{row[f'{c}_{k}']:.1e}" for c in ("float32", "noise", "float64"))
                     for k in ("grad", "loss", "state")]
            print(f"{spec.name:<20} {cells[0]:>27} {cells[1]:>27} {cells[2]:>27} {row['seconds']:8.1f}"
                  + (f"  FAILED: {row['error']}" if "error" in row else "  ok"), flush=True)
        else:
            print(f"{spec.name:<20} FAILED: {row['error']}", flush=True)
    failed = [r["model"] for r in rows if "error" in r]
    print(f"{len(rows) - len(failed)} of {len(rows)} models ok" + (f"; failed: {', '.join(failed)}" if failed else ""))
    if args.json is not None:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
