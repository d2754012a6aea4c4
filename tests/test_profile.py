"""Profiler and benchmark suite: predicted reports on CPU, the CLI, the bench runner; measured
reports on a GPU (gpu marker)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import randn

import streamfuse
from streamfuse.bench.runner import ModeResult, WorkloadResult, run_suite
from streamfuse.bench.workloads import WORKLOADS, Workload, suite
from streamfuse.cli import main
from streamfuse.profile.report import CEILINGS
from streamfuse.sim.timeline import predict_intervals


def _branchy() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from test_runtime import FourBranch

    return FourBranch(32).eval(), (randn(4, 32),)


_NO_PACKING = {"horizontal_fusion": False}


def test_predicted_timeline_respects_streams_and_dependencies(config) -> None:  # type: ignore[no-untyped-def]
    model, inputs = _branchy()
    with torch.no_grad():
        compiled = streamfuse.compile(model, inputs, config.replace(**_NO_PACKING))
    intervals = predict_intervals(compiled, CEILINGS["H200"], calls=2)
    launches = compiled.stats["kernels"]
    assert len(intervals) == 2 * launches
    assert len({iv.stream for iv in intervals}) == compiled.stats["streams"] == 4
    for stream in {iv.stream for iv in intervals}:  # a stream runs one kernel at a time
        ivs = sorted((iv for iv in intervals if iv.stream == stream), key=lambda i: i.start_us)
        assert all(a.end_us <= b.start_us for a, b in zip(ivs, ivs[1:]))
    first_call = intervals[:launches]
    sink = max(first_call, key=lambda iv: iv.end_us)
    assert all(iv.end_us <= sink.start_us for iv in first_call if iv is not sink)  # the sum waits for all


def test_predict_labels_the_report_and_models_eager(config) -> None:  # type: ignore[no-untyped-def]
    model, inputs = _branchy()
    with torch.no_grad():
        compiled = streamfuse.compile(model, inputs, config.replace(**_NO_PACKING))
    sf = streamfuse.predict(compiled, "H200", calls=3)
    eager = streamfuse.predict(compiled, "H200", calls=3, eager=True)
    assert sf.predicted and eager.predicted and sf.tag == "predicted"
    assert eager.totals["streams"] == 1 and sf.totals["streams"] == 4
    assert eager.totals["kernels_per_call"] > sf.totals["kernels_per_call"]  # unfused
    assert eager.totals["span_us"] > sf.totals["span_us"]
    assert any(k.bytes for k in sf.kernels)  # generated kernels carry their byte counts
    assert eager.recommendations and all(isinstance(r, str) for r in eager.recommendations)
    with pytest.raises(ValueError, match="gpu must be one of"):
        streamfuse.predict(compiled, "V100")


def test_profile_cli_on_cpu_writes_predicted_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    factory = tmp_path / "net.py"
    factory.write_text(textwrap.dedent("""
        import torch
        def make():
            net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32))
            return net.eval(), (torch.randn(8, 16),)
    """))
    if torch.cuda.is_available():
        pytest.skip("on a GPU the CLI measures instead (test_gpu_profile_reports)")
    out = tmp_path / "prof"
    assert main(["profile", f"{factory}:make", "--out", str(out), "--calls", "3"]) == 0
    text = capsys.readouterr().out
    assert "predicted" in text and "comparison" in text
    for mode in ("eager", "streamfuse"):
        trace = json.loads((out / f"{mode}.trace.json").read_text())
        assert any(e.get("ph") == "X" for e in trace["traceEvents"])
        assert "predicted" in (out / f"{mode}.html").read_text()
        assert (out / f"{mode}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="--compare takes eager, compile and streamfuse"):
        main(["profile", f"{factory}:make", "--compare", "eager,fast"])


def test_bench_suites_and_listing(capsys: pytest.CaptureFixture[str]) -> None:
    names = {w.name for w in WORKLOADS}
    assert {"pointwise chain 1K", "softmax 4096x4096", "4 MLPs, batch 1", "resnet18, batch 1"} <= names
    assert len(suite("all")) == len(WORKLOADS) and 0 < len(suite("quick")) < len(WORKLOADS)
    with pytest.raises(ValueError, match="suite must be one of"):
        suite("nope")
    assert main(["bench", "--list"]) == 0
    assert "transformer 4x1024, b8 t128" in capsys.readouterr().out


def test_bench_runner_reports_failures_without_stopping(config, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    good = Workload("small chain", lambda d: (lambda x: (x * 2).relu() + 1, (torch.randn(64, device=d),)))
    broken = Workload("broken", lambda d: (lambda x: x @ x, (torch.randn(3, 4, device=d),)))  # shape error
    results = run_suite([good, broken], ["eager", "streamfuse"], torch.device("cpu"), config, tmp_path)
    ok, bad = results
    assert ok.modes["eager"].us is not None and ok.modes["streamfuse"].us is not None
    assert ok.modes["streamfuse"].max_rel_err is not None and ok.modes["streamfuse"].max_rel_err < 1e-6
    assert all(r.error and "workload unavailable" in r.error for r in bad.modes.values())
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert [r["workload"] for r in doc["rows"]] == ["small chain", "broken"]


def test_streamfuse_ratio_is_against_the_best_other_mode() -> None:
    row = WorkloadResult("w", {"eager": ModeResult("eager", us=100.0), "compile": ModeResult("compile", us=40.0),
                               "streamfuse": ModeResult("streamfuse", us=20.0),
                               "eager+graph": ModeResult("eager+graph", error="boom")})
    assert row.best_other() == ("compile", 40.0)
    assert row.streamfuse_ratio() == pytest.approx(2.0)


@pytest.mark.gpu
def test_gpu_profile_reports(config, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from streamfuse.demo_models import conv_block

    model, inputs = conv_block(torch.device("cuda"))
    with torch.no_grad():
        compiled = streamfuse.compile(model, inputs, config.replace(cuda_graphs=False))
        for _ in range(3):
            compiled(*inputs)
        with streamfuse.profile("conv block", calls=5) as prof:
            for _ in range(5):
                compiled(*inputs)
    report = prof.report
    assert report is not None and not report.predicted
    # cuDNN may launch more than one kernel per convolution: at least every planned launch shows up
    assert report.totals["kernels_per_call"] >= compiled.stats["kernels"]
    assert report.totals["streams"] >= 2
    generated = [k for k in report.kernels if k.name.startswith("sf_")]
    assert generated and all(k.bytes for k in generated)
    assert any(k.occupancy is not None for k in generated)
    paths = prof.save(tmp_path)
    assert set(paths) == {"trace", "png", "html", "json"}
