"""The outputs of a ProfileReport (terminal, Chrome trace, PNG, HTML, files) from synthetic timelines, CPU only."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from rich.console import Console

from streamfuse.profile.outputs import (
    plot_timeline,
    render_summary,
    safe_stem,
    save_report,
    write_chrome_trace,
    write_html,
)
from streamfuse.profile.report import CEILINGS, DeviceSample, KernelInfo, ProfileReport, build_report
from streamfuse.profile.timeline import Interval, intervals_from_trace

LONG_NAME = ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, "
             "at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul> >(int, [T], std::array)")


def _intervals() -> list[Interval]:
    """Three streams with CUDA-like ids, overlap across streams, gaps, repeated and very long names."""
    out = []
    for call in range(3):
        t = 1000.0 + 200.0 * call
        out += [Interval("gemm_bf16", 7, t, t + 60.0),
                Interval("add_relu", 7, t + 70.0, t + 72.5),
                Interval("layernorm", 13, t + 10.0, t + 40.0),
                Interval(LONG_NAME, 13, t + 45.0, t + 48.0),
                Interval("add_relu", 21, t + 50.0, t + 53.0),
                Interval("softmax", 21, t + 90.0, t + 130.0)]
    return out


def _info() -> dict[str, KernelInfo]:
    return {"gemm_bf16": KernelInfo(bytes=64e6, flops=2e10, occupancy=0.12, limiter="registers"),
            "layernorm": KernelInfo(bytes=8e6, occupancy=0.75, limiter="shared memory"),
            "add_relu": KernelInfo(bytes=1e6, flops=2.5e5)}


def _samples() -> list[DeviceSample]:
    return [DeviceSample(0.1 * i, 50.0 + 10 * i, 1900.0 + i, 4000.0 + 100 * i) for i in range(12)]


@pytest.fixture(scope="module")
def reports() -> dict[str, ProfileReport]:
    return {
        "measured": build_report("mlp <fused> & co", "NVIDIA H200", _intervals(), predicted=False, calls=3,
                                 ceilings=CEILINGS["H200"], info=_info(), samples=_samples()),
        "predicted": build_report("mlp/predicted run", "NVIDIA H200", _intervals(), predicted=True, calls=3,
                                  ceilings=CEILINGS["H200"], info=_info()),
        "empty": build_report("empty", "cpu", [], predicted=True),
    }


KINDS = ["measured", "predicted", "empty"]


class _Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.data: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.data.append(data)

    def text(self) -> str:
        return " ".join(self.data)


@pytest.mark.parametrize("kind", KINDS)
def test_chrome_trace(kind: str, reports: dict[str, ProfileReport], tmp_path: Path) -> None:
    report = reports[kind]
    trace = json.loads(write_chrome_trace(report, tmp_path / "t.trace.json").read_text())
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    lanes = [e for e in events if e["ph"] == "M" and e["name"] == "thread_name"]
    assert sorted(e["tid"] for e in lanes) == sorted(s.stream for s in report.streams)
    assert all(e["args"]["name"] == f"stream {e['tid']}" for e in lanes)
    process = [e for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert len(process) == 1 and report.label in process[0]["args"]["name"]
    assert report.tag in process[0]["args"]["name"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len(report.intervals)
    if not spans:
        return
    t0 = min(iv.start_us for iv in report.intervals)
    assert min(e["ts"] for e in spans) == 0
    got = sorted((e["name"], e["tid"], e["ts"], e["dur"]) for e in spans)
    want = sorted((iv.name, iv.stream, iv.start_us - t0, iv.duration_us) for iv in report.intervals)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert [x for g in got for x in g[2:]] == pytest.approx([x for w in want for x in w[2:]])
    assert all(e["args"]["stream"] == e["tid"] for e in spans)
    gemm = next(e for e in spans if e["name"] == "gemm_bf16")
    assert gemm["args"]["bytes"] == 64e6 and gemm["args"]["flops"] == 2e10
    assert "flops" not in next(e for e in spans if e["name"] == "layernorm")["args"]
    # torch.profiler's reader gets the same timeline back, shifted to start at 0
    back = sorted((i.name, i.stream, i.start_us, i.end_us) for i in intervals_from_trace(trace))
    shifted = sorted((i.name, i.stream, i.start_us - t0, i.end_us - t0) for i in report.intervals)
    assert [b[:2] for b in back] == [s[:2] for s in shifted]
    assert [x for b in back for x in b[2:]] == pytest.approx([x for s in shifted for x in s[2:]])


@pytest.mark.parametrize("kind", KINDS)
def test_png(kind: str, reports: dict[str, ProfileReport], tmp_path: Path) -> None:
    from PIL import Image

    path = plot_timeline(reports[kind], tmp_path / "sub" / "timeline.png")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000
    with Image.open(path) as image:
        width, height = image.size
    assert width > 100 and height > 100
    assert width <= 12 * 110 + 1 and height < 1000


@pytest.mark.parametrize("kind", KINDS)
def test_html(kind: str, reports: dict[str, ProfileReport], tmp_path: Path) -> None:
    report = reports[kind]
    raw = write_html(report, tmp_path / "r.html").read_text(encoding="utf-8")
    parser = _Collector()
    parser.feed(raw)
    parser.close()
    text = parser.text()
    assert report.label in text and report.device in text
    assert report.tag in text
    if report.predicted:
        h1 = raw[raw.index("<h1>"):raw.index("</h1>")]
        assert "predicted" in h1
    assert "fused" not in {tag for tag, _ in parser.tags}  # the label's "<fused>" was escaped
    images = [attrs for tag, attrs in parser.tags if tag == "img"]
    assert len(images) == 1 and (images[0]["src"] or "").startswith("data:image/png;base64,")
    assert raw.count("<img") == 1
    for tag, attrs in parser.tags:
        for key in ("src", "href"):
            assert not re.match(r"https?://", attrs.get(key) or ""), (tag, attrs)
    assert "<link" not in raw and "<script" not in raw
    rows = _table_rows(raw, "Streams")
    assert [r[0] for r in rows] == [str(s.stream) for s in report.streams]
    for recommendation in report.recommendations:
        assert recommendation in text


def _table_rows(raw: str, heading: str) -> list[list[str]]:
    """The body rows of the table after <h2>heading</h2>, as cell texts."""
    section = raw.split(f"<h2>{heading}</h2>", 1)[1].split("</table>", 1)[0]
    body = section.split("<tbody>", 1)[1]
    return [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in body.split("</tr>") if "<td" in row]


def test_html_kernel_table_and_samples(reports: dict[str, ProfileReport], tmp_path: Path) -> None:
    report = reports["measured"]
    raw = write_html(report, tmp_path / "r.html").read_text(encoding="utf-8")
    rows = _table_rows(raw, f"Kernels ({len(report.kernels)})")
    assert len(rows) == len(report.kernels)
    gemm = next(r for r in rows if r[0] == "gemm_bf16")
    assert gemm[9] == "registers" and gemm[8] == "12"
    softmax = next(r for r in rows if r[0] == "softmax")
    assert softmax[5:10] == ["-"] * 5  # nothing known about it
    assert "NVML samples" in raw and "5100" in raw  # max memory used
    assert "NVML samples" not in write_html(reports["predicted"], tmp_path / "p.html").read_text()


def test_html_reuses_given_png(reports: dict[str, ProfileReport], tmp_path: Path) -> None:
    import base64

    png = plot_timeline(reports["predicted"], tmp_path / "t.png")
    raw = write_html(reports["predicted"], tmp_path / "r.html", png=png).read_text()
    assert base64.b64encode(png.read_bytes()).decode() in raw


@pytest.mark.parametrize("kind", KINDS)
def test_render_summary(kind: str, reports: dict[str, ProfileReport]) -> None:
    report = reports[kind]
    console = Console(record=True, width=160)
    console.print(render_summary(report))
    text = console.export_text()
    assert report.label in text and report.device in text
    assert f"({report.tag})" in text
    assert f"gap ratio {100 * report.totals['gap_ratio']:.1f}%" in text
    for stat in report.streams:
        assert f"{100 * stat.busy_share:.1f}" in text
        assert 0.0 <= stat.busy_share <= 1.0
    for recommendation in report.recommendations:
        assert recommendation[:40] in text
    if report.kernels:
        assert "gemm_bf16" in text and "void at::native::vectorized" in text and "…" in text


def test_render_summary_top_n(reports: dict[str, ProfileReport]) -> None:
    console = Console(record=True, width=160)
    console.print(render_summary(reports["predicted"], top=2))
    text = console.export_text()
    assert "Top 2 of" in text and "gemm_bf16" in text and "add_relu" not in text


@pytest.mark.parametrize("kind", KINDS)
def test_save_report(kind: str, reports: dict[str, ProfileReport], tmp_path: Path) -> None:
    report = reports[kind]
    paths = save_report(report, tmp_path / "out")
    assert set(paths) == {"trace", "png", "html", "json"}
    stem = safe_stem(report.label)
    assert {p.name for p in paths.values()} == {f"{stem}.trace.json", f"{stem}.png", f"{stem}.html",
                                               f"{stem}.json"}
    assert all(p.is_file() and p.parent == tmp_path / "out" for p in paths.values())
    summary = json.loads(paths["json"].read_text())
    assert summary["label"] == report.label and summary["predicted"] == report.predicted
    assert len(summary["streams"]) == len(report.streams)
    assert save_report(report, tmp_path / "out", stem="x")["html"].name == "x.html"


def test_safe_stem() -> None:
    assert safe_stem("mlp <fused> & co") == "mlp-fused-co"
    assert safe_stem("mlp/predicted run") == "mlp-predicted-run"
    assert safe_stem("../..") == "profile"


def test_plot_leaves_no_figure_or_backend_change(reports: dict[str, ProfileReport], tmp_path: Path) -> None:
    import matplotlib
    import matplotlib.pyplot as plt

    backend = matplotlib.get_backend()
    before = plt.get_fignums()
    plot_timeline(reports["measured"], tmp_path / "t.png")
    assert plt.get_fignums() == before and matplotlib.get_backend() == backend


def test_measured_multi_stream_gaps_come_with_the_profiler_caveat(reports) -> None:  # type: ignore[no-untyped-def]
    measured, predicted = reports["measured"], reports["predicted"]
    assert measured.totals["streams"] == 3 and measured.totals["gap_ratio"] > 0.05
    assert any("CUPTI" in r for r in measured.recommendations)
    assert not any("CUPTI" in r for r in predicted.recommendations)  # the cost model has no profiler in it
    one_stream = build_report("one", "NVIDIA H200", [iv for iv in _intervals() if iv.stream == 7], predicted=False,
                              calls=3, ceilings=CEILINGS["H200"])
    assert not any("CUPTI" in r for r in one_stream.recommendations)


def test_too_few_nvml_samples_say_so(tmp_path: Path) -> None:
    """Four readings of a short run (NVML averages utilization over up to a second) are no reading:
    the report says so instead of printing a number (a busy GPU once read 0.0% this way)."""
    few = [DeviceSample(0.01 * i, 0.0, 1900.0, 4000.0) for i in range(4)]
    report = build_report("short", "NVIDIA H200", _intervals(), predicted=False, calls=3, samples=few)
    raw = write_html(report, tmp_path / "r.html").read_text(encoding="utf-8")
    assert "too few to read utilization" in raw and "0.0" not in _table_rows(raw, "NVML samples")[0]


def test_summary_text_merges_streams_and_gives_per_call_figures() -> None:
    from streamfuse.profile.outputs import summary_text

    ivs = [Interval("gemm", 0, 0, 30), Interval("gemm", 1, 5, 25), Interval("add", 0, 30, 40),
           Interval("gemm", 0, 100, 130), Interval("add", 0, 130, 140)]
    report = build_report("two tokens", "NVIDIA H200", ivs, predicted=False, calls=2)
    text = summary_text(report, top=1, per="token")
    first, gemm, rest = text.splitlines()
    # busy: 0-40 and 100-140 = 80 µs over 2 tokens; 5 kernels
    assert first.startswith("two tokens: 2 kernels per token, GPU busy 40 µs of a 70 µs span per token")
    assert "40.0 µs/token" in gemm and "1.5x" in gemm and gemm.endswith("gemm")  # 80 µs of gemm over 2 tokens
    assert "10.0 µs/token" in rest and "1 other kernels" in rest


def test_a_kernel_launched_early_is_charged_its_own_time() -> None:
    """Programmatic dependent launch: a kernel starts while the one before it on its stream runs and
    waits (gdc_wait), so its traced interval covers most of its predecessor (BERT-base's layer-norm
    column sums at 11.3 µs behind their row kernel, run 228). The report charges each kernel from the
    end of the one before it on its stream; the wait is reported once, and overlap across streams is
    not a wait."""
    from streamfuse.profile.outputs import summary_text
    from streamfuse.profile.report import own_durations

    ivs = []
    for call in range(2):
        t = 100.0 * call
        ivs += [Interval("row", 0, t, t + 7.0), Interval("column", 0, t + 1.0, t + 11.0),  # waits 6 µs
                Interval("gemm", 1, t + 2.0, t + 9.0)]  # another stream: runs beside, no wait
    assert own_durations(ivs) == [7.0, 4.0, 7.0] * 2
    report = build_report("pdl", "NVIDIA H200", ivs, predicted=False, calls=2,
                          info={"column": KernelInfo(bytes=4e6)})
    column = next(k for k in report.kernels if k.name == "column")
    assert column.total_us == 8.0 and column.mean_us == 4.0 and column.achieved_gbps == 1000.0
    assert report.totals["waiting_us"] == 12.0 and report.totals["busy_us"] == 22.0
    text = summary_text(report)
    assert "6 µs/call of their traced durations was spent launched early" in text
    assert "4.0 µs/call" in next(line for line in text.splitlines() if line.endswith("column"))
    # without overlap on a stream nothing changes: every interval's own time is its duration
    plain = [Interval("a", 0, 0.0, 5.0), Interval("b", 0, 5.0, 9.0), Interval("c", 1, 1.0, 3.0)]
    assert own_durations(plain) == [5.0, 4.0, 2.0]
    assert "launched early" not in summary_text(build_report("plain", "cpu", plain, predicted=False))
