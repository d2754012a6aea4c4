"""Greedy text generation with Hugging Face `generate()`, side by side in one process: tokens per
second and first-call (compile) seconds for eager and for the model's forward compiled by
torch.compile (default and reduce-overhead) and by the streamfuse backend; every mode's tokens must
equal eager's (a mismatch is reported as a failure, not a speed).

    python benchmarks/generate.py [--model gpt2|llama] [--new-tokens 128] [--prompt 16]
                                  [--modes eager,compile,compile-ro,streamfuse] [--cache static|dynamic]

A streamfuse mode may carry Config settings, `streamfuse[matmul_strategy=cublas]`, to compare
settings side by side in one run. `streamfuse-hf` is transformers' own compile (its CompileConfig)
with backend="streamfuse": the decode steps alone are compiled, the prefill runs eagerly, and the
static cache reaches the backend as static inputs (it is created outside the trace), as in
compile-ro; `streamfuse` compiles the whole forward, prefill included.

Each mode runs in a process of its own (a crash in one is reported, not fatal to the others;
`--in-process` runs them in one). `--cache static` (the default) is transformers' StaticCache (`cache_implementation="static"`), the
setting transformers documents for torch.compile: fixed shapes, so one graph for the prefill and one
for every decode step. `--cache dynamic` grows the cache by one token per step: Dynamo then hands
the backend symbolic lengths, and streamfuse builds one plan per length (issue 17: slow until its
kernels take sizes at run time). `--tiny` uses a one-layer config (a CPU smoke test).

With a static cache on CUDA, transformers' generate() compiles the model's `__call__` itself
(its CompileConfig: Inductor, mode="reduce-overhead") around whatever forward is installed. So
eager, compile and streamfuse pass `disable_compile=True` (runs 66-67 measured transformers'
graphs in every row, the modes' own forward nested inside them), and compile-ro *is* transformers'
own compile, set to reduce-overhead: what a user of generate() with a static cache gets. (Wrapping
`model.forward` in torch.compile(mode="reduce-overhead") ourselves died with a segmentation fault
inside generate() on torch 2.11 in runs 65, 67 and 68.) On the CPU transformers does not compile,
so compile-ro is eager there.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

MODES = ("eager", "compile", "compile-ro", "streamfuse", "streamfuse-hf")


def build(name: str, tiny: bool, device: torch.device, dtype: torch.dtype) -> Any:
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":  # gpt2 (124M, 12 layers): the config's defaults
        config = (transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=256, n_positions=256,
                                           bos_token_id=0, eos_token_id=0)
                  if tiny else transformers.GPT2Config())
        model = transformers.GPT2LMHeadModel(config)
    elif name == "llama":  # grouped-query attention, RoPE, RMSNorm, SwiGLU
        sizes: dict[str, Any] = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256)
                                 if tiny else dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=32000))
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(max_position_embeddings=2048, **sizes))
    else:
        raise SystemExit(f"error: --model takes gpt2 or llama, got {name!r}")
    model.generation_config.pad_token_id = 0
    return model.eval().to(device, dtype)


@functools.cache
def transformers_generation_config() -> Any:
    import transformers

    return transformers.GenerationConfig()


def generate(model: Any, ids: torch.Tensor, new_tokens: int, cache: str, own_compile: bool = False) -> torch.Tensor:
    """`own_compile`: let transformers compile the forward (its reduce-overhead CompileConfig)."""
    kwargs: dict[str, Any] = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  attention_mask=torch.ones_like(ids))
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    if not own_compile and hasattr(transformers_generation_config(), "disable_compile"):
        kwargs["disable_compile"] = True  # see the module's docstring
    with torch.no_grad():
        return model.generate(ids, **kwargs)  # type: ignore[no-any-return]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_mode(mode: str, model: Any, ids: torch.Tensor, args: argparse.Namespace, reference: torch.Tensor | None,
             device: torch.device) -> dict[str, Any]:
    import streamfuse

    forward = model.forward
    torch._dynamo.reset()
    result: dict[str, Any] = {"mode": mode}
    try:
        if mode == "compile":
            model.forward = torch.compile(forward)
        elif mode == "compile-ro":
            import transformers

            model.generation_config.compile_config = transformers.CompileConfig(mode="reduce-overhead")
        elif mode == "streamfuse-hf":
            import transformers

            model.generation_config.compile_config = transformers.CompileConfig(backend="streamfuse", mode="default")
        elif mode.startswith("streamfuse"):
            model.forward = torch.compile(forward, backend=streamfuse.make_backend(streamfuse.Config().with_settings(
                mode_settings(mode))))
        start = time.perf_counter()
        own = mode in ("compile-ro", "streamfuse-hf")
        out = generate(model, ids, args.new_tokens, args.cache, own)
        sync(device)
        result["first_s"] = time.perf_counter() - start  # compiles, records graphs
        out = generate(model, ids, args.new_tokens, args.cache, own)  # a second warm-up (graph trees record late)
        if reference is not None and not torch.equal(out, reference):
            differ = int((out != reference).sum())
            result["error"] = f"tokens differ from eager's at {differ} of {out.numel()} positions"
            return result
        times = []
        for _ in range(args.reps):
            sync(device)
            start = time.perf_counter()
            generate(model, ids, args.new_tokens, args.cache, own)
            sync(device)
            times.append(time.perf_counter() - start)
        seconds = sorted(times)[len(times) // 2]
        result["tokens_per_s"] = ids.shape[0] * args.new_tokens / seconds
        result["tokens"] = out
        if args.profile:
            result.update(profiled(lambda: generate(model, ids, args.new_tokens, args.cache, own), mode,
                                   args.new_tokens, device))
    except Exception as exc:  # noqa: BLE001 - a failing mode is reported, not fatal
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    finally:
        model.forward = forward
        model.generation_config.compile_config = None
        if hasattr(model, "_compiled_call"):  # transformers' compiled __call__ (compile-ro)
            del model._compiled_call
        torch._dynamo.reset()
    return result


def mode_settings(mode: str) -> list[str]:
    """A streamfuse mode's Config settings: `streamfuse[name=value;name=value]` (none for `streamfuse`)."""
    _, _, rest = mode.partition("[")
    return [s for s in rest.rstrip("]").split(";") if s.strip()]


def profiled(call: Any, mode: str, tokens: int, device: torch.device) -> dict[str, str]:
    """One more generate() under torch.profiler (GPU kernels per token: what the replays cost on the
    device) and under cProfile (where the host's time per token goes), as text for the log."""
    import cProfile
    import pstats

    import streamfuse
    from streamfuse.profile.outputs import summary_text

    out: dict[str, str] = {}
    if device.type == "cuda":
        with streamfuse.profile(mode, calls=tokens, nvml=False) as prof:
            call()
        assert prof.report is not None
        out["gpu_profile"] = summary_text(prof.report, top=15, per="token")
    host = cProfile.Profile()
    host.runcall(call)
    stats = pstats.Stats(host).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:25]
    lines = [f"{mode}: host time per token by function (cProfile's own overhead included; tottime, cumtime)"]
    for (path, line, name), (_, calls, tottime, cumtime, _) in rows:
        where = f"{Path(path).name}:{line}" if line else path
        lines.append(f"  {1e6 * tottime / tokens:8.1f} {1e6 * cumtime / tokens:8.1f} µs  {calls / tokens:6.1f}x  {name} ({where})")
    out["host_profile"] = "\n".join(lines)
    return out


def isolated(args: argparse.Namespace, modes: list[str]) -> int:
    """Each mode in a fresh process (this script with --in-process and one mode): run 65 died with a
    segmentation fault somewhere among four modes sharing a process, and took every row with it. A
    mode whose process dies is reported as a failure with its exit status and last lines (Python's
    fault handler on), and the other modes keep their rows. Each process checks its tokens against
    eager's tokens, computed in that process."""
    import os
    import subprocess
    import tempfile

    rows = []
    print_header = True
    for mode in modes:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "row.json"
            argv = [sys.executable, __file__, "--in-process", "--modes", mode, "--json", str(out), "--model", args.model,
                    "--new-tokens", str(args.new_tokens), "--prompt", str(args.prompt), "--batch", str(args.batch),
                    "--dtype", args.dtype, "--cache", args.cache, "--reps", str(args.reps)] + (["--tiny"] if args.tiny else []) \
                + (["--profile"] if args.profile else [])
            proc = subprocess.run(argv, capture_output=True, text=True, env=os.environ | {"PYTHONFAULTHANDLER": "1"})
            if print_header and proc.stdout:
                print(proc.stdout.splitlines()[0])  # the workload line
                print_header = False
            if out.exists():
                rows += json.loads(out.read_text())["rows"]
            else:
                tail = " | ".join(line for line in (proc.stderr or "").splitlines()[-6:] if line.strip())
                rows.append({"mode": mode, "error": f"the mode's process exited with status {proc.returncode} before "
                                                    f"reporting: {tail}"[:600]})
    report(rows, args)
    return 0 if all("error" not in r for r in rows) else 1


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    eager = next((r.get("tokens_per_s") for r in results if r["mode"] == "eager"), None)
    ro = next((r.get("tokens_per_s") for r in results if r["mode"] == "compile-ro"), None)
    width = max(12, *(len(r["mode"]) for r in results))
    print(f"{'mode':<{width}} {'tokens/s':>10} {'vs eager':>9} {'vs RO':>7} {'first call s':>13}  tokens")
    for r in results:
        tps = r.get("tokens_per_s")
        cells = [f"{tps:10.1f}" if tps else f"{'-':>10}",
                 f"{tps / eager:8.2f}x" if tps and eager else f"{'-':>9}",
                 f"{tps / ro:6.2f}x" if tps and ro else f"{'-':>7}",
                 f"{r['first_s']:13.1f}" if "first_s" in r else f"{'-':>13}"]
        print(f"{r['mode']:<{width}} " + " ".join(cells) + ("  same as eager" if "error" not in r else f"  FAILED: {r['error']}"))
    for r in results:
        for key in ("gpu_profile", "host_profile"):
            if key in r:
                print(r[key])
    if args.json is not None:
        rows = [{k: v for k, v in r.items() if k != "tokens"} for r in results]
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--cache", default="static", choices=["static", "dynamic"])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="after timing, one more generate() per mode under torch.profiler (GPU kernels per token) "
                         "and cProfile (host time by function)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--in-process", action="store_true",
                    help="run every mode in this process (default: each in a process of its own, see below)")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m.partition("[")[0] not in MODES or ("[" in m and not m.startswith("streamfuse[")) for m in modes):
        raise SystemExit(f"error: --modes takes {', '.join(MODES)} (streamfuse also as streamfuse[NAME=VALUE;...] "
                         f"with Config settings); got {args.modes!r}")
    for m in modes:
        try:
            __import__("streamfuse").Config().with_settings(mode_settings(m))
        except (ValueError, TypeError) as exc:
            raise SystemExit(f"error: --modes {m!r}: {exc}") from exc
    if not args.in_process and len(modes) > 1:
        return isolated(args, modes)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    model = build(args.model, args.tiny, device, dtype)
    vocab = int(model.config.vocab_size)
    ids = torch.randint(1, vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1)).to(device)
    reference = generate(model, ids, args.new_tokens, args.cache)  # eager's tokens: what every mode must give
    print(f"{args.model}{' (tiny)' if args.tiny else ''} {args.dtype} batch {args.batch}, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens, {args.cache} cache, on {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}")
    results = [run_mode(m, model, ids, args, reference, device) for m in modes]
    report(results, args)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
