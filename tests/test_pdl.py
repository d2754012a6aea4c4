"""Programmatic dependent launch (Config.pdl): generated kernels signal their dependents first and
wait for the previous kernel before reading anything it may write; a matrix-vector product reads its
constant weight tile before that wait. On CPU the sources are checked as text and the prefetching
kernel runs in Triton's interpreter (the grid-dependency instructions replaced by no-ops, which is
what they are without the launch attribute); on the device machine the same kernels run under
CUDA-graph replay on several streams.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import triton
import triton.language as tl  # noqa: F401 - a @triton.jit function must see `tl` in its module
from helpers import randn

import streamfuse
from streamfuse import Config
from streamfuse.codegen.cache import load_kernel
from streamfuse.codegen.kernel import KernelSource, generate
from streamfuse.codegen.matmul import heuristic_tile, with_tile
from streamfuse.fusion.groups import GroupKind
from streamfuse.fusion.legality import matmul_dims, matmul_operands
from streamfuse.runtime.executable import mark_pdl_launches
from streamfuse.runtime.steps import KernelStep


@triton.jit
def _no_op() -> None:
    pass


def _planned(fn, inputs, config: Config) -> streamfuse.CompiledGraph:  # type: ignore[no-untyped-def]
    return streamfuse.compile(fn, tuple(inputs), config.replace(executor="reference", matmul_strategy="triton"))


def _body(source: KernelSource) -> list[str]:
    lines = source.source.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("def ")) + 1
    return [line.strip() for line in lines[start:] if line.strip()]


def _reads_before_wait(source: KernelSource) -> list[str]:
    body = _body(source)
    return [line for line in body[: body.index("gdc_wait()")] if "tl.load(" in line]


def test_pdl_kernels_signal_first_and_read_only_constants_before_the_wait(config) -> None:  # type: ignore[no-untyped-def]
    lin1, lin2 = torch.nn.Linear(600, 96), torch.nn.Linear(96, 40)
    ln = torch.nn.LayerNorm(40)
    fn = lambda x, y: (ln(lin2(torch.relu(lin1(x)))) * 2, torch.sigmoid(y) + 1, x @ y.t())
    x, y = randn(1, 600), randn(3, 600, seed=1)
    compiled = _planned(fn, [x, y], config)
    constants = compiled.base.graph.constant_nodes()
    kinds = set()
    for group in compiled.plan.groups:
        if not group.kind.generated:
            continue
        plain = generate(group, config, "cuda", 132)
        assert not plain.pdl and "gdc_" not in plain.source
        source = generate(group, config, "cuda", 132, pdl=True, constants=constants)
        assert source.pdl and source.fn_name != plain.fn_name
        body = _body(source)
        assert body[0] == "gdc_launch_dependents()" and body.count("gdc_wait()") == 1
        before = _reads_before_wait(source)
        mm = group.contraction
        prefetch = mm is not None and matmul_dims(mm)[1] == 1 and matmul_operands(mm)[1] in constants
        if prefetch:  # the weight tile and the bias (constants), nothing else
            assert any(re.match(r"b = tl\.load\(b_ptrs", line) for line in before), before
            assert any("in0_ptr" in line for line in before) and source.inputs[0] in constants  # the bias
            for line in before:
                slot = re.search(r"tl\.load\(in(\d+)_ptr", line)
                assert "b_ptrs" in line or (slot and source.inputs[int(slot[1])] in constants), line
        else:
            assert before == [], f"{group.name} reads before its wait: {before}"
        kinds.add((group.kind, prefetch))
    # a prefetching matrix-vector product, a non-constant product, and a reduction were all seen
    assert (GroupKind.MATMUL, True) in kinds and (GroupKind.MATMUL, False) in kinds
    assert any(k is GroupKind.REDUCTION for k, _ in kinds)


@pytest.mark.parametrize("k", [512, 600])
@pytest.mark.parametrize("split", [1, 2, 8])
def test_prefetching_matrix_vector_kernel_matches_reference(k: int, split: int, config, device) -> None:  # type: ignore[no-untyped-def]
    """The peeled first K step (weight read before the wait) at several splits, with even and uneven K."""
    lin = torch.nn.Linear(k, 96).to(device)
    fn = lambda x: torch.relu(lin(x))
    x = randn(1, k, device=device, seed=5)
    compiled = _planned(fn, [x], config)
    (group,) = [g for g in compiled.plan.groups if g.kind is GroupKind.MATMUL]
    target = "cuda" if device.type == "cuda" else "interpret"
    base = generate(group, config, target, 132, pdl=True, constants=compiled.base.graph.constant_nodes())
    assert _reads_before_wait(base)  # this is the prefetching form
    tile = dataclasses.replace(heuristic_tile(group, config, 132), split_k=split, num_stages=1)
    source = with_tile(base, group, tile)
    kernel = load_kernel(source.fn_name, source.source, config.cache_dir)
    if device.type != "cuda":  # no grid-dependency control in the interpreter: they are no-ops here
        kernel.fn.__globals__.update(gdc_wait=_no_op, gdc_launch_dependents=_no_op)
    values = {(96,): lin.bias.detach(), (1, k): x, (k, 96): lin.weight.detach().t()}
    args: list = []
    for node, dims in zip(source.inputs, source.input_stride_dims, strict=True):
        t = values[node.shape]
        args += [t, *[t.stride(d) for d in dims]]
    scratch = source.scratch_tensors(device)
    expected = torch.relu(torch.addmm(lin.bias.double(), x.double(), lin.weight.double().t())).float()
    for _ in range(2):  # the second launch reuses the split-K counters
        out = torch.full((1, 96), float("nan"), device=device)
        kernel[source.grid](*args, out, *scratch, num_warps=source.num_warps, **source.constexprs)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_pdl_launch_only_after_one_of_our_kernels_on_the_same_stream(config, device) -> None:  # type: ignore[no-untyped-def]
    from test_runtime import mlp

    models = [mlp(32, 64, 16).to(device) for _ in range(3)]
    par = streamfuse.parallel([(m, (randn(1, 32, seed=i, device=device),)) for i, m in enumerate(models)],
                              config.replace(matmul_strategy="triton"))
    exe = par.compiled.base
    kernels = [s for s in exe.steps if isinstance(s, KernelStep)]
    assert len(kernels) >= 9
    for s in kernels:
        s.source = dataclasses.replace(s.source, pdl=True)
    mark_pdl_launches(exe.steps, exe.schedule)
    sched = exe.schedule
    first_on: dict[int, int] = {}
    for i in sched.order:
        if isinstance(exe.steps[i], KernelStep):
            first_on.setdefault(sched.stream_of[i], i)
    assert len(first_on) == 3
    for i in sched.order:
        step = exe.steps[i]
        if isinstance(step, KernelStep):
            assert step.pdl == (i not in first_on.values()), f"step {i} on stream {sched.stream_of[i]}"
    # not beside others: the three models' kernels all run beside each other (concurrency 3), so
    # none is launched with PDL; a kernel with concurrency 1 still is
    assert all(sched.concurrency.get(i, 1) == 3 for i, s in enumerate(exe.steps) if isinstance(s, KernelStep))
    mark_pdl_launches(exe.steps, exe.schedule, beside_others=False)
    assert not any(s.pdl for s in kernels)
    i_alone = next(i for i in sched.order if isinstance(exe.steps[i], KernelStep) and i not in first_on.values())
    mark_pdl_launches(exe.steps, dataclasses.replace(sched, concurrency={**sched.concurrency, i_alone: 1}),
                      beside_others=False)
    assert [i for i, s in enumerate(exe.steps) if isinstance(s, KernelStep) and s.pdl] == [i_alone]
    for s in kernels:  # a kernel compiled without PDL is never launched with it
        s.source = dataclasses.replace(s.source, pdl=False)
    mark_pdl_launches(exe.steps, exe.schedule)
    assert not any(s.pdl for s in kernels)


@pytest.mark.gpu
def test_pdl_graph_replays_on_streams_match_eager_and_the_plain_launches(config) -> None:  # type: ignore[no-untyped-def]
    """Four 3-layer MLPs (prefetching matrix-vector kernels) and a batch-4 MLP with a layer norm,
    on 4 streams in one CUDA graph and without graphs: equal to eager on 30 fresh inputs each, and
    bit-identical to the same kernels launched without PDL (the wait moves no arithmetic)."""
    from test_runtime import mlp

    torch.manual_seed(0)
    models = [torch.nn.Sequential(mlp(256, 512, 256), torch.nn.LayerNorm(256)).cuda() for _ in range(4)]
    with torch.no_grad():
        pairs = [(m, (randn(1, 256, device="cuda", seed=i),)) for i, m in enumerate(models)]
        on = streamfuse.parallel(pairs, config)
        off = streamfuse.parallel(pairs, config.replace(pdl=False))
        streams = streamfuse.parallel(pairs, config.replace(cuda_graphs=False))
        launched = [s for s in on.compiled.base.steps if isinstance(s, KernelStep)]
        assert any(s.pdl for s in launched) and all(s.source.pdl for s in launched)
        assert any(_reads_before_wait(s.source) for s in launched)  # the weights are prefetched
        assert not any(s.pdl for s in off.compiled.base.steps if isinstance(s, KernelStep))
        text = on.explain(source=False)
        assert f"programmatic dependent launch: {sum(s.pdl for s in launched)} of {len(launched)}" in text
        assert "outputs: fresh; up to 2 recorded instance(s)" in text
        for rep in range(30):
            xs = [randn(1, 256, device="cuda", seed=1000 + 10 * rep + i) for i in range(4)]
            got, plain, unstaged = on(*xs), off(*xs), streams(*xs)
            for m, x, a, b, c in zip(models, xs, got, plain, unstaged, strict=True):
                torch.testing.assert_close(a, m(x), rtol=1e-4, atol=1e-4)
                assert torch.equal(a, b) and torch.equal(a, c)
        batch = streamfuse.compile(models[0], (randn(4, 256, device="cuda"),), config)
        for rep in range(10):
            x = randn(4, 256, device="cuda", seed=50 + rep)
            torch.testing.assert_close(batch(x), models[0](x), rtol=1e-4, atol=1e-4)


def test_pdl_launch_after_a_convolution_only_when_configured(config, device) -> None:  # type: ignore[no-untyped-def]
    """The conv block's fused tail follows a cuDNN convolution on its stream: launched with PDL
    under pdl_after_convolutions (it starts as the convolution's programs exit), plainly without."""
    from streamfuse.demo_models import conv_block
    from streamfuse.runtime.executable import is_convolution_step

    block, inputs = conv_block(device)
    exe = streamfuse.compile(block, inputs, config.replace(conv_layout="native", max_streams=1)).base
    tail = [s for s in exe.steps if isinstance(s, KernelStep)][-1]  # after the generated max pool: the tail
    tail.source = dataclasses.replace(tail.source, pdl=True)
    before = exe.steps[exe.steps.index(tail) - 1]
    assert is_convolution_step(before)
    mark_pdl_launches(exe.steps, exe.schedule, after_convolutions=True)
    assert tail.pdl
    mark_pdl_launches(exe.steps, exe.schedule, after_convolutions=False)
    assert not tail.pdl
