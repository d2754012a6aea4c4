"""The models suite of `streamfuse bench` (bench/models.py) on CPU: tiny Hugging Face configs through
both streamfuse entry points, checked against eager; vision workloads without torchvision; the tables."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch import nn

from streamfuse.bench.models import MODELS, model_workloads, nonzero_parameters
from streamfuse.bench.report import failures, models_table, streamfuse_table
from streamfuse.bench.runner import ModeResult, WorkloadResult, exact_fp32, geomean_vs, rel_error, run_suite, write_json
from streamfuse.bench.workloads import Workload, suite
from streamfuse.cli import main

pytest.importorskip("transformers")


def test_models_suite_tiny_transformers_through_both_entry_points(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench"
    code = main(["bench", "--suite", "models", "--models", "gpt2 decode,llama,distil", "--batch", "1",
                 "--dtype", "float32", "--tiny", "--reps", "1", "--explain", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "streamfuse vs reduce-overhead" in printed and "cold compile s" in printed
    doc = json.loads((out / "bench.json").read_text())
    assert doc["settings"]["tiny"] is True and "in-process" in doc["notes"]["compile_warm_s"]
    assert [r["workload"] for r in doc["rows"]] == ["gpt2 decode b1x1 fp32", "distilbert b1x16 fp32",
                                                    "llama gqa b1x16 fp32"]
    for row in doc["rows"]:
        assert row["tolerance"] == 1e-4 and row["info"]["batch"] == 1
        assert row["modes"]["eager"]["error"] is None
        for mode in ("streamfuse", "sf-backend"):
            res = row["modes"][mode]
            assert res["error"] is None, (row["workload"], mode, res["error"])
            assert res["second_error"] is None, (row["workload"], mode, res["second_error"])
            assert res["max_rel_err"] <= 1e-4 and res["second_rel_err"] <= 1e-4 and res["second_batch"] == 3
            assert res["planned_kernels"] > 0 and res["us"] > 0
            assert res["compile_s"] > 0 and res["compile_warm_s"] > 0
        backend = row["modes"]["sf-backend"]  # torch.compile's own share, reported beside the total
        assert 0 < backend["dynamo_s"] <= backend["compile_s"] and 0 < backend["dynamo_warm_s"] <= backend["compile_warm_s"]
        assert row["modes"]["streamfuse"]["dynamo_s"] is None
        # --explain: the plan each streamfuse mode timed, one file per workload and mode
        name = row["workload"].replace(" ", "-")  # profile/outputs.safe_stem
        for mode in ("streamfuse", "sf-backend"):
            text = (out / "explain" / f"{name}.{mode}.txt").read_text()
            assert "kernel launches per call" in text and "kernels, in launch order:" in text, (name, mode)
        planned = row["modes"]["streamfuse"]["planned_kernels"]
        assert f"-> {planned} kernel launches per call" in (out / "explain" / f"{name}.streamfuse.txt").read_text()
    assert "Dynamo)" in printed
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_vision_workloads_report_unavailable_without_torchvision(  # type: ignore[no-untyped-def]
        monkeypatch: pytest.MonkeyPatch, config, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", None)  # import torchvision -> ImportError, as on CPU here
    workloads = model_workloads("squeezenet", batch="1", dtype="float32", tiny=True)
    results = run_suite(workloads, ["eager", "streamfuse", "sf-backend"], torch.device("cpu"), config, tmp_path,
                        cold_cache=True)
    assert all(res.error and res.error.startswith("workload unavailable") for res in results[0].modes.values())
    assert json.loads((tmp_path / "bench.json").read_text())["rows"][0]["workload"] == "squeezenet1_1 b1 fp32"


def test_extra_checks_fail_beside_a_valid_time(config, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    def make(device: torch.device) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval(), (torch.randn(2, 8),)

    w = Workload("bad second batch", make, tolerance=1e-4, rel_floor=0.0,
                 second_inputs=lambda model, device: (torch.randn(3, 5),))  # wrong width: eager itself fails
    (row,) = run_suite([w], ["eager", "streamfuse"], torch.device("cpu"), config, reps=1)
    sf = row.modes["streamfuse"]
    assert sf.error is None and sf.us is not None and sf.max_rel_err is not None and sf.max_rel_err <= 1e-4
    assert sf.second_batch == 3 and sf.second_error and "RuntimeError" in sf.second_error
    assert any("bad second batch / streamfuse (extra checks): RuntimeError" in line for line in failures([row]))


class _DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if bool(x.sum() > 0) else x - 1  # a branch on data: no capture path takes it


def test_a_fallback_is_reported_as_a_failure(config, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """swin_t once ran eagerly behind a StreamfuseFallbackWarning and the bench showed its time
    as streamfuse's: the fallback (here: through the backend, the model not captured whole) is
    part of the mode's result and of the failures."""
    torch._dynamo.reset()
    w = Workload("data-dependent", lambda device: (_DataDependent(), (torch.randn(4, 8),)), tolerance=1e-4)
    (row,) = run_suite([w], ["eager", "streamfuse"], torch.device("cpu"), config, reps=1)
    sf = row.modes["streamfuse"]
    assert sf.error is None and sf.fallback and "could not be captured as one graph" in sf.fallback
    assert any("data-dependent / streamfuse fell back" in line for line in failures([row]))
    assert row.modes["eager"].fallback is None
    torch._dynamo.reset()


def test_model_list_and_filters() -> None:
    names = [s.name for s in MODELS]
    assert len(names) >= 20 and len(set(names)) == len(names)
    for expected in ("resnet50", "googlenet", "inception_v3", "vit_b_16", "swin_t", "gpt2 decode", "gpt2 prefill",
                     "bert-base", "distilbert", "roberta-base", "t5-small encoder", "llama gqa"):
        assert expected in names
    everything = model_workloads()
    assert len(everything) == 4 * len(MODELS) and len(suite("models")) == len(everything)
    full = {w.name: w for w in everything}
    assert {"resnet50 b32 fp32", "inception_v3 b1 bf16", "bert-base b8x128 fp32", "gpt2 decode b1x1 bf16",
            "gpt2 decode b8x1 fp32", "llama gqa b1x128 fp32"} <= set(full)
    assert full["inception_v3 b1 bf16"].info[-1] == ("resolution", 299)
    assert full["resnet50 b32 fp32"].tolerance == 1e-4 and full["resnet50 b32 bf16"].tolerance == 2e-2
    chosen = model_workloads("ResNet, t5-small", batch="throughput", dtype="bfloat16")
    assert [w.name for w in chosen] == ["resnet50 b32 bf16", "t5-small encoder b8x128 bf16"]
    # a filter starts a name or a word of it: "t5" is not resnet50, "bert" not distilbert or roberta
    assert [w.info[0][1] for w in model_workloads("t5,bert", batch="1", dtype="float32")] == [
        "bert-base", "t5-small encoder"]
    assert {w.info[0][1] for w in model_workloads("mobilenet", batch="1", dtype="float32")} == {
        "mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large"}
    with pytest.raises(ValueError, match="no model matches"):
        model_workloads("nope")
    with pytest.raises(ValueError, match="batch must be"):
        model_workloads(batch="64")


def test_rel_error_and_tf32_switch() -> None:
    ref = torch.tensor([0.5, -0.25])
    assert rel_error(ref + 0.005, ref, floor=0.0) == pytest.approx(0.01)
    assert rel_error(ref + 0.005, ref) == pytest.approx(0.005)  # the other suites' floor of 1
    assert rel_error((ref, ref * 2 + 0.1), (ref, ref * 2), floor=0.0) == pytest.approx(0.1)
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with exact_fp32():
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


def test_a_check_against_all_zero_outputs_fails_and_the_suite_leaves_no_zero_parameter() -> None:
    """torchvision's ViT starts its head at zero, so its outputs were 0 whatever streamfuse computed
    and the suite's check printed 0.0e+00 for every vit_b_16 row until session 44."""
    with pytest.raises(AssertionError, match="all zeros"):
        rel_error(torch.ones(3), torch.zeros(3))
    with pytest.raises(AssertionError, match="all zeros"):
        rel_error((torch.ones(2), torch.ones(2)), (torch.zeros(2), torch.zeros(2)), floor=0.0)
    assert rel_error((torch.ones(2), torch.zeros(2)), (torch.ones(2), torch.zeros(2))) == 0.0  # one zero output is fine
    head = nn.Linear(4, 2)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    model = nn.Sequential(nn.Linear(3, 4), nn.GELU(), head)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    assert not model(x).any()
    kept = model[0].weight.detach().clone()
    assert nonzero_parameters(model) is model
    assert model(x).any() and bool(head.weight.all()) and bool(head.bias.all())
    assert torch.equal(model[0].weight, kept)  # parameters with values keep them
    # the suite builds models inside `with torch.device(device)`: values are still drawn on the generator's
    # device (run 167 on a GPU: "Expected a 'cuda' device type for generator but found 'cpu'")
    other = nn.Linear(3, 2)
    nn.init.zeros_(other.weight)
    with torch.device("meta"):
        nonzero_parameters(other)
    assert bool(other.weight.all())


def test_tables_print_both_ratios_against_reduce_overhead() -> None:
    row = WorkloadResult("bert-base b1x128 bf16", {
        "eager": ModeResult("eager", us=900.0), "compile-ro": ModeResult("compile-ro", us=300.0),
        "streamfuse": ModeResult("streamfuse", us=200.0, max_rel_err=3e-3, planned_kernels=40, compile_s=9.0,
                                 compile_warm_s=2.0, second_batch=3, second_rel_err=4e-3),
        "sf-backend": ModeResult("sf-backend", error="RuntimeError: [1, 2] boom")}, tolerance=2e-2)
    assert row.ratio("streamfuse", "compile-ro") == pytest.approx(1.5) and row.ratio("sf-backend", "compile-ro") is None
    console = Console(width=250, record=True)
    console.print(models_table([row], ["eager", "compile-ro", "streamfuse", "sf-backend"], "t"))
    console.print(streamfuse_table([row], "s"))
    text = console.export_text()
    assert "1.50x" in text and "40 (plan)" in text and "b3: 4.0e-03" in text and "[1, 2] boom" in text


def test_geometric_means_against_reduce_overhead_per_batch_kind(tmp_path: Path) -> None:
    def row(name: str, kind: str, ro: float, sf: float | None, backend: float | None) -> WorkloadResult:
        modes = {"compile-ro": ModeResult("compile-ro", us=ro), "streamfuse": ModeResult("streamfuse", us=sf),
                 "sf-backend": ModeResult("sf-backend", us=backend)}
        return WorkloadResult(name, modes, info={"batch_kind": kind})

    rows = [row("a b1", "batch 1", 200.0, 100.0, 100.0), row("b b1", "batch 1", 100.0, 200.0, None),
            row("c b32", "throughput", 300.0, 100.0, 150.0)]
    assert geomean_vs(rows, "streamfuse") == {"batch 1": (pytest.approx(1.0), 2), "throughput": (pytest.approx(3.0), 1)}
    assert geomean_vs(rows, "sf-backend") == {"batch 1": (pytest.approx(2.0), 1), "throughput": (pytest.approx(2.0), 1)}
    console = Console(width=250, record=True)
    console.print(models_table(rows, ["compile-ro", "streamfuse", "sf-backend"], "t"))
    text = console.export_text()
    assert "geometric mean, batch 1" in text and "1.00x (2)" in text and "3.00x (1)" in text and "2.00x (1)" in text
    write_json(rows, tmp_path / "bench.json", torch.device("cpu"))
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["geomeans"]["streamfuse_vs_reduce_overhead"]["throughput"] == {"geomean": pytest.approx(3.0), "workloads": 1}


def test_each_finished_workload_gets_a_summary_line() -> None:
    """`streamfuse bench` prints a row as soon as its workload has run (a run cut short by a time limit
    still shows what it measured): every mode's µs or its error, the streamfuse modes' speed-up over
    reduce-overhead, and streamfuse's check."""
    from streamfuse.bench.report import row_summary
    from streamfuse.bench.runner import ModeResult, WorkloadResult

    row = WorkloadResult("convnext_tiny b32 fp32")
    row.modes = {"compile-ro": ModeResult("compile-ro", us=4006.3),
                 "streamfuse": ModeResult("streamfuse", us=3923.0, max_rel_err=7.4e-7),
                 "sf-backend": ModeResult("sf-backend", error="RuntimeError: something broke")}
    line = row_summary(row)
    assert line.startswith("convnext_tiny b32 fp32: compile-ro 4006.3 µs")
    assert "streamfuse 3923.0 µs (1.02x reduce-overhead)" in line
    assert "sf-backend - (RuntimeError: something broke)" in line and line.endswith("max rel err 7.4e-07")


class _GradModeProbe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.grad_modes: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.grad_modes.append(torch.is_grad_enabled())
        return self.lin(x).relu()


def test_timed_calls_run_without_autograd(config, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The suite times inference as a user runs it: the float32 rows built again for timing (TF32 on)
    are built and timed without autograd too (else torch.compile and the backend trace training graphs)."""
    from streamfuse.bench import runner

    probes: list[_GradModeProbe] = []

    def make(device: torch.device) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        probes.append(_GradModeProbe().eval())
        return probes[-1], (torch.randn(2, 8),)

    monkeypatch.setattr(runner, "retime_with_defaults", lambda workload, device: True)  # as on CUDA in fp32
    (row,) = run_suite([Workload("probe", make, tolerance=1e-4)], ["eager"], torch.device("cpu"), config, reps=2)
    assert row.modes["eager"].error is None and row.modes["eager"].us is not None
    calls = [mode for p in probes for mode in p.grad_modes]
    assert len(probes) >= 2 and len(calls) >= 5 and not any(calls)


class _RoundedChain(nn.Module):
    """Eight pointwise steps: in bfloat16 eager rounds after each, a fused kernel would round once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(8):
            x = torch.tanh(x * 0.71 + 0.11) * 1.3 - x * 0.17
        return x


def test_a_low_precision_result_is_judged_against_float32_where_it_differs_from_eager() -> None:
    """Over the tolerance from eager's bfloat16 result, a result no farther than eager from the same
    model in float32 passes (eager's own rounding is the difference), and so does one up to
    F32_ERROR_FACTOR times farther; one farther still fails, naming both errors; a float32 workload
    over the tolerance fails as before."""
    from streamfuse.bench.runner import judge

    model = _RoundedChain()
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    ref = model(x)
    nearest = model(x.float()).bfloat16()  # the float32 chain rounded once
    assert rel_error(nearest, ref, 0.0) > 1e-3  # eager's rounding shows
    work = Workload("chain bf16", lambda d: (model, (x,)), torch.bfloat16, tolerance=1e-4, rel_floor=0.0)
    good, bad = ModeResult("streamfuse"), ModeResult("streamfuse")
    assert judge(good, work, rel_error(nearest, ref, 0.0), nearest, ref, model, (x,)) is None
    assert good.f32_rel_err is not None and good.eager_f32_rel_err is not None
    assert good.f32_rel_err < good.eager_f32_rel_err
    wrong = ref + 0.25 * ref.abs().max()
    failed = judge(bad, work, rel_error(wrong, ref, 0.0), wrong, ref, model, (x,))
    assert failed is not None and "from float32" in failed
    assert bad.f32_rel_err is not None and bad.eager_f32_rel_err is not None and bad.f32_rel_err > bad.eager_f32_rel_err
    truth = model(x.float())
    for scale, passes in ((1.5, True), (3.0, False)):  # eager's own error, scaled, on either side of the factor
        near = (truth + scale * (ref.float() - truth)).bfloat16()
        mode = ModeResult("streamfuse")
        verdict = judge(mode, work, rel_error(near, ref, 0.0), near, ref, model, (x,))
        assert (verdict is None) is passes, (scale, verdict)
        assert mode.f32_rel_err is not None and mode.eager_f32_rel_err is not None
        assert mode.f32_rel_err > mode.eager_f32_rel_err  # farther than eager either way
    fp32 = Workload("chain fp32", lambda d: (model, (x.float(),)), torch.float32, tolerance=1e-9, rel_floor=0.0)
    plain = ModeResult("streamfuse")
    text = judge(plain, fp32, 1e-6, ref.float(), ref.float(), model, (x.float(),))
    assert text is not None and "from float32" not in text and plain.f32_rel_err is None
    ok_row = WorkloadResult("chain bf16", {"streamfuse": good}, tolerance=1e-4)
    good.max_rel_err = rel_error(nearest, ref, 0.0)
    console = Console(record=True, width=240)
    console.print(streamfuse_table([ok_row], "t"))
    assert "from float32" in console.export_text()
