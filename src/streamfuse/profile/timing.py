"""Timing the way METHOD.md asks: warm up, CUDA events around each call, median of many.

Calls are issued back to back with no synchronization between them (as triton.testing.do_bench
does), so a call's events bracket its GPU work once the queue runs ahead of the host; when the
host is slower than the GPU, the gaps show up in the time, as they do for a user's loop."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


def time_cuda_us(fn: Callable[[], Any], warmup: int = 10, reps: int = 50) -> float:
    """Median microseconds per call of `fn` on the current stream."""
    return statistics.median(time_cuda_samples(fn, warmup, reps))


def time_cuda_samples(fn: Callable[[], Any], warmup: int = 10, reps: int = 50) -> list[float]:
    """Microseconds of each of `reps` calls of `fn` on the current stream, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends, strict=True):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends, strict=True)]


@contextmanager
def blas_workspaces_in_pool() -> Iterator[None]:
    """Around a CUDA graph's capture (not its warm-up): cuBLAS's workspaces dropped before and after.

    cuBLAS keeps one workspace per (handle, stream) pair, allocated through the caching allocator at
    its first matmul on that stream and held until they are cleared. Without this, (1) a capture
    bakes in the address of a workspace that an earlier eager or step-by-step call allocated in the
    default pool: anyone clearing the workspaces (Inductor's CUDA graph trees do, around each of
    their recordings) returns that block to the default pool while the graph still writes to it on
    every replay; (2) every stream that ever ran a matmul (each timing graph's, the runners' side
    streams, the warm-up streams) keeps a workspace allocated for good (trainmem, run 102: 97 MiB
    in 4 blocks after resnet18's training graphs recorded, 130 MiB more from the tuner's timings on
    GPT-2). Dropped before, the capture allocates the workspaces it needs in the graph's own pool;
    dropped after, they are free blocks of that pool, which only that graph's replays use. Inductor
    does the same around its recordings.

    Only around the capture itself: a warm-up between the first drop and the capture (run 103)
    put workspaces of the default pool back in cuBLAS's table, the capture baked their addresses
    in, and the second drop freed them while the graph still used them; later allocations and
    `empty_cache` took the memory back, and replays of HF BERT and Llama training graphs faulted
    (illegal address). The drop before the capture also releases the warm-up's workspaces."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    try:
        yield
    finally:
        if clear is not None:
            clear()


@contextmanager
def recording(graph: torch.cuda.CUDAGraph, pool: tuple[int, int] | None = None,
              thread_local: bool = True) -> Iterator[None]:
    """`torch.cuda.graph(graph, pool=pool)` inside blas_workspaces_in_pool, that leaves the caching
    allocator consistent when the capture fails.

    torch 2.11's capture_end checks cudaStreamEndCapture's error before it ends the allocator's
    routing to the capture's pool, so a failed capture (an operation illegal under capture: a
    synchronizing custom op, a host read) left that routing registered for good. With any routing
    registered, `torch.cuda.empty_cache()` keeps every cached block of the default pool, and
    dropping a `torch.cuda.MemPool` whose pool becomes freeable aborts the process (an internal
    assert in a destructor; run 213 aborted a test worker as it dropped the warm-up pool of
    Config.training_warmup_pool, most likely after test_gpu's capture failure in that worker: PERF.md
    session 57). Newer torch ends the routing itself; ending it here is then refused, which is fine.
    thread_local: see runtime/pinned.py."""
    device = torch.cuda.current_device()
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    try:
        with blas_workspaces_in_pool(), torch.cuda.graph(graph, pool=pool,
                                                         capture_error_mode="thread_local" if thread_local else "global"):
            yield
    except BaseException:
        end_routing(device, pool)
        raise


def end_routing(device: int, pool: tuple[int, int]) -> bool:
    """End the caching allocator's routing of allocations to `pool` if a failed capture left it
    (recording); False where none was left."""
    try:
        torch._C._cuda_endAllocateToPool(device, pool)  # type: ignore[attr-defined]
    except RuntimeError:  # "not currently recording to mempool_id": torch ended it
        return False
    return True


def capture_graph(fn: Callable[[], Any], calls: int = 1, warmup: int = 3) -> tuple[torch.cuda.CUDAGraph, Any]:
    """`fn` warmed up on a side stream, then `calls` calls of it captured into one CUDA graph;
    returns the graph and what the last captured call returned (its static outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    out = None
    with recording(graph, thread_local=False):
        for _ in range(calls):
            out = fn()
    return graph, out


def time_graph_us(fn: Callable[[], Any], calls: int = 10, reps: int = 20) -> float:
    """Median GPU time per call of `fn` replayed from a CUDA graph: kernel time without any host
    overhead (what the kernels themselves achieve)."""
    graph, _ = capture_graph(fn, calls)
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / calls)
    return statistics.median(samples)


def fork_join(fns: list[Callable[[], Any]]) -> Callable[[], None]:
    """A call that runs each of `fns` on its own stream, forked from and joined to the current one
    (captured into a CUDA graph, the streams become parallel branches)."""
    streams = [torch.cuda.Stream() for _ in fns]

    def together() -> None:
        main = torch.cuda.current_stream()
        for stream, fn in zip(streams, fns, strict=True):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                fn()
        for stream in streams:
            main.wait_stream(stream)

    return together


def time_concurrent_us(fns: list[Callable[[], Any]], calls: int = 10, reps: int = 20) -> float:
    """Median GPU µs per round of `fns` run at once (fork_join), replayed from a CUDA graph."""
    return time_graph_us(fork_join(fns), calls, reps)


def host_us_per_call(fn: Callable[[], Any], burst: int = 20, rounds: int = 40) -> float:
    """Host time of one call: bursts short enough that the launch queue never blocks the host,
    synchronized between bursts outside the timed region."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(burst):
            fn()
        samples.append((time.perf_counter() - t) / burst * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)
