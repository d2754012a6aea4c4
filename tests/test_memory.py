"""What recorded CUDA graphs keep (runtime/memory.py, runtime/graphs.py): the ledger's bound over all
compiled models, the retry after running out of device memory, and (GPU) a graph keeping about a
step-by-step call's peak rather than every intermediate."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

import streamfuse
from streamfuse.runtime import memory
from streamfuse.runtime.memory import GraphLedger, on_out_of_memory

CPU = torch.device("cpu")


class Owner:
    """A compiled model as the ledger sees it: graphs by key, each keeping some bytes."""

    def __init__(self, **graphs: int) -> None:
        self.graphs = dict(graphs)

    def graph_bytes(self, key: Any) -> int | None:
        return self.graphs.get(key)

    def drop_graph(self, key: Any) -> None:
        del self.graphs[key]


def test_ledger_drops_least_recently_replayed_graphs_of_any_model_beyond_the_limit() -> None:
    ledger = GraphLedger()
    a, b = Owner(x=40, y=40), Owner(z=40)
    ledger.add(a, "x", CPU, limit=100)
    ledger.add(a, "y", CPU, limit=100)
    ledger.touch(a, "x")  # x replayed after y: y is now the least recently used
    ledger.add(b, "z", CPU, limit=100)  # 120 > 100: y goes, not x
    assert a.graphs == {"x": 40} and b.graphs == {"z": 40}
    assert ledger.kept_bytes(CPU) == 80 and ledger.dropped == 1
    big = Owner(w=500)
    ledger.add(big, "w", CPU, limit=100)  # over the limit alone: it stays, every other graph goes
    assert big.graphs == {"w": 500} and a.graphs == {} and b.graphs == {}
    assert ledger.kept_bytes(CPU) == 500


def test_ledger_forgets_collected_owners_and_graphs_dropped_elsewhere() -> None:
    ledger = GraphLedger()
    a, b = Owner(x=10), Owner(y=10, z=10)
    ledger.add(a, "x", CPU, limit=1000)
    ledger.add(b, "y", CPU, limit=1000)
    ledger.add(b, "z", CPU, limit=1000)
    del a
    gc.collect()
    b.drop_graph("y")  # the owner's own LRU (Config.max_graphs) evicted it
    assert ledger.kept_bytes(CPU) == 10
    assert ledger.release(CPU) == 1 and b.graphs == {}
    assert ledger.dropped == 1  # only what the ledger itself dropped


def test_out_of_memory_drops_the_recorded_graphs_and_runs_the_call_once_more(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    ledger = GraphLedger()
    monkeypatch.setattr(memory, "LEDGER", ledger)
    owner = Owner(x=10)
    ledger.add(owner, "x", CPU, limit=1000)
    calls: list[int] = []

    def call() -> str:
        calls.append(len(owner.graphs))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return "done"

    with pytest.warns(UserWarning, match="ran out of device memory; dropped 1 recorded CUDA graph"):
        assert on_out_of_memory(call, CPU) == "done"
    assert calls == [1, 0]  # the retry ran after the graph was dropped


def test_out_of_memory_twice_raises_and_nested_calls_are_handled_once(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(memory, "LEDGER", GraphLedger())
    attempts: list[str] = []

    def inner() -> None:
        attempts.append("inner")
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    with pytest.warns(UserWarning, match="ran out of device memory"), pytest.raises(torch.OutOfMemoryError):
        on_out_of_memory(lambda: on_out_of_memory(inner, CPU), CPU)
    assert attempts == ["inner", "inner"]  # the outer handler retried once; the inner one did not
    assert memory._handling == 0


def test_graph_memory_fraction_is_validated() -> None:
    with pytest.raises(ValueError, match="graph_memory_fraction"):
        streamfuse.Config(graph_memory_fraction=0.0)


gpu = pytest.mark.gpu


def _chain(width: int, depth: int) -> torch.nn.Module:
    """`depth` bias-free Linear layers in a row: nothing fuses across a matmul, so a call has about
    two intermediates alive at a time, and a graph that kept every intermediate would keep `depth`."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(depth)]).cuda().eval()


@gpu
def test_a_recorded_graph_keeps_about_a_step_by_step_peak_not_every_intermediate(config) -> None:  # type: ignore[no-untyped-def]
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    depth, rows, width = 16, 4096, 1024
    model = _chain(width, depth)
    x = torch.randn(rows, width, device="cuda")
    one = rows * width * 4  # bytes of one intermediate (16 MiB)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config.replace(output_sets=0))
        out, ref = compiled(x), model(x)
    assert compiled.stats["graphs"] == 1
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3 * float(ref.abs().max()))
    (runner,) = compiled._runners.values()
    # static input + pool (about two intermediates at a time + the output, a matmul workspace, the
    # allocator's segment rounding); every intermediate kept (the capture before session 17) would be
    # at least `depth` of them
    assert runner.reserved_bytes < 8 * one, runner.reserved_bytes / one
    assert compiled.stats["graph_mib"] == pytest.approx(runner.reserved_bytes / 2**20, abs=0.1)


@gpu
def test_graphs_beyond_the_memory_fraction_are_dropped_and_recorded_again(config) -> None:  # type: ignore[no-untyped-def]
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from test_runtime import mlp

    model = mlp(64, 256, 32).cuda()
    # a limit below any graph: recording one drops every other (of any model)
    cfg = config.replace(graph_memory_fraction=1e-9)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (torch.randn(8, 64, device="cuda"),), cfg)
        for batch in (8, 3, 8, 3):
            x = torch.randn(batch, 64, device="cuda")
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
            assert list(compiled._runners) == [8 if batch == 8 else 4], \
                {k: compiled.graph_bytes(k) for k in compiled._runners}  # sizes the ledger saw (run 73: not dropped)
    assert compiled.stats["graphs"] == 1


@gpu
def test_a_call_that_runs_out_of_memory_drops_graphs_and_runs_again(config, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from test_runtime import mlp

    model = mlp(64, 256, 32).cuda()
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config)
        compiled(x)
        assert compiled.stats["graphs"] == 1
        replay = compiled._replay
        failed: list[bool] = []

        def once_out_of_memory(inputs: Any) -> Any:
            if not failed:
                failed.append(True)
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return replay(inputs)

        monkeypatch.setattr(compiled, "_replay", once_out_of_memory)
        with pytest.warns(UserWarning, match="ran out of device memory"):
            out = compiled(x)
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
    assert failed and compiled.stats["graphs"] == 1  # dropped, then recorded again by the retry


def test_a_graph_that_updates_inputs_in_place_is_never_run_twice(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(memory, "LEDGER", GraphLedger())
    calls: list[int] = []

    def half_applied_update() -> None:
        calls.append(1)
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    with pytest.raises(torch.OutOfMemoryError):
        on_out_of_memory(half_applied_update, CPU, retry=False)
    assert calls == [1]


def test_the_backend_retries_only_graphs_without_in_place_updates() -> None:
    from streamfuse.capture.backend import _mutates

    def pure(x: torch.Tensor) -> torch.Tensor:
        return x.sin() + 1

    def update(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        state.copy_(x * 2)
        return x + 1

    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(4)
    assert not _mutates(make_fx(pure)(x))
    assert _mutates(make_fx(update)(x, torch.zeros(4)))


def test_blas_workspaces_are_dropped_before_and_after_a_capture_even_when_it_fails(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from streamfuse.profile.timing import blas_workspaces_in_pool

    calls: list[str] = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("clear"), raising=False)
    with blas_workspaces_in_pool():
        calls.append("capture")
    assert calls == ["clear", "capture", "clear"]
    calls.clear()
    with pytest.raises(RuntimeError, match="capture failed"), blas_workspaces_in_pool():
        raise RuntimeError("capture failed")
    assert calls == ["clear", "clear"]


def test_a_failed_capture_ends_the_allocators_routing_to_its_pool(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Run 213 (session 57): a test worker aborted as it dropped a warm-up pool. torch 2.11 leaves a
    failed capture's routing registered (its capture_end raises before ending it), and dropping a
    MemPool then aborts: the likely cause (PERF.md). recording() ends the routing when the capture
    raises, and only then; torch refusing (it ended it) is no error."""
    from contextlib import contextmanager

    from streamfuse.profile import timing

    ended: list[tuple[int, tuple[int, int]]] = []
    refuse = [False]

    def end(device: int, pool: tuple[int, int]) -> None:
        if refuse[0]:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        ended.append((device, pool))

    @contextmanager
    def graph(g, pool, capture_error_mode):  # type: ignore[no-untyped-def]
        assert capture_error_mode == "thread_local"
        yield
        if g == "bad":
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None, raising=False)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 9))
    with timing.recording("good", (0, 5)):  # type: ignore[arg-type]
        pass
    assert ended == []
    with pytest.raises(RuntimeError, match="stream is capturing"), timing.recording("bad"):  # type: ignore[arg-type]
        pass
    assert ended == [(3, (0, 9))]
    refuse[0] = True
    with pytest.raises(RuntimeError, match="stream is capturing"), timing.recording("bad", (0, 5)):  # type: ignore[arg-type]
        pass
    assert not timing.end_routing(3, (0, 5))


def test_a_warmup_pool_dropped_while_routing_is_registered_waits(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Dropping a MemPool empties its cache, which torch refuses (aborting) while a capture or a
    use_mem_pool is under way: a warm-up pool whose last holder goes then (a graph collected as
    garbage inside a capture) is kept until the next call outside both."""
    from streamfuse.runtime import replay

    class Pool:
        pass

    capturing = [True]
    monkeypatch.setattr(torch.cuda, "MemPool", Pool)
    monkeypatch.setattr(replay, "_capturing", lambda: capturing[0])
    monkeypatch.setattr(replay, "_DEFERRED", [])
    warm = replay._WarmupPool()
    pool = warm.pool
    del warm
    gc.collect()
    assert replay._DEFERRED == [pool]
    replay._release_deferred()  # still capturing
    assert replay._DEFERRED == [pool]
    capturing[0] = False
    monkeypatch.setattr(replay, "_in_warmup_pool", 1)  # inside a warm-up call's use_mem_pool
    replay._release_deferred()
    assert replay._DEFERRED == [pool]
    replay._WarmupPool()  # dropped at once: deferred too
    assert len(replay._DEFERRED) == 2
    monkeypatch.setattr(replay, "_in_warmup_pool", 0)
    replay._release_deferred()
    assert replay._DEFERRED == []
    replay._WarmupPool()  # outside both: dropped at once, as before
    assert replay._DEFERRED == []


def _live_blocks(pools: set[tuple[int, int]] | None = None, before: frozenset[int] | set[int] = frozenset()) -> list[str]:
    """Live blocks (of `pools`, or all; less those at the addresses `before`), each with its size, pool
    and the Python frames that allocated it where the allocator's history is on: what a leak is made of,
    or what keeps a pool from going back to the device."""
    out = []
    for seg in torch.cuda.memory_snapshot():
        pool = tuple(seg.get("segment_pool_id", (0, 0)))
        if pools is not None and pool not in pools:
            continue
        for block in seg.get("blocks", []):
            if block.get("state") == "active_allocated" and block.get("address") not in before:
                frames = [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
                          for f in block.get("frames", []) if f["filename"].endswith(".py")][:8]
                out.append(f"{block.get('size')} B in pool {pool}: {' < '.join(frames) or 'no Python frames'}")
    return out


def _live_addresses() -> set[int]:
    return {b.get("address") for seg in torch.cuda.memory_snapshot() for b in seg.get("blocks", [])
            if b.get("state") == "active_allocated"}


@gpu
def test_compiling_recording_and_dropping_models_gives_all_their_memory_back(config) -> None:  # type: ignore[no-untyped-def]
    """Run 102 (trainmem): cuBLAS workspaces of every stream that ran a matmul (the tuner's timing
    graphs, the runners' side streams, the warm-ups) stayed allocated after the models were gone."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from test_runtime import mlp

    inference = mlp(256, 1024, 256).cuda().eval()
    trained = mlp(256, 1024, 256).cuda()
    x = torch.randn(64, 256, device="cuda")
    torch.cuda.synchronize()
    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()
    before = _live_addresses()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        compiled = streamfuse.compile(inference, (x,), config)
        for _ in range(3):
            torch.testing.assert_close(compiled(x), inference(x), rtol=1e-4, atol=1e-4)
    assert compiled.stats["graphs"] == 1
    backend = torch.compile(trained, backend=streamfuse.make_backend(config))
    for _ in range(8):  # the forward and backward graphs record within six calls (runtime/replay.py)
        backend(x).square().mean().backward()
        trained.zero_grad(set_to_none=True)
    del compiled, backend
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.synchronize()
    leaked = torch.cuda.memory_allocated() - base
    assert leaked <= 1 << 20, (leaked, _live_blocks(before=before))


def _pool_of(t: torch.Tensor) -> tuple[int, int]:
    """The allocator pool whose segment holds `t`'s memory ((0, 0): the default pool)."""
    ptr = t.data_ptr()
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return tuple(seg.get("segment_pool_id", (0, 0)))  # type: ignore[return-value]
    raise AssertionError(f"no segment holds {ptr:#x}")


@gpu
@pytest.mark.parametrize("warmup_pool", [True, False])
def test_training_calls_before_the_graphs_record_allocate_in_a_pool_given_back_after(config, warmup_pool) -> None:  # type: ignore[no-untyped-def]
    """Run 211: the backend's training calls before its CUDA graphs record (step by step) left their
    activations' and gradients' free blocks in the default pool among the parameters and the
    optimizer's state allocated beside them, where no replay reuses them (BERT-base: 277 MiB).
    With Config.training_warmup_pool those calls allocate in a pool of their own (the first
    gradients lie there), and that pool is gone once the graphs recorded and its tensors were freed."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")  # frames for the failure's message
    try:
        _train_through_the_warmup_pool(config, warmup_pool)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def _train_through_the_warmup_pool(config, warmup_pool: bool) -> None:  # type: ignore[no-untyped-def]
    from test_runtime import mlp

    from streamfuse.capture import backend as backend_module

    torch.manual_seed(0)
    model = mlp(256, 1024, 256).cuda()
    reference = mlp(256, 1024, 256).cuda()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(64, 256, device="cuda")
    backend = torch.compile(model, backend=streamfuse.make_backend(config.replace(training_warmup_pool=warmup_pool)))
    backend(x).square().mean().backward()
    reference(x).square().mean().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    assert {_pool_of(g) != (0, 0) for g in grads} == {warmup_pool}  # type: ignore[arg-type]
    torch.testing.assert_close(grads, [p.grad for p in reference.parameters()], rtol=1e-4, atol=1e-5)
    warm_pools = {_pool_of(g) for g in grads} - {(0, 0)}  # type: ignore[arg-type]
    # no name may keep a first gradient (run 212: a loop variable held the last one, and with it
    # the pool's segment, to the end)
    del grads
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-2, momentum=0.9)
    opt.step()
    ref_opt.step()
    for _ in range(8):  # the forward and backward graphs record within six calls (runtime/replay.py)
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        loss = backend(x).square().mean()
        loss.backward()
        reference(x).square().mean().backward()
        opt.step()
        ref_opt.step()
    stats = [g.replay_stats for g in backend_module.compiled_graphs if hasattr(g, "replay_stats")][-2:]
    assert [s.recordings for s in stats] == [1, 1], [s.history for s in stats]
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    del loss
    opt.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    left = {tuple(seg.get("segment_pool_id", (0, 0))) for seg in torch.cuda.memory_snapshot()}
    assert not warm_pools & left, (warm_pools, left, _live_blocks(warm_pools))



class _Branches(torch.nn.Module):
    """Independent matmuls on one input (the runner puts them on side streams), long K and few rows
    (shapes where cuBLAS uses its workspace for split-K)."""

    def __init__(self, k: int = 8192, n: int = 64, branches: int = 4) -> None:
        super().__init__()
        self.branches = torch.nn.ModuleList(torch.nn.Linear(k, n) for _ in range(branches))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.relu(b(x)) for b in self.branches], dim=1)


@gpu
def test_recorded_graphs_survive_cublas_workspaces_being_cleared_and_memory_released(config) -> None:  # type: ignore[no-untyped-def]
    """Inductor clears cuBLAS's workspaces around its recordings. A graph of ours that had baked in a
    workspace from the default pool (allocated by an earlier call on the same stream) would then
    write into freed, possibly unmapped memory on every replay (run 103: illegal addresses)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    model = _Branches().cuda().eval()
    x = torch.randn(8, 8192, device="cuda")
    with torch.no_grad():
        ref = model(x)
        compiled = streamfuse.compile(model, (x,), config.replace(matmul_strategy="cublas"))
        for _ in range(3):
            compiled(x)
        assert compiled.stats["graphs"] == 1
        for _ in range(3):
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()
            churn = [torch.full((1 << 22,), float(i), device="cuda") for i in range(16)]
            out = compiled(x)
            torch.cuda.synchronize()
            assert all(float(c[0]) == i for i, c in enumerate(churn))  # nothing wrote into them
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
            del churn


@pytest.mark.parametrize("cpp_loop", ["fallback", "emulated", "torch"])
def test_pointer_check_sees_a_parameter_given_new_memory(cpp_loop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """PointerCheck (the per-call check that bound parameters kept their memory) through torch's C++
    loop (CUDA builds only: "torch" is skipped elsewhere; "emulated" follows its contract,
    `tensors[i].data_ptr() == ptrs[i]` for i in indices, ptrs aligned with tensors) and through the
    map it falls back to; a tuple always takes the map (the C++ loop takes a list only)."""
    if cpp_loop == "torch" and memory._POINTERS_EQUAL is None:
        pytest.skip("torch._C._tensors_data_ptrs_at_indices_equal is in CUDA builds of torch only")

    def loop(tensors: list, ptrs: list, indices: list) -> bool:  # type: ignore[type-arg]
        assert type(tensors) is list and len(ptrs) == len(tensors)
        return all(tensors[i].data_ptr() == ptrs[i] for i in indices)

    if cpp_loop != "torch":
        monkeypatch.setattr(memory, "_POINTERS_EQUAL", loop if cpp_loop == "emulated" else None)
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]
    args = [torch.randn(2), params[0], 7, params[1], params[2]]  # a batch, parameters, a non-tensor
    check = memory.PointerCheck(args, [1, 3, 4])
    assert check.same(args) and check.same(tuple(args))
    assert memory.PointerCheck(args, []).same(args) and memory.PointerCheck(args, [3]).same(args)
    args[0] = torch.randn(2)  # an unchecked position moves: still the same
    assert check.same(args)
    params[1].data = torch.randn(4)  # new memory, no version bump
    assert not check.same(args) and not check.same(tuple(args))
