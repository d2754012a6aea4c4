"""What a failed CUDA-graph capture leaves in torch's caching allocator (session 57, run 213's abort).

    python benchmarks/failed_capture.py

Each mode runs in a process of its own, since one of them is expected to abort:
- A: a capture fails (a synchronize inside it); is its routing to the capture's pool still
  registered? (ending it succeeds only if it is)
- C: no failed capture; a MemPool used and dropped (the control: survives).
- B: a capture fails, then a MemPool used and dropped: aborts where the routing was left.
- D: as B, with the routing ended first (what profile/timing.recording does): survives.
- E: a capture fails; does `torch.cuda.empty_cache()` still give a freed 64 MiB block back?
- F: as B and E, with the capture inside `streamfuse.profile.timing.recording`.
"""

from __future__ import annotations

import subprocess
import sys

import torch


def _fail_capture(through_streamfuse: bool) -> None:
    x = torch.randn(1 << 20, device="cuda")
    graph = torch.cuda.CUDAGraph()
    try:
        if through_streamfuse:
            from streamfuse.profile.timing import recording

            with recording(graph):
                x.mul(2)
                torch.cuda.synchronize()
        else:
            with torch.cuda.graph(graph, pool=POOL, capture_error_mode="thread_local"):
                x.mul(2)
                torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - the failure is the point
        print("capture failed:", type(exc).__name__, str(exc).splitlines()[0][:160], flush=True)


def _empty_cache_returns_a_block() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    block = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del block
    torch.cuda.empty_cache()
    print(f"reserved before the block {before >> 20} MiB, after freeing it and emptying the cache "
          f"{torch.cuda.memory_reserved() >> 20} MiB", flush=True)


def _drop_a_pool(mode: str) -> None:
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        # not torch.randn: the failed capture also left the CUDA generator capturing (run 214: "Offset
        # increment outside graph capture"; the runtime settles it, compiled._settle_generators)
        kept = torch.ones(1 << 20, device="cuda")
    del kept
    print(mode, "dropping a MemPool", flush=True)
    del pool
    torch.cuda.synchronize()
    print(mode, "survived", flush=True)


POOL: tuple[int, int] = (0, 0)


def mode(m: str) -> None:
    global POOL
    torch.cuda.init()
    POOL = torch.cuda.graph_pool_handle()
    if m in "ABDEF":
        _fail_capture(through_streamfuse=m == "F")
    if m in "AD":
        try:
            torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), POOL)  # type: ignore[attr-defined]
            print("the failed capture's routing was still registered; ended it", flush=True)
        except RuntimeError as exc:
            print("no routing left:", str(exc).splitlines()[0][:160], flush=True)
        if m == "A":
            return
    if m in "EF":
        _empty_cache_returns_a_block()
    if m in "BCDF":
        _drop_a_pool(m)


def main() -> int:
    if len(sys.argv) > 1:
        mode(sys.argv[1])
        return 0
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    for m in "ACBDEF":
        r = subprocess.run([sys.executable, __file__, m], capture_output=True, text=True, timeout=120, check=False)
        print(f"== mode {m}: exit {r.returncode}\n{r.stdout}{r.stderr[-1200:]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
