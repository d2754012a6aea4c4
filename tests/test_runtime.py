"""Runtime on CPU: stream plans of real graphs, batch-independence analysis, bucket and padding
rules, streamfuse.parallel, timeline arithmetic. (CUDA streams and graphs themselves: test_gpu.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_to_reference, randn

import streamfuse
from streamfuse import Config
from streamfuse.capture.export import capture
from streamfuse.ir.batch import Rows, batch_rows
from streamfuse.ir.from_fx import graph_from_fx
from streamfuse.profile.timeline import Interval, call_gap_ratio, gap_ratio, intervals_from_trace, span, union_length


class FourBranch(torch.nn.Module):
    """x -> four independent (mm, gelu, mm) branches -> their sum."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.a = torch.nn.ModuleList(torch.nn.Linear(d, d, bias=False) for _ in range(4))
        self.b = torch.nn.ModuleList(torch.nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((b(F.gelu(a(x))) for a, b in zip(self.a, self.b, strict=True)), torch.zeros_like(x))


def mlp(d_in: int = 16, d: int = 32, d_out: int = 8) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(d_in, d), torch.nn.ReLU(), torch.nn.Linear(d, d), torch.nn.GELU(),
                               torch.nn.Linear(d, d_out)).eval()


def test_four_branch_block_is_planned_on_four_streams_with_minimal_events(config) -> None:  # type: ignore[no-untyped-def]
    model = FourBranch().eval()
    x = randn(2, 16)
    with torch.no_grad():
        # without horizontal packing, which would pack the four GELUs into one launch and join the branches
        compiled = streamfuse.compile(model, (x,), config.replace(horizontal_fusion=False))  # priorities off: the default
        assert_close_to_reference(compiled(x), model, [x])
    sched = compiled.base.schedule
    assert compiled.stats["streams"] == 4
    # the branches on streams 1-3 each wait once for the caller's stream (fork); the final sum waits for
    # the three branch tails; the caller's own stream needs no fork or join
    assert len(sched.fork) == 3 and sched.join == []
    assert sum(len(w) for w in sched.waits.values()) == 3
    assert compiled.stats["events"] == 6
    text = compiled.explain(source=False)
    assert "schedule: 4 stream(s), 6 cross-stream wait(s)" in text and "stream 3:" in text


def test_high_priority_stream_adds_only_its_own_fork_and_join(config) -> None:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        compiled = streamfuse.compile(FourBranch().eval(), (randn(2, 16),),
                                      config.replace(stream_priorities=True, horizontal_fusion=False))
    sched = compiled.base.schedule
    assert sched.own_first_stream and 0 in sched.fork and 0 in sched.join
    assert compiled.stats["events"] == 8


def test_max_streams_caps_and_chain_uses_one_stream(config) -> None:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        two = streamfuse.compile(FourBranch().eval(), (randn(2, 16),),
                                 config.replace(max_streams=2, horizontal_fusion=False))
        chain = streamfuse.compile(mlp(), (randn(2, 16),), config)
    assert two.stats["streams"] == 2
    assert chain.stats["streams"] == 1 and chain.stats["events"] == 0


@pytest.mark.parametrize(
    ("fn", "shape", "independent"),
    [
        (lambda x: F.layer_norm(x, (8,)).relu(), (4, 8), True),
        (lambda x: torch.softmax(x.view(4 * 3, 8) @ torch.ones(8, 5), -1).view(4, 3, 5), (4, 3, 8), True),
        (lambda x: x.transpose(1, 2).contiguous() * 2, (4, 3, 8), True),
        (lambda x: x.sum(0), (4, 8), False),
        (lambda x: x.view(-1), (4, 8), True),  # batch element i owns elements [8i, 8i+8)
        (lambda x: x - x.mean(0, keepdim=True), (4, 8), False),
        (lambda x: x.t().contiguous(), (4, 8), False),
        (lambda x: torch.cumsum(x, 0), (4, 8), False),
        (lambda x: torch.cumsum(x, 1), (4, 8), True),
        (lambda x: torch.cat([x, x], 0), (4, 8), False),
        (lambda x: torch.cat([x, x], 1), (4, 8), True),
        # rules from the ops' semantics (their dim arguments, ATen's pointwise tag), not model names
        (lambda x: (x > 0).any(1, keepdim=True) * x, (4, 8), True),
        (lambda x: (x > 0).any(0, keepdim=True) * x, (4, 8), False),
        (lambda x: torch.bitwise_and(x > 0, x < 1) * x, (4, 8), True),
        (lambda x: torch.index_select(x, 1, torch.tensor([0, 2])), (4, 8), True),
        (lambda x: torch.index_select(x, 0, torch.tensor([0, 2, 1, 3])), (4, 8), False),
        (lambda x: torch.gather(x, 1, torch.argsort(x, 1)), (4, 8), True),
        (lambda x: torch.roll(x, 1, 1), (4, 8), True),
        (lambda x: torch.roll(x, 1, 0), (4, 8), False),
        (lambda x: torch.flip(x, [0]), (4, 8), False),
        # advanced indexing: by the batch's own positions (HF attention masks), or on other dims only
        (lambda x: x[torch.arange(4)[:, None], torch.tensor([1, 0, 3])[None, :]], (4, 8), True),
        (lambda x: x[torch.tensor([3, 2, 1, 0])[:, None], torch.tensor([1, 0, 3])[None, :]], (4, 8), False),
        (lambda x: x[:, torch.tensor([1, 0, 3])], (4, 8), True),
    ],
)
def test_batch_independence_analysis(fn, shape, independent) -> None:  # type: ignore[no-untyped-def]
    cap = capture(fn, (randn(*shape),))
    result = batch_rows(graph_from_fx(cap.gm, cap.bound))
    assert (not isinstance(result, str)) == independent, result


def test_batch_analysis_of_conv_and_transformer_blocks() -> None:
    from streamfuse.demo_models import DEMO_MODELS

    for factory in DEMO_MODELS.values():
        model, inputs = factory(torch.device("cpu"))
        with torch.no_grad():
            cap = capture(model, inputs)
        graph = graph_from_fx(cap.gm, cap.bound)
        result = batch_rows(graph)
        assert not isinstance(result, str), result
        assert all(isinstance(result[o], Rows) for o in graph.output_nodes)


def test_padding_to_a_bucket_gives_eager_results(config) -> None:  # type: ignore[no-untyped-def]
    model = mlp()
    with torch.no_grad():
        compiled = streamfuse.compile(model, (randn(2, 16),), config)
        for batch in (1, 2, 3, 5, 8, 13):
            x = randn(batch, 16, seed=batch)
            out = compiled(x)
            assert out.shape == (batch, 8)
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    # batches 3, 5, 13 ran padded to 4, 8, 16; 1 and 8 are buckets; 2 is the compiled batch
    assert set(compiled._variants) == {1, 2, 4, 8, 16}


@pytest.mark.parametrize("fn", [
    lambda x: x * x.shape[0],  # the batch size as a number
    lambda x: x.sum(1) / x.numel(),  # the batch inside a count
    lambda x: x[:, None, :].expand(-1, x.shape[0], -1).sum(1),  # the batch as a size of another dim
    lambda x: F.linear(x, torch.ones(8, 8) / x.shape[0]),  # a constant made from the batch
], ids=["times-batch", "numel", "expand-by-batch", "constant-by-batch"])
@pytest.mark.parametrize("compiled_batch", [4, 1])
def test_a_batch_size_the_model_uses_as_a_number_is_never_padded(fn, compiled_batch, config) -> None:  # type: ignore[no-untyped-def]
    """Rows that do not mix (ir/batch.py) are not enough: a batch size the trace turned into a
    number would be the bucket's in a padded call. The model traced at a second batch size must
    differ only where the batch is a size; otherwise each batch gets a plan of its own."""
    with torch.no_grad():
        compiled = streamfuse.compile(fn, (randn(compiled_batch, 8),), config)
        for batch in (3, 5, 1, 2):
            x = randn(batch, 8, seed=batch)
            torch.testing.assert_close(compiled(x), fn(x), rtol=1e-5, atol=1e-5)
    assert compiled.batch_reason is not None and "not the same function of the batch" in compiled.batch_reason


def test_a_model_that_only_reshapes_by_the_batch_keeps_its_padding(config) -> None:  # type: ignore[no-untyped-def]
    """Sizes that follow the batch (a view to (B, 2, -1), zeros(B, n), an expand to (B, n)) are the
    same function at every batch: padding stays, at a compiled batch of 4 and of 1."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        return x.view(b, 2, -1).sum(1) + torch.zeros(b, 4) + torch.ones(1, 4).expand(b, 4) * 2

    for compiled_batch in (4, 1):
        with torch.no_grad():
            compiled = streamfuse.compile(fn, (randn(compiled_batch, 8),), config)
            for batch in (3, 1, 5):
                x = randn(batch, 8, seed=batch)
                torch.testing.assert_close(compiled(x), fn(x), rtol=1e-5, atol=1e-5)
        assert compiled.batch_reason is None and compiled.stats["specializations"] == 0


def test_group_norm_and_a_cat_after_an_empty_tensor_keep_their_padding(config) -> None:  # type: ignore[no-untyped-def]
    """Two false positives of the batch checks (session-27 timm/HF sweep): native_group_norm takes
    the batch size as an int argument (GroupNorm normalizes each sample alone: poolformer), and
    `cat([empty [0], x], dim=-2)` (a KV cache's first append: OPT, Bloom, Falcon, GPT-NeoX) is a cat
    along dim 2, not the batch. Both keep padding, and match eager."""
    torch.manual_seed(0)
    norm = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.GroupNorm(4, 8)).eval()
    cache = torch.zeros(0)

    def append(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([cache, x.view(x.shape[0], 2, 4, 4)], dim=-2) * 2

    for fn, shape in ((norm, (3, 8, 8)), (append, (32,))):
        with torch.no_grad():
            compiled = streamfuse.compile(fn, (randn(2, *shape),), config)
            for batch in (3, 1, 5):
                x = randn(batch, *shape, seed=batch)
                torch.testing.assert_close(compiled(x), fn(x), rtol=1e-5, atol=1e-5)
        assert compiled.batch_reason is None and compiled.stats["specializations"] == 0


def test_an_arange_of_the_batch_and_a_pad_beside_the_batch_keep_their_padding(config) -> None:  # type: ignore[no-untyped-def]
    """Two more false positives (session 40's HF sweep; each gave every batch size a plan of its own):
    transformers' mask builders index the padding mask by torch.arange(batch), which the capture folds
    into a constant (ir/batch.CONST_IOTA), CLIP pools `x[arange(batch), ids.argmax(-1)]`, and MobileBERT
    pads `x[:, 1:]` with a zero pair for dim 0. All keep padding now and match eager. A fixed table that equals arange(batch) only at the compiled
    batch is refused by the batch check, so a smaller batch raises IndexError as eager does."""
    def mask_rows(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(x.shape[0])
        return x * keep[rows[:, None], torch.arange(x.shape[1])[None, :]]

    def pad_rows(x: torch.Tensor) -> torch.Tensor:
        return F.pad(x[:, 1:], [0, 0, 0, 1, 0, 0]) * 2

    def pool_rows(x: torch.Tensor, score: torch.Tensor) -> torch.Tensor:  # CLIP's text pooling
        return x[torch.arange(x.shape[0]), score.argmax(-1)] * 2

    for fn, shapes in ((mask_rows, ((4, 6), (4, 6))), (pad_rows, ((4, 5, 3),)), (pool_rows, ((4, 6, 3), (4, 6)))):
        with torch.no_grad():
            compiled = streamfuse.compile(fn, tuple(randn(*s, seed=i) for i, s in enumerate(shapes)), config)
            for batch in (3, 1, 5):
                xs = tuple(randn(batch, *s[1:], seed=batch + i) for i, s in enumerate(shapes))
                torch.testing.assert_close(compiled(*xs), fn(*xs), rtol=1e-5, atol=1e-5)
        assert compiled.batch_reason is None and compiled.stats["specializations"] == 0, fn.__name__

    table = torch.arange(4)

    def fixed(x: torch.Tensor) -> torch.Tensor:
        return x[table[:, None], torch.arange(x.shape[1])[None, :]] * 2

    positions = torch.arange(6)

    def lookup(x: torch.Tensor) -> torch.Tensor:  # a table equal to arange(batch), not an index of the batch
        return x * positions

    with torch.no_grad():
        compiled = streamfuse.compile(lookup, (randn(6, 6),), config)
        for batch in (3, 1, 5):
            x = randn(batch, 6, seed=batch)
            torch.testing.assert_close(compiled(x), lookup(x), rtol=1e-5, atol=1e-5)
        assert compiled.batch_reason is None and compiled.stats["specializations"] == 0
        compiled = streamfuse.compile(fixed, (randn(4, 6),), config)
        with pytest.raises(IndexError):
            fixed(randn(3, 6))
        with pytest.raises(IndexError):
            compiled(randn(3, 6))
        x = randn(5, 6, seed=5)
        torch.testing.assert_close(compiled(x), fixed(x))
    assert compiled.batch_reason is not None and "does not follow the batch" in compiled.batch_reason


def test_bad_batches_and_shapes_give_clear_errors(config) -> None:  # type: ignore[no-untyped-def]
    config = config.replace(max_specializations=0)  # strict: no plan of its own for another shape
    with torch.no_grad():
        compiled = streamfuse.compile(mlp(), (randn(2, 16),), config)
        with pytest.raises(ValueError, match="batch 65 exceeds the largest batch bucket 64"):
            compiled(randn(65, 16))
        with pytest.raises(ValueError, match=r"expected shape \(3, 16\), got \(3, 17\).*only the batch dimension"):
            compiled(randn(3, 17))
        fixed = streamfuse.compile(lambda x: x - x.mean(0, keepdim=True), (randn(4, 8),), config)
        with pytest.raises(ValueError, match="batch size is fixed at 4: .*reduces over the batch"):
            fixed(randn(5, 8))
        torch.testing.assert_close(fixed(randn(4, 8, seed=3)), (lambda x: x - x.mean(0, keepdim=True))(randn(4, 8, seed=3)))


def test_batches_past_the_buckets_and_fixed_batches_get_their_own_plan(config) -> None:  # type: ignore[no-untyped-def]
    def center(x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0, keepdim=True)  # reduces over the batch: no padding

    with torch.no_grad():
        model = mlp()
        compiled = streamfuse.compile(model, (randn(2, 16),), config.replace(batch_buckets=(1, 2, 4)))
        for batch in (3, 5, 9):  # 3 pads to bucket 4; 5 and 9 exceed the largest bucket
            x = randn(batch, 16, seed=batch)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
        assert compiled.stats["specializations"] == 2
        fixed = streamfuse.compile(center, (randn(4, 8),), config)
        x = randn(5, 8, seed=5)
        torch.testing.assert_close(fixed(x), center(x), rtol=1e-5, atol=1e-6)
        assert fixed.stats["specializations"] == 1


def test_parallel_models_match_eager_and_use_one_stream_each(config) -> None:  # type: ignore[no-untyped-def]
    models = [mlp() for _ in range(4)]
    xs = [randn(1, 16, seed=i) for i in range(4)]
    with torch.no_grad():
        par = streamfuse.parallel(list(zip(models, xs, strict=True)), config)
        outs = par(*xs)
        for m, x, o in zip(models, xs, outs, strict=True):
            torch.testing.assert_close(o, m(x))
    assert par.stats["streams"] == 4
    with pytest.raises(ValueError, match="expected inputs for 4 models, got 2"):
        par(xs[0], xs[1])
    with pytest.raises(ValueError, match=r"models\[0\] must be a \(model, example_inputs\) pair"):
        streamfuse.parallel([models[0]], config)  # type: ignore[list-item]


def test_config_validates_runtime_fields() -> None:
    with pytest.raises(ValueError, match="Config.batch_buckets must be"):
        Config(batch_buckets=(4, 2))
    with pytest.raises(ValueError, match="Config.max_streams must be a positive int"):
        Config(max_streams=0)
    with pytest.raises(ValueError, match="Config.fuse must be True or False, got 'no'"):
        Config(fuse="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Config.fold_batchnorm must be True or False"):
        Config().replace(fold_batchnorm=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Config.matmul_template_margin must be in \[1, 4\], got 0.9"):
        Config(matmul_template_margin=0.9)
    with pytest.raises(ValueError, match="Config.matmul_template_margin_from_us must be >= 0"):
        Config(matmul_template_margin_from_us=-1.0)


def _iv(start: float, end: float, stream: int = 0) -> Interval:
    return Interval("k", stream, start, end)


def test_timeline_arithmetic_on_synthetic_timelines() -> None:
    # two streams overlapping, one gap of 10, one kernel nested inside another
    ivs = [_iv(0, 10), _iv(5, 20, 1), _iv(30, 40), _iv(32, 35, 1)]
    assert union_length(ivs) == 30
    assert span(ivs) == 40
    assert gap_ratio(ivs) == pytest.approx(10 / 30)
    assert gap_ratio([_iv(0, 5), _iv(5, 9)]) == 0
    assert gap_ratio([]) == 0


def test_call_gap_ratio_leaves_out_the_time_between_calls() -> None:
    # three calls of two overlapping kernels each; inside a call the gaps are 1, 0 and 4 per 10 busy
    calls = [[_iv(0, 6), _iv(7, 11, 1)], [_iv(100, 110), _iv(102, 104, 1)], [_iv(200, 205), _iv(209, 214, 1)]]
    ivs = [iv for call in reversed(calls) for iv in call]  # the order they arrive in does not matter
    assert call_gap_ratio(ivs, 3) == pytest.approx(0.1)  # the median of 0.1, 0 and 0.4
    assert gap_ratio(ivs) > 5  # back to back, the idle time between calls dominates
    with pytest.raises(ValueError, match="do not split into 4 calls"):
        call_gap_ratio(ivs, 4)


def test_intervals_from_a_chrome_trace() -> None:
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "a", "ts": 100.0, "dur": 5.0, "args": {"stream": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "copy", "ts": 106.0, "dur": 2.0, "args": {"stream": 7}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 90.0, "dur": 50.0},
        {"ph": "X", "cat": "kernel", "name": "b", "ts": 101.0, "dur": 3.0, "args": {"stream": 13}},
    ]}
    ivs = intervals_from_trace(trace)
    assert [(i.name, i.stream) for i in ivs] == [("a", 7), ("copy", 7), ("b", 13)]
    assert union_length(ivs) == 7 and gap_ratio(ivs) == pytest.approx(1 / 7)


def test_cuda_graphs_are_skipped_where_they_cannot_pay_off(config) -> None:  # type: ignore[no-untyped-def]
    # one small kernel: the direct call's own host cost (~13 µs) and its launch outweigh the copies
    one = streamfuse.compile(lambda x: torch.softmax(x, -1), (randn(8, 16),), config)
    assert one.stats["kernels"] == 1 and one.graph_skip is None
    large = streamfuse.compile(lambda x: x.relu() * 2 + 1, (randn(4096, 1024),), config)  # 32 MiB copied in and out
    views = streamfuse.compile(lambda x: (x.t(), x[0]), (randn(8, 16),), config.replace(reuse_outputs=True))
    assert views.stats["kernels"] == 0 and "nothing to replay" in (views.graph_skip or "")
    assert "graph saves on one kernel launch" in (large.graph_skip or "")
    packed = streamfuse.compile(lambda *xs: [x.relu() * 2 for x in xs], tuple(randn(8, 8, seed=i) for i in range(32)),
                                config)
    assert packed.stats["kernels"] == 1 and packed.graph_skip is None  # 32 allocations saved per call
    big = streamfuse.compile(lambda x: torch.softmax(x, -1).sum(0) + 1, (randn(4096, 4096),), config)
    assert "would cost more than the graph saves" in (big.graph_skip or "")
    assert "CUDA graphs: not used" in big.explain(source=False)
    with torch.no_grad():
        small = streamfuse.compile(mlp(), (randn(2, 16),), config)
    assert small.graph_skip is None
    x = randn(4096, 3072)  # 48 MiB in: the copy (~24 µs) alone pays; with the output's copy call it does not
    copied = streamfuse.compile(lambda x: torch.softmax(x, -1).sum(0) + 1, (x,), config)
    reuse = streamfuse.compile(lambda x: torch.softmax(x, -1).sum(0) + 1, (x,), config.replace(reuse_outputs=True))
    assert "would cost more than the graph saves" in (copied.graph_skip or "") and reuse.graph_skip is None


def test_independent_chains_are_not_packed_into_lockstep(config) -> None:  # type: ignore[no-untyped-def]
    from streamfuse.fusion.groups import GroupKind

    with torch.no_grad():
        branches = streamfuse.compile(FourBranch().eval(), (randn(2, 16),), config)
        par = streamfuse.parallel([(mlp(), (randn(1, 16, seed=i),)) for i in range(4)], config)
    for compiled in (branches, par.compiled):
        assert all(g.kind is not GroupKind.HORIZONTAL for g in compiled.plan.groups)
        assert compiled.stats["streams"] == 4



def test_output_guard_sees_tensors_and_views_the_caller_keeps() -> None:
    """runtime/graphs.OutputGuard, which decides when a graph instance's output buffers may be
    handed out again (Config.output_sets)."""
    from streamfuse.runtime.graphs import OutputGuard

    outputs = [torch.zeros(4), None, torch.ones(2, 3)]
    guard = OutputGuard(outputs)
    assert not guard.held()
    kept = outputs[2]
    assert guard.held()
    del kept
    assert not guard.held()
    view = outputs[0][1:]  # a new tensor on the same memory
    assert guard.held()
    del view
    assert not guard.held()
    results = list(outputs)  # what a call returns, kept whole
    assert guard.held()
    results.clear()
    assert not guard.held()


def test_input_copy_nodes_only_where_they_beat_one_batched_copy(config) -> None:  # type: ignore[no-untyped-def]
    """Config.input_copy_node: one copy-node update per input (~1.8 µs each) against one batched copy
    (~7 µs): nodes for up to three inputs, the batched copy beyond; the graph-skip cost model agrees."""
    from streamfuse.runtime.graph_cost import COPY_CALL_US, COPY_NODE_US, copy_nodes_pay, input_copy_us

    assert [copy_nodes_pay(n) for n in range(6)] == [False, True, True, True, False, False]
    assert input_copy_us(2, True) == pytest.approx(2 * COPY_NODE_US)
    assert input_copy_us(2, False) == input_copy_us(8, True) == COPY_CALL_US
    assert input_copy_us(0, True) == 0.0
    many = streamfuse.compile(lambda *xs: [x.relu() * 2 for x in xs], tuple(randn(8, 8, seed=i) for i in range(8)),
                              config)
    assert "one batched copy of 8 inputs" in many.input_copy()
    off = streamfuse.compile(lambda x: x.relu(), (randn(8, 8),), config.replace(input_copy_node=False))
    assert "Config.input_copy_node=False" in off.input_copy()


def test_launch_key_specializes_as_triton_does() -> None:
    """runtime/steps.launch_key, the direct launch path's cache key: a tensor by 16-byte alignment,
    an int by (== 1, divisible by 16, within int32); equal keys for launches Triton compiles alike."""
    from streamfuse.runtime.steps import launch_key

    base = torch.zeros(64)
    assert launch_key([base, 1, 32, 7, 2**31]) == (True, (True, False, True), (False, True, True),
                                                   (False, False, True), (False, True, False))
    assert launch_key([base[1:], 48]) == (False, (False, True, True))  # 4 bytes past an aligned start
    assert launch_key([base, 4096]) == launch_key([torch.ones(8), 16])


def test_release_follows_the_issue_order(config) -> None:  # type: ignore[no-untyped-def]
    """A slot is freed after its last reader in the order the steps are issued: the stream runner
    issues a schedule's order, not the plan's (a buffer freed after its last reader in plan order
    was read later as None: the GPT-2 TypeError on the GPU)."""
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.relu(x)
        return torch.exp(a) * 2, torch.sin(a) * 3

    compiled = streamfuse.compile(f, (randn(4, 8),), config.replace(fuse=False))
    exe = compiled.base
    steps = range(len(exe.steps))
    readers = {i for i in steps for n in exe.steps[i].group.nodes for a in n.input_nodes() if a.op == "aten.relu.default"}
    assert len(readers) == 2
    relu_slot = next(exe.slot[n] for st in exe.steps for n in st.group.nodes if n.op == "aten.relu.default")
    plan_order = list(steps)
    first, second = sorted(readers)
    swapped = [i for i in plan_order if i not in readers] + [second, first]  # the later reader issued first
    swapped.sort(key=lambda i: plan_order.index(i) if i not in readers else len(plan_order) + (i == first))
    released_after = {i for i, slots in enumerate(exe.release_lists(swapped)) if relu_slot in slots}
    assert released_after == {first}
    assert {i for i, slots in enumerate(exe.release_lists()) if relu_slot in slots} == {second}


def test_a_donated_input_is_released_after_its_last_reader(config) -> None:  # type: ignore[no-untyped-def]
    """Executable.run's `donate`: the input's slot joins the release list of its last reader, the
    caller's list loses its reference, and the results stay eager's; an input that is also an
    output is never released (a training graph's copied inputs land in its pool: runtime/replay.py)."""
    def f(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.relu(x) * 2
        return torch.sin(a) + y.sum(), y

    x, y = randn(4, 8), randn(3, 5)
    compiled = streamfuse.compile(f, (x, y), config.replace(fuse=False))
    exe = compiled.base
    x_slot, y_slot = exe.input_slots
    readers = {i for i, st in enumerate(exe.steps) for n in st.group.nodes for a in n.input_nodes() if exe.slot[a] == x_slot}
    assert not any(x_slot in slots for slots in exe.release_lists())
    assert {i for i, slots in enumerate(exe.release_lists(donate=[0, 1])) if x_slot in slots} == {max(readers)}
    assert not any(y_slot in slots for slots in exe.release_lists(donate=[0, 1]))  # y is an output too
    inputs = [x.clone(), y.clone()]
    out = exe.run(inputs, donate=frozenset({0, 1}))
    assert inputs == [None, None]
    ref = f(x, y)
    torch.testing.assert_close(out[0], ref[0])
    torch.testing.assert_close(out[1], y)


def test_the_memory_probe_counts_donated_inputs_until_released(config, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Executable.run's `probe` (Config.training_pool_reserve sizes a capture's first block with it):
    after each step, the allocator's bytes plus the donated inputs not yet released, a storage
    counted once while any of its slots is live. The allocator's count is stubbed (no GPU here), so
    what is left is the donated bytes; the run's results stay eager's."""
    def f(x: torch.Tensor, v: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = torch.relu(x) * 2
        b = torch.sin(a) + v.sum()
        return torch.cos(b) * y.sum()

    x, y = randn(4, 8), randn(3, 5)
    compiled = streamfuse.compile(f, (x, x[1:], y), config.replace(fuse=False))
    exe = compiled.base
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1000)
    x_slot, v_slot, _ = exe.input_slots
    last = {s: max(i for i, st in enumerate(exe.steps) for n in st.group.nodes for a in n.input_nodes()
                   if exe.slot[a] == s) for s in (x_slot, v_slot)}
    xs = x.clone()
    inputs, probe = [xs, xs[1:], y.clone()], []
    out = exe.run(inputs, donate=frozenset({0, 1}), probe=probe)
    assert inputs == [None, None, inputs[2]] and len(probe) == len(exe.steps)
    # x and its view v share one storage: counted once, until the later of their last readers
    x_bytes = xs.untyped_storage().nbytes()
    assert probe == [1000 + (x_bytes if i <= max(last.values()) else 0) for i in range(len(exe.steps))]
    torch.testing.assert_close(out[0], f(x, x[1:], y))


def test_host_scalars_beside_device_tensors() -> None:
    """A 0-dim CPU tensor beside device tensors (SDPA's host Philox seed, a generation step's host
    integer) does not make the plan a CPU plan, and a call moves it to the plan's device by value
    (the meta device stands in for a GPU here), reusing the copy while the value repeats; other
    inputs are left as they are."""
    from streamfuse.ir.graph import Graph
    from streamfuse.runtime.inputs import graph_device, scalars_to_device

    seed, x = torch.tensor(7), torch.empty(3, device="meta")
    assert graph_device(Graph([], [], []), [seed, x]) == torch.device("meta")
    assert graph_device(Graph([], [], []), [seed]) == torch.device("cpu")
    rows, cache = torch.ones(2), {}
    moved = scalars_to_device([seed, rows, x], [0, 1], torch.device("meta"), cache)
    assert moved[0].device.type == "meta" and moved[0].dim() == 0 and moved[0].dtype == seed.dtype
    assert moved[1] is rows and moved[2] is x
    assert scalars_to_device([torch.tensor(7), rows, x], [0], torch.device("meta"), cache)[0] is moved[0]
    assert scalars_to_device([torch.tensor(8), rows, x], [0], torch.device("meta"), cache)[0] is not moved[0]
    assert scalars_to_device([x], [0], torch.device("meta"), cache) == [x]


def test_a_zero_dim_first_input_replays_at_the_compiled_batch(config, device, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Run 85 (H200): a graph whose first input is 0-d (no batch dimension) raised "batch -1 must be
    at least 1" on the CUDA-graph path, through both entry points (two fuzz families). The replay is
    stood in for by a runner that runs the plan, so the path runs on any device."""
    def fn(s: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = torch.where(s >= x, x, s)
        return v.cumsum(0), v

    s, x = torch.randn((), device=device), torch.randn(2, 2, 1, 8, device=device)
    compiled = streamfuse.compile(fn, (s, x), config)
    assert compiled.batch_reason is not None  # no batch dimension to vary
    monkeypatch.setattr(compiled, "use_graphs", True)
    monkeypatch.setattr("streamfuse.runtime.compiled._capturing", lambda: False)
    recorded: list[int] = []

    def record(padded: int, inputs):  # type: ignore[no-untyped-def]
        recorded.append(padded)
        runner = compiled._runners[padded] = lambda args, batch: compiled.base.run(list(args))
        return runner

    monkeypatch.setattr(compiled, "_record", record)
    for _ in range(2):
        s2, x2 = torch.randn((), device=device), torch.randn(2, 2, 1, 8, device=device)
        for got, want in zip(compiled(s2, x2), fn(s2, x2), strict=True):
            torch.testing.assert_close(got, want)
    assert recorded == [compiled.base_batch]  # recorded once, replayed after
