"""Session 44 probes (run 163; docs/bench/s44-exp.txt): window softmax variants beside Inductor's kernel
(with its source and chosen config), bf16/fp32 pointwise GELU block sizes beside ATen, and
GEMM + GELU chunks overlapped on two streams."""
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, "src")
sys.path.insert(0, "benchmarks")
import streamfuse
from streamfuse.profile.timing import time_graph_us

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
g = torch.Generator(dev).manual_seed(0)
print(torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", torch.__version__, triton.__version__, flush=True)


@triton.jit
def _nanmax(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def win_kernel(attn, bias, mask, out, H: tl.constexpr, NW: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_R: tl.constexpr, RECIP: tl.constexpr, NANMAX: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tl.arange(0, BLOCK_R)[None, :]
    m = cols < 49
    xo0 = rows // (H * 49)
    xo1 = (rows // 49) % H
    xo2 = rows % 49
    a = tl.load(attn + rows * 49 + cols, mask=m, other=0)
    b = tl.load(bias + xo1 * 2401 + xo2 * 49 + cols, mask=m, other=0)
    k = tl.load(mask + (xo0 % NW) * 2401 + xo2 * 49 + cols, mask=m, other=0)
    x = a + b + k
    if NANMAX:
        mx = tl.reduce(tl.where(m, x, float("-inf")), 1, _nanmax)[:, None]
    else:
        mx = tl.max(tl.where(m, x, float("-inf")), 1)[:, None]
    e = tl.exp(x - mx)
    s = tl.sum(tl.where(m, e, 0.0), 1)[:, None]
    if RECIP:
        y = e * (1.0 / s)
    else:
        y = e / s
    tl.store(out + rows * 49 + cols, y, mask=m)


def window_softmax() -> None:
    import reduction_tiles as rt
    for label, (windows, heads) in (("stage 1", (64, 3)), ("stage 2", (16, 6))):
        fn, shapes = rt._window_softmax(windows, heads, 32)
        attn, bias, mask = (torch.randn(s, device=dev, generator=g) for s in shapes)
        want = fn(attn, bias, mask)
        nbytes = 2 * attn.numel() * 4
        rows = attn.numel() // 49
        out = torch.empty_like(attn)
        res = []
        for bm in (1, 2, 4, 8, 16, 32):
            for warps in (1, 2, 4, 8):
                if bm * 64 // (32 * warps) < 1:
                    continue
                for recip, nanmax in ((False, True), (True, False)):
                    launch = lambda bm=bm, warps=warps, recip=recip, nanmax=nanmax: win_kernel[(rows // bm,)](
                        attn, bias, mask, out, heads, windows, bm, 64, recip, nanmax, num_warps=warps)
                    launch()
                    err = float((out - want).abs().max())
                    us = time_graph_us(launch, calls=10, reps=10)
                    res.append((us, bm, warps, recip, nanmax, err))
        res.sort()
        print(f"window softmax {label} b32: best hand variants (µs, GB/s, BLOCK_M, warps, recip, nanmax, err)")
        for us, bm, warps, recip, nanmax, err in res[:8]:
            print(f"  {us:7.1f} {nbytes / us / 1e3:6.0f}  {bm:3d} {warps}w recip={recip} nanmax={nanmax} err={err:.1e}")
        by = {(bm, w): us for us, bm, w, r, n, _ in res if not r and n}
        print("  ours-as-generated (div, nanmax) by BLOCK_M x warps:", {f"{k[0]}x{k[1]}w": round(v, 1) for k, v in sorted(by.items())})
        by = {(bm, w): us for us, bm, w, r, n, _ in res if r and not n}
        print("  recip + tl.max by BLOCK_M x warps:", {f"{k[0]}x{k[1]}w": round(v, 1) for k, v in sorted(by.items())})
        # Inductor: its source and chosen config
        torch._dynamo.reset()
        from torch._inductor.utils import run_and_get_code
        ind = torch.compile(fn)
        _, codes = run_and_get_code(ind, attn, bias, mask)
        us = time_graph_us(lambda: ind(attn, bias, mask), calls=10, reps=10)
        print(f"  inductor {us:7.1f} {nbytes / us / 1e3:6.0f}", flush=True)
        with open(f"{OUT}/inductor_window_{label.replace(' ', '')}.py", "w") as f:
            f.write("\n\n".join(codes))
        try:
            from torch._inductor.codecache import PyCodeCache
            for mod in list(PyCodeCache.modules if hasattr(PyCodeCache, "modules") else PyCodeCache.cache.values()):
                for name in dir(mod):
                    obj = getattr(mod, name)
                    if name.startswith("triton_") and hasattr(obj, "launchers"):
                        print("  inductor kernel", name, [str(l.config) for l in obj.launchers])
        except Exception as exc:  # noqa: BLE001
            print("  (inductor config lookup failed:", exc, ")")


def pointwise() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(4096, 4096, device=dev, dtype=dtype, generator=g)
        nbytes = 2 * x.numel() * x.element_size()
        fn = lambda x: F.gelu(x)
        want = fn(x)
        cells = {"aten": time_graph_us(lambda: fn(x))}
        torch._dynamo.reset()
        ind = torch.compile(fn)
        ind(x)
        cells["inductor"] = time_graph_us(lambda: ind(x))
        for block in (1024, 2048, 4096):
            for warps in (4, 8):
                c = streamfuse.compile(fn, (x,), streamfuse.Config(cuda_graphs=False, pointwise_block=block,
                                                                  pointwise_num_warps=warps))
                err = float((c(x).float() - want.float()).abs().max())
                cells[f"{block}/{warps}w"] = time_graph_us(lambda c=c: c(x))
                if err > 1e-2:
                    print("  WRONG", block, warps, err)
        print(f"gelu {dtype} 4096x4096:", "  ".join(f"{k} {v:.1f} ({nbytes / v / 1e3:.0f})" for k, v in cells.items()),
              flush=True)


def overlap() -> None:
    dtype = torch.bfloat16
    lin = torch.nn.Linear(4096, 4096).to(device=dev, dtype=dtype)
    w, b = lin.weight.detach(), lin.bias.detach()
    side = torch.cuda.Stream()
    for batch in (512, 4096):
        x = torch.randn(batch, 4096, device=dev, dtype=dtype, generator=g)
        out = torch.empty(batch, 4096, device=dev, dtype=dtype)
        act = torch.empty(batch, 4096, device=dev, dtype=dtype)
        want = F.gelu(F.linear(x, w, b))
        cells = {"gemm": time_graph_us(lambda: F.linear(x, w, b)), "eager": time_graph_us(lambda: F.gelu(F.linear(x, w, b)))}
        for k in (2, 4, 8):
            m = batch // k

            def chunked(k=k, m=m) -> None:
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                evs = []
                for i in range(k):
                    torch.addmm(b, x[i * m:(i + 1) * m], w.t(), out=out[i * m:(i + 1) * m])
                    ev = torch.cuda.Event()
                    ev.record(main)
                    evs.append(ev)
                with torch.cuda.stream(side):
                    for i in range(k):
                        side.wait_event(evs[i])
                        torch.ops.aten.gelu.out(out[i * m:(i + 1) * m], out=act[i * m:(i + 1) * m])
                main.wait_stream(side)

            chunked()
            torch.cuda.synchronize()
            err = float((act.float() - want.float()).abs().max())
            cells[f"{k} chunks"] = time_graph_us(chunked)
            cells[f"{k} chunks err"] = err
        print(f"overlap b{batch}:", "  ".join(f"{k} {v:.3g}" for k, v in cells.items()), flush=True)


if __name__ == "__main__":
    for part in sys.argv[1:] or ["window", "pointwise", "overlap"]:
        {"window": window_softmax, "pointwise": pointwise, "overlap": overlap}[part]()
