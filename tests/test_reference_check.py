"""Tuning checks each matmul template against torch before it times a tile (tune/autotune's
reference_disagreement): the heuristic tile's results on random inputs must be within rounding of
the group's ops run through torch. A kernel that is not runs nowhere: its group goes to cuBLAS
where the choice is still open, or runs through torch. Session 61's split bias, read at the tile's
row, was caught only by the model suite's comparison with eager; this check would have refused it
at compile time."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import compile_and_check, randn

import streamfuse
from streamfuse import Config
from streamfuse.fusion.groups import GroupKind
from streamfuse.runtime.steps import NodeStep
from streamfuse.tune import autotune


def _linear_gelu(device: torch.device) -> tuple[Any, list[torch.Tensor]]:
    torch.manual_seed(0)
    lin = torch.nn.Linear(40, 48).to(device)
    return (lambda x, r: F.gelu(lin(x)) + r), [randn(37, 40, device=device), randn(37, 48, device=device, seed=1)]


def _launch(compiled: streamfuse.CompiledGraph) -> tuple[Any, Any, list[Any]]:
    """The template group, its source and the arguments of one launch on random inputs (run)."""
    (group,) = [g for g in compiled.plan.groups if g.kind is GroupKind.MATMUL]
    source = compiled.sources[group.id]
    kernel = compiled.steps[compiled.plan.groups.index(group)].kernel
    args = autotune.kernel_args(source, compiled.device)
    kernel[source.grid](*args, *source.scratch_tensors(compiled.device), num_warps=source.num_warps,
                        num_stages=source.num_stages, **source.constexprs)
    return group, source, args


def test_a_right_kernel_agrees_and_a_wrong_one_does_not(config: Config, device: torch.device) -> None:
    """The template's own results agree with torch's; the same results with one column moved by the
    size of a bias (the shape of session 61's bug) do not, and the reason names the output."""
    fn, inputs = _linear_gelu(device)
    compiled = compile_and_check(fn, inputs, config.replace(matmul_strategy="triton"))
    group, source, args = _launch(compiled)
    outputs = autotune._outputs(source, args)
    assert autotune.reference_disagreement(group, source, args, outputs) is None
    wrong = [t.clone() for t in outputs]
    wrong[0][:, 3] += 1.0
    reason = autotune.reference_disagreement(group, source, args, wrong)
    assert reason is not None and f"%{source.outputs[0].name}" in reason and "away from torch" in reason
    # NaN in the kernel's results where torch has none is a disagreement too
    wrong[0].copy_(outputs[0])
    wrong[0][0, 0] = float("nan")
    assert autotune.reference_disagreement(group, source, args, wrong) is not None


@pytest.mark.parametrize("heuristic", ["spilled", "failed"])
@pytest.mark.parametrize("wrong", [False, True])
def test_a_template_is_checked_when_its_heuristic_tile_does_not_score(
        config: Config, device: torch.device, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wrong: bool,
        heuristic: str) -> None:
    """Run 231: the heuristic tile spilled 8 registers (bfloat16), scored inf, and the check against
    torch ran only on a heuristic tile that scored, so the template was tuned unchecked and its
    candidate tiles compared with nothing. Now a heuristic tile that ran (spilled) is checked all the
    same and is the candidates' reference; one that did not run (failed to compile) hands the check
    to the first candidate tile that runs. A wrong template is refused (a warning, the job marked,
    nothing cached, no tile timed after), a right one tuned and cached."""
    fn, inputs = _linear_gelu(device)
    compiled = compile_and_check(fn, inputs, config.replace(matmul_strategy="triton"))
    group, source, _ = _launch(compiled)
    kernel = compiled.steps[compiled.plan.groups.index(group)].kernel
    tiles = autotune.candidate_tiles(group, config, 132)[:3]
    timed: list[bool] = []  # per time_tile call: was there a reference to compare with

    def fake_time(kernel: Any, src: Any, args: list[Any], expected: Any, copies: int = 1,
                  why: list[str] | None = None) -> float:
        first = not timed
        timed.append(expected is not None)
        if first and heuristic == "failed":
            assert why is not None
            why.append("CompilationError: out of resources")
            return float("inf")
        kernel[src.grid](*args, *src.scratch_tensors(device), num_warps=src.num_warps,
                         num_stages=src.num_stages, **src.constexprs)
        if wrong:
            autotune._outputs(src, args)[0][:, 3] += 1.0  # one column moved, as session 61's bias
        if first:  # spilled: it ran, and scores inf
            assert why is not None
            why.append(f"8 {autotune.SPILLED}")
            return float("inf")
        return 5.0 + len(timed)

    monkeypatch.setattr(autotune, "time_tile", fake_time)
    monkeypatch.setattr(autotune, "_compile", lambda *a: None)  # the launches compile in the interpreter
    job = autotune.TuneJob(group, source, kernel)
    found: list[Any] = [None]
    tuned = config.replace(cache_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autotune._tune([autotune._Tuning(0, job, tiles, "key")], found, tuned, device, 132, False)
    said = [str(w.message) for w in caught if "away from torch" in str(w.message)]
    (tile, us), = found
    cached = autotune.load_cache(tmp_path)
    if wrong:
        assert said and job.disagrees is not None and us == float("inf") and "key" not in cached
        # nothing timed after the refusal: the spilled heuristic tile was checked itself, or the
        # first candidate was
        assert timed == ([False] if heuristic == "spilled" else [False, False])
    else:
        assert not said and job.disagrees is None and "tile" in cached["key"]
        # every candidate compared with the reference: the spilled heuristic tile's results, or the
        # first candidate's
        assert timed == ([False, True, True, True] if heuristic == "spilled" else [False, False, True, True])
        assert tile == tiles[0] and us == 7.0


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["triton", "auto"])
def test_a_wrong_template_never_runs(config: Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     strategy: str) -> None:
    """A template whose heuristic tile computes something else (simulated: its results moved after
    each launch) is not tuned or cached; with the strategy forced to the template its group runs
    through torch, under "auto" (the template checked against cuBLAS) through cuBLAS; a warning
    says so, and the model's results match eager's."""
    real, real_check = autotune.time_tile, autotune.reference_disagreement
    seen: list[str] = []  # what tuning did, for the failure message

    def corrupting(kernel: Any, source: Any, args: list[Any], expected: Any, copies: int = 1,
                   why: list[str] | None = None) -> float:
        us = real(kernel, source, args, expected, copies, why)
        if expected is None:  # the heuristic tile's launch, whose results tuning checks
            autotune._outputs(source, args)[0].add_(1.0)
            seen.append(f"heuristic tile {us:.3g} us {why}")
        return us

    def checking(group: Any, source: Any, args: list[Any], outputs: list[torch.Tensor]) -> str | None:
        verdict = real_check(group, source, args, outputs)
        seen.append(f"check of {group.name}: {verdict}")
        return verdict

    monkeypatch.setattr(autotune, "time_tile", corrupting)
    monkeypatch.setattr(autotune, "reference_disagreement", checking)
    device = torch.device("cuda")
    bf16 = torch.bfloat16
    lin = torch.nn.Linear(512, 1024).to(device=device, dtype=bf16)
    fn = lambda x: F.gelu(lin(x))
    inputs = [randn(256, 512, dtype=bf16, device=device)]
    tuned = config.replace(autotune=True, matmul_strategy=strategy, cache_dir=tmp_path)  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = compile_and_check(fn, inputs, tuned)
    if strategy == "auto" and not any(c.measured for c in compiled.plan.matmul_choices.values()):
        pytest.skip("the cost model gave the product to cuBLAS: no template was checked")
    said = [str(w.message) for w in caught if "away from torch" in str(w.message)]
    assert said, (seen, [str(w.message) for w in caught], compiled.explain(source=False))
    assert not [v for v in autotune.load_cache(tmp_path).values() if "tile" in v]
    if strategy == "triton":
        (group,) = [g for g in compiled.plan.groups if g.contraction is not None]
        step = compiled.steps[compiled.plan.groups.index(group)]
        assert type(step) is NodeStep and "runs through torch" in group.note
        assert compiled.stats["generated_kernels"] == 0 and compiled.stats["aten_kernels"] >= 1
        assert "runs through torch" in compiled.explain(source=False)
    else:  # cuBLAS (on CUDA the GELU may ride in its epilogue: one ATen op, no contraction group; run 232)
        assert not [g for g in compiled.plan.groups if g.kind is GroupKind.MATMUL]
        assert compiled.stats["aten_kernels"] >= 1
