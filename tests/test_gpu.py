"""GPU tier: compiled (not interpreted) kernels on CUDA, at sizes that fill the chip.

Run on the device machine: `pytest -m gpu`. (The rest of the suite also runs on CUDA there:
the `device` fixture picks the GPU.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_to_reference, compile_and_check, randn

import streamfuse
from streamfuse.bench.workloads import chain8
from streamfuse.cli import max_error
from streamfuse.demo_models import DEMO_MODELS

pytestmark = pytest.mark.gpu


@pytest.fixture
def ieee_convs(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN convolutions in full float32, in eager and streamfuse alike. Batch-norm folding (on by
    default) hands the convs other weights than eager's, and with TF32 the two round differently
    (~1e-3 relative): that would drown what the tight eager comparisons check, streamfuse's kernels."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(DEMO_MODELS))
def test_demo_models_match_eager_on_gpu(name: str, dtype: torch.dtype, config, ieee_convs) -> None:  # type: ignore[no-untyped-def]
    model, inputs = DEMO_MODELS[name](torch.device("cuda"), dtype)
    with torch.no_grad():
        compiled = streamfuse.compile(model, inputs, config)
        assert compiled.executor == "triton"
        out = compiled(*inputs)
        eager = model(*inputs)
        wide = _double(model)(*[t.double() for t in inputs])
    scale = max(float(wide.abs().max()), 1.0)
    if dtype == torch.float32:
        # cuBLAS/cuDNN may use TF32 for float32 (as eager does): compare with eager's own result
        # tightly (only streamfuse's generated kernels differ), and with float64 at TF32 accuracy
        assert max_error(out, eager) <= 1e-4 * scale, compiled.explain(source=False)
        assert max_error(out, wide) <= 5e-3 * scale
    else:
        tol = {torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]
        assert max_error(out, wide) <= tol * scale, compiled.explain(source=False)


def _double(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model).double()


def test_large_pointwise_chain_fills_the_grid(config) -> None:  # type: ignore[no-untyped-def]
    x = randn(64 * 2**20, device="cuda")
    compiled = compile_and_check(chain8, [x], config)
    src = next(iter(compiled.sources.values()))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert src.grid[0] >= 2 * sms
    assert compiled.stats["kernels"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_and_layer_norm_4096(config, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    x = randn(4096, 4096, device="cuda", dtype=dtype)
    w, b = randn(4096, device="cuda", dtype=dtype, seed=1), randn(4096, device="cuda", dtype=dtype, seed=2)
    sm = compile_and_check(lambda t: torch.softmax(t, -1), [x], config)
    ln = compile_and_check(lambda t, w, b: F.layer_norm(t, (4096,), w, b), [x, w, b], config)
    assert sm.stats["kernels"] == 1 and ln.stats["kernels"] == 1


def test_repeated_calls_are_stable(config) -> None:  # type: ignore[no-untyped-def]
    fn = lambda x, r: F.gelu(F.layer_norm(x + r, (1024,))) * torch.softmax(x, -1)
    x, r = randn(512, 1024, device="cuda", seed=3), randn(512, 1024, device="cuda", seed=4)
    compiled = streamfuse.compile(fn, (x, r), config)
    first = compiled(x, r)
    assert_close_to_reference(first, fn, [x, r])
    for _ in range(20):
        torch.testing.assert_close(compiled(x, r), first, rtol=0, atol=0)


def test_int64_indexing_beyond_two_giga_elements(config) -> None:  # type: ignore[no-untyped-def]
    n = 2**31 + 4096
    x = torch.empty(n, device="cuda", dtype=torch.int8).random_(-100, 100)
    compiled = streamfuse.compile(lambda t: t * 2 + 1, (x,), config)
    assert "int64" in next(iter(compiled.sources.values())).source
    out = compiled(x)
    tail = slice(n - 5000, n)
    torch.testing.assert_close(out[tail], x[tail] * 2 + 1)
    torch.testing.assert_close(out[:5000], x[:5000] * 2 + 1)


# ---------------------------------------------------------------- streams and CUDA graphs
def _fresh(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return randn(*shape, device="cuda", dtype=dtype, seed=seed)


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("name", sorted(DEMO_MODELS))
def test_streams_and_graphs_match_eager_repeatedly(name: str, graphs: bool, config, ieee_convs) -> None:  # type: ignore[no-untyped-def]
    model, inputs = DEMO_MODELS[name](torch.device("cuda"))
    with torch.no_grad():
        compiled = streamfuse.compile(model, inputs, config.replace(cuda_graphs=graphs))
        assert compiled.stats["streams"] >= (2 if name == "multibranch_conv" else 1)
        for rep in range(25):  # races show up as errors that move between runs
            x = _fresh(tuple(inputs[0].shape), seed=100 + rep)
            out, ref = compiled(x), model(x)
            assert max_error(out, ref) <= 1e-4 * max(float(ref.abs().max()), 1.0), f"rep {rep}"
    assert compiled.graph_failure is None
    assert compiled.stats["graphs"] == (1 if graphs else 0)


def test_batch_buckets_on_gpu_with_lru_eviction(config) -> None:  # type: ignore[no-untyped-def]
    from test_runtime import mlp

    model = mlp(64, 256, 32).cuda()
    with torch.no_grad():
        compiled = streamfuse.compile(model, (_fresh((8, 64), 0),), config.replace(max_graphs=2))
        for batch in (8, 3, 5, 1, 8, 17, 64):
            x = _fresh((batch, 64), batch)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    assert compiled.stats["graphs"] == 2  # LRU kept the last two buckets
    assert list(compiled._runners) == [32, 64]


def test_batch_sized_tensors_and_integer_divisors_in_padded_graphs(config) -> None:  # type: ignore[no-untyped-def]
    """The CPU tests of session 41's padding fixes (test_runtime.py), through recorded CUDA graphs:
    a tensor made with the batch's size comes back at the caller's batch (compiled at 4, batch 3
    replays the compiled plan's graph padded; batch 5 a bucket's), a sum over one fixes the batch,
    and integer division by an input runs on padded rows."""
    def made(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.zeros_like(x), torch.ones(x.shape[0], 3, device=x.device) * 2, x + 1

    def summed(x: torch.Tensor) -> torch.Tensor:
        return x.sum(-1) / torch.ones_like(x).sum()

    def divided(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.floor_divide(a, b) + a % b

    with torch.no_grad():
        compiled = streamfuse.compile(made, (_fresh((4, 16), 0),), config)
        for batch in (4, 3, 5, 3):
            x = _fresh((batch, 16), batch)
            got, want = compiled(x), made(x)
            assert [t.shape for t in got] == [t.shape for t in want]
            torch.testing.assert_close(got, want)
        assert compiled.batch_reason is None
        compiled = streamfuse.compile(summed, (_fresh((4, 16), 0),), config)
        for batch in (3, 5):
            x = _fresh((batch, 16), batch)
            torch.testing.assert_close(compiled(x), summed(x), rtol=1e-5, atol=1e-6)
        assert compiled.batch_reason is not None and "reduces over the batch" in compiled.batch_reason
        gen = torch.Generator().manual_seed(0)
        a, b = torch.randint(-20, 20, (4, 16), generator=gen), torch.randint(1, 4, (4, 16), generator=gen)
        compiled = streamfuse.compile(divided, (a.cuda(), b.cuda()), config)
        for batch in (4, 3, 5):
            a, b = torch.randint(-20, 20, (batch, 16), generator=gen), torch.randint(1, 4, (batch, 16), generator=gen)
            assert torch.equal(compiled(a.cuda(), b.cuda()), divided(a, b).cuda())
        assert compiled.batch_reason is None


def test_recorded_graphs_read_rows_calls_gave(config) -> None:  # type: ignore[no-untyped-def]
    """Session 42 (tests/test_padding.py emulates it on the CPU): a recorded graph's static inputs
    start as the recording call's inputs, padding rows repeating its last row, not zeros, which
    `emb(ids - 1)` gathered at index -1; and a capture that fails at another bucket runs the call
    padded without graphs, not the compiled plan on the call's batch."""
    emb = torch.nn.Embedding(10, 8).cuda().eval()

    def one_based(ids: torch.Tensor) -> torch.Tensor:
        return emb(ids - 1) * 2

    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        compiled = streamfuse.compile(one_based, (torch.randint(1, 11, (4, 5), generator=gen).cuda(),), config)
        # one kernel: the graph cost model would launch it directly (run 160), so graphs are forced
        compiled.graph_skip, compiled.use_graphs = None, True
        for batch in (4, 3, 2, 5, 3):
            ids = torch.randint(1, 11, (batch, 5), generator=gen).cuda()
            torch.testing.assert_close(compiled(ids), one_based(ids))
        torch.cuda.synchronize()
        assert compiled.stats["graphs"] >= 2 and compiled.graph_failure is None
        assert all(int(r.static_inputs[0].min()) >= 1 for r in compiled._runners.values())


def test_outputs_are_fresh_unless_reuse_outputs(config) -> None:  # type: ignore[no-untyped-def]
    fn = lambda x: torch.softmax(x, -1).sum(0, keepdim=True) * x  # two reduction domains: 2 launches
    a, b = _fresh((4, 64), 1), _fresh((4, 64), 2)
    fresh = streamfuse.compile(fn, (a,), config)
    out_a, out_b = fresh(a), fresh(b)
    assert fresh.stats["graphs"] == 1
    torch.testing.assert_close(out_a, fn(a))  # not overwritten by the second call
    assert out_a.data_ptr() != out_b.data_ptr()
    reuse = streamfuse.compile(fn, (a,), config.replace(reuse_outputs=True))
    assert reuse(a).data_ptr() == reuse(b).data_ptr()


@pytest.mark.parametrize("batch", [4, 3])  # 3: padded to bucket 4, the caller holds a view (rows 0-2)
def test_output_sets_hand_out_buffers_only_once_the_caller_let_go(batch: int, config) -> None:  # type: ignore[no-untyped-def]
    """Config.output_sets: `y = f(x)` in a loop alternates between two recorded instances (no copy);
    results kept by the caller, as tensors or as views, are never overwritten; with every set
    held, calls copy out of one more instance."""
    from test_runtime import mlp

    fn = mlp(64, 128, 64).cuda()  # rows independent: batch 3 pads to bucket 4
    compiled = streamfuse.compile(fn, (_fresh((4, 64), 0),), config)
    inputs = [_fresh((batch, 64), 10 + i) for i in range(12)]
    y = compiled(inputs[0])
    first = y.data_ptr()
    y = compiled(inputs[1])
    second = y.data_ptr()
    y = compiled(inputs[2])  # the first set is free again: the loop pattern needs two sets
    assert len({first, second}) == 2 and y.data_ptr() == first
    assert compiled.stats["outputs_copied"] == 0
    with torch.no_grad():
        torch.testing.assert_close(y, fn(inputs[2]), rtol=1e-4, atol=1e-4)
    kept = [compiled(x) for x in inputs[3:9]]  # every result kept: sets all held, then copies
    view = compiled(inputs[9])[1:]
    for x in inputs[10:]:
        compiled(x)
    with torch.no_grad():
        for out, x in zip(kept, inputs[3:9], strict=True):
            torch.testing.assert_close(out, fn(x), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(view, fn(inputs[9])[1:], rtol=1e-4, atol=1e-4)
    assert compiled.stats["graphs"] == 1 and compiled.stats["graph_instances"] == 3
    assert compiled.stats["outputs_copied"] > 0
    copying = streamfuse.compile(fn, (_fresh((4, 64), 0),), config.replace(output_sets=0))
    outs = [copying(x) for x in inputs[:3]]
    assert len({o.data_ptr() for o in outs}) == 3 and copying.stats["graph_instances"] == 1
    assert copying.stats["outputs_copied"] == 3
    with pytest.raises(ValueError, match="output_sets"):
        config.replace(output_sets=-1)


@pytest.mark.parametrize("copy_node", [True, False])
def test_outputs_in_an_input_are_the_callers_tensor(copy_node: bool, config) -> None:  # type: ignore[no-untyped-def]
    """`return x, f(x), x.view(-1)` through a recorded graph: the first and last outputs are the
    caller's tensor and a view of it, as in eager (the graph copied its static buffer's view out,
    and every other output with it); at a padded batch, copies of the call's rows."""
    fn = lambda x: (x, torch.softmax(x, -1).sum(0, keepdim=True) * x, x.view(-1))
    compiled = streamfuse.compile(fn, (_fresh((4, 64), 0),), config.replace(input_copy_node=copy_node))
    for rep, batch in enumerate((4, 4, 3, 4)):
        x = _fresh((batch, 64), 30 + rep)
        got, want = compiled(x), fn(x)
        torch.testing.assert_close(list(got), list(want), rtol=1e-5, atol=1e-6)
        if batch == 4:
            assert got[0] is x and got[2].data_ptr() == x.data_ptr() and got[2].shape == (256,)
    assert compiled.stats["graphs"] >= 1 and compiled._runners[4].output_sets > 0


def test_input_copy_node_reads_each_calls_inputs(config) -> None:  # type: ignore[no-untyped-def]
    """Config.input_copy_node (default): the graph copies its inputs itself, pointed at each call's
    tensors. Two inputs, padded batches, a non-contiguous input, inputs changed and freed right after
    the call, and a raw replay of the recorded graphs afterwards: every result equals eager's."""
    w1, w2 = _fresh((64, 128), 2), _fresh((128, 64), 3)
    fn = lambda x, y: torch.relu(x @ w1) @ w2 + torch.softmax(y, -1)  # two launches at least: graphs pay
    compiled = streamfuse.compile(fn, (_fresh((4, 64), 0), _fresh((4, 64), 1)), config)
    before = streamfuse.compile(fn, (_fresh((4, 64), 0), _fresh((4, 64), 1)), config.replace(input_copy_node=False))
    assert compiled.use_graphs and before.use_graphs, (compiled.graph_skip, before.graph_skip)
    for rep, batch in enumerate((4, 3, 4, 1, 4, 2)):
        x = _fresh((batch, 64), 10 + rep)
        y = _fresh((64, batch), 20 + rep).T if rep % 2 else _fresh((batch, 64), 20 + rep)  # odd: non-contiguous
        out, ref = compiled(x, y), fn(x, y)
        torch.testing.assert_close(before(x, y), ref, rtol=1e-4, atol=1e-4)
        x.add_(100.0)  # after the call, on the same stream: the graph already read x
        del x, y
        torch.cuda.empty_cache()
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert compiled.stats["graphs"] == 3  # buckets 4 (batches 4 and 3), 1 and 2
    assert "inside the graph" in compiled.input_copy(), compiled.input_copy()
    assert all(r.copy_node_failure is None and r.first.copy_nodes for r in compiled._runners.values())
    assert "before the replay" in before.input_copy()
    assert all(not r.first.copy_nodes for r in before._runners.values())
    for graph in compiled.recorded_graphs().values():  # reads what the last call pointed it at, still held
        graph.replay()
    torch.cuda.synchronize()


def test_copy_nodes_pointed_again_only_when_an_input_moved(config, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A copy node is pointed at a call's input only where that input is not where the last call's
    was (runtime/graphs.py, _Instance.pointed): the same tensors refilled in place between calls
    cost no driver call and still give each call's values; a tensor elsewhere, or a padded batch
    (fewer bytes), points the node again."""
    from streamfuse.runtime import cudart

    w1, w2 = _fresh((64, 128), 2), _fresh((128, 64), 3)
    fn = lambda x, y: torch.relu(x @ w1) @ w2 + torch.softmax(y, -1)
    compiled = streamfuse.compile(fn, (_fresh((4, 64), 0), _fresh((4, 64), 1)), config)
    assert compiled.use_graphs, compiled.graph_skip
    pointed: list[int] = []
    real = cudart.set_memcpy_source
    monkeypatch.setattr(cudart, "set_memcpy_source", lambda *a: (pointed.append(a[3]), real(*a))[1])
    x, y = _fresh((4, 64), 10), _fresh((4, 64), 11)
    torch.testing.assert_close(compiled(x, y), fn(x, y), rtol=1e-4, atol=1e-4)
    first = len(pointed)
    for seed in range(3):
        x.copy_(_fresh((4, 64), 20 + seed))  # new values, same memory
        torch.testing.assert_close(compiled(x, y), fn(x, y), rtol=1e-4, atol=1e-4)
    assert len(pointed) == first, "an input at the same address pointed its copy node again"
    other = _fresh((4, 64), 30)  # x stays alive: other is elsewhere
    torch.testing.assert_close(compiled(other, y), fn(other, y), rtol=1e-4, atol=1e-4)
    assert pointed[first:] == [other.data_ptr()]
    small = _fresh((3, 64), 31)  # padded to the bucket of 4: fewer bytes from wherever it is
    torch.testing.assert_close(compiled(small, y[:3]), fn(small, y[:3]), rtol=1e-4, atol=1e-4)
    assert len(pointed) > first + 1
    torch.testing.assert_close(compiled(x, y), fn(x, y), rtol=1e-4, atol=1e-4)


def test_parallel_models_on_gpu(config) -> None:  # type: ignore[no-untyped-def]
    from test_runtime import mlp

    models = [mlp(128, 256, 64).cuda() for _ in range(4)]
    with torch.no_grad():
        par = streamfuse.parallel([(m, (_fresh((1, 128), i),)) for i, m in enumerate(models)], config)
        assert par.stats["streams"] == 4
        for rep in range(20):
            xs = [_fresh((1, 128), 1000 + 10 * rep + i) for i in range(4)]
            for m, x, o in zip(models, xs, par(*xs), strict=True):
                torch.testing.assert_close(o, m(x), rtol=1e-4, atol=1e-4)
    assert par.compiled.stats["graphs"] == 1


@torch.library.custom_op("streamfuse_test::synced_add_one", mutates_args=())
def _synced_add_one(x: torch.Tensor) -> torch.Tensor:
    torch.cuda.synchronize()  # not allowed while a stream is being captured
    return x + 1


@_synced_add_one.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_capture_failure_falls_back_to_streams_with_a_reason(config) -> None:  # type: ignore[no-untyped-def]
    fn = lambda x: torch.ops.streamfuse_test.synced_add_one(x * 2).sin()
    x = _fresh((16, 16), 3)
    compiled = streamfuse.compile(fn, (x,), config)
    torch.testing.assert_close(compiled(x), fn(x))
    assert compiled.graph_failure is not None
    assert "CUDA-graph capture failed, running on streams instead" in compiled.explain(source=False)
    y = _fresh((16, 16), 4)
    torch.testing.assert_close(compiled(y), fn(y))
    assert compiled.stats["graphs"] == 0
    # the failed capture left torch's CUDA random-number generator usable (run 24: it did not)
    assert torch.randn(8, device="cuda").std() > 0
    assert torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5).sum() > 0
    # ... and no allocator routing to its pool (session 57: torch 2.11 kept it registered, after which
    # empty_cache kept every cached block of the default pool and dropping a MemPool aborted)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    block = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del block
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= before
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        kept = torch.randn(1 << 20, device="cuda")
    del kept, pool  # the pool's cache emptied as it goes: aborted here before
    torch.cuda.synchronize()
