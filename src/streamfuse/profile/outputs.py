"""What a ProfileReport becomes: a terminal summary, a Chrome/Perfetto trace, a timeline PNG, one HTML page.

Every output says whether its numbers were measured on a GPU or predicted by the cost model.
"""

from __future__ import annotations

import base64
import html
import json
import re
import tempfile
import zlib
from collections import defaultdict
from pathlib import Path
from statistics import fmean
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from streamfuse.profile.report import ProfileReport, summary_dict
from streamfuse.profile.timeline import Interval

TOP_KERNELS = 15
LEGEND_KERNELS = 10
NAME_WIDTH = 40

STREAM_HEADERS = ("stream id (trace)", "kernels", "busy µs", "busy % of the run")
STREAM_NOTE = ("stream ids as the trace records them: a replayed CUDA graph's branches run on streams the driver "
               "picks, so there can be more ids than the plan has streams; the run's gap ratio is in the totals")
MIN_SAMPLES = 10
"""NVML averages utilization over its own window (up to a second): fewer readings than this over a short
run give a number that describes the sampling, not the GPU."""
KERNEL_HEADERS = ("kernel", "stream", "calls", "mean µs", "total µs", "GB/s", "% copy BW", "TFLOP/s",
                  "occupancy %", "limiter", "launch-bound")
_TOTALS = (  # header, totals key, format, scale
    ("calls", "calls", ".0f", 1.0),
    ("kernels / call", "kernels_per_call", ".1f", 1.0),
    ("kernel runs", "kernel_count", ".0f", 1.0),
    ("busy µs", "busy_us", ".1f", 1.0),
    ("span µs", "span_us", ".1f", 1.0),
    ("gap ratio %", "gap_ratio", ".1f", 100.0),
    ("launch-bound runs", "launch_bound_kernels", ".0f", 1.0),
    ("streams", "streams", ".0f", 1.0),
)


# -- shared cell formatting ------------------------------------------------------------------------------------------

def _num(value: float | None, fmt: str = ".1f", scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, fmt)


def _short(name: str, width: int | None = NAME_WIDTH) -> str:
    """Kernel names can be C++ templates hundreds of characters long: keep the head and a little of the tail."""
    if width is None or len(name) <= width:
        return name
    tail = width // 4
    return f"{name[:width - tail - 1]}…{name[-tail:]}"


def _title(report: ProfileReport) -> str:
    return f"{report.label} on {report.device} ({report.tag})"


def _caption(report: ProfileReport) -> str:
    return "predicted by the cost model, not measured" if report.predicted else "measured on the GPU"


def _gap_text(report: ProfileReport) -> str:
    return f"gap ratio {100 * report.totals.get('gap_ratio', 0.0):.1f}%"


def _totals_row(report: ProfileReport) -> tuple[list[str], list[str]]:
    headers = [h for h, *_ in _TOTALS]
    return headers, [_num(report.totals.get(key), fmt, scale) for _, key, fmt, scale in _TOTALS]


def _stream_rows(report: ProfileReport) -> list[list[str]]:
    return [[str(s.stream), str(s.kernels), _num(s.busy_us), _num(s.busy_share, scale=100)]
            for s in report.streams]


def _kernel_rows(report: ProfileReport, top: int | None, width: int | None) -> list[list[str]]:
    return [[_short(k.name, width), str(k.stream), str(k.calls), _num(k.mean_us, ".2f"), _num(k.total_us),
             _num(k.achieved_gbps, ".0f"), _num(k.bandwidth_fraction, ".0f", 100), _num(k.achieved_tflops, ".2f"),
             _num(k.occupancy, ".0f", 100), k.limiter or "-", "yes" if k.launch_bound else ""]
            for k in report.kernels[:top]]


def _sample_row(report: ProfileReport) -> tuple[list[str], list[str]] | None:
    s = report.samples
    if not s:
        return None
    if len(s) < MIN_SAMPLES:
        return ["samples", "reading"], [str(len(s)), f"too few to read utilization from (NVML averages over up to "
                                                     f"a second; at least {MIN_SAMPLES} needed): profile more calls"]
    util = [x.gpu_util_percent for x in s]
    headers = ["samples", "GPU util % mean", "GPU util % max", "SM clock MHz mean", "memory used MB max"]
    return headers, [str(len(s)), _num(fmean(util)), _num(max(util)), _num(fmean(x.sm_clock_mhz for x in s), ".0f"),
                     _num(max(x.memory_used_mb for x in s), ".0f")]


# -- terminal ----------------------------------------------------------------------------------------------------------

def _rich_table(title: str, headers: list[str] | tuple[str, ...], rows: list[list[str]], caption: str) -> Table:
    table = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    for h in headers:
        if h == "kernel":  # on a narrow terminal the names wrap first, so the numbers stay whole
            table.add_column(h, justify="left", overflow="fold")
        else:
            table.add_column(h, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))  # Text: kernel names may contain rich markup like [..]
    return table


def render_summary(report: ProfileReport, top: int = TOP_KERNELS) -> Group:
    """Terminal summary: totals, streams, the top kernels, NVML samples and the recommendations."""
    caption = _caption(report)
    style = "bold yellow" if report.predicted else "bold green"
    parts: list[Any] = [Text(f"{_title(report)} — {_gap_text(report)}", style=style)]
    headers, values = _totals_row(report)
    parts.append(_rich_table("Totals", headers, [values], caption))
    parts.append(_rich_table("Streams", STREAM_HEADERS, _stream_rows(report), f"{caption}; {STREAM_NOTE}"))
    shown = min(top, len(report.kernels))
    parts.append(_rich_table(f"Top {shown} of {len(report.kernels)} kernels", KERNEL_HEADERS,
                             _kernel_rows(report, top, NAME_WIDTH), caption))
    samples = _sample_row(report)
    if samples:
        parts.append(_rich_table("NVML samples", samples[0], [samples[1]], caption))
    bullets = Table.grid(padding=(0, 1))
    bullets.add_column(width=3, justify="right")
    bullets.add_column()
    for recommendation in report.recommendations:
        bullets.add_row("•", Text(recommendation))
    parts += [Text("Recommendations", style="bold"), bullets]
    return Group(*parts)


# -- Chrome / Perfetto trace -------------------------------------------------------------------------------------------

def _prepare(path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _trace_events(report: ProfileReport) -> list[dict[str, Any]]:
    t0 = min((iv.start_us for iv in report.intervals), default=0.0)
    known = {k.name: k for k in report.kernels}
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": _title(report)}}]
    for stream in sorted({iv.stream for iv in report.intervals}):
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": stream, "args": {"name": f"stream {stream}"}})
    for iv in sorted(report.intervals, key=lambda i: (i.start_us, i.stream)):
        args: dict[str, Any] = {"stream": iv.stream}
        stat = known.get(iv.name)
        if stat is not None:
            args |= {key: value for key, value in (("bytes", stat.bytes), ("flops", stat.flops)) if value is not None}
        events.append({"ph": "X", "name": iv.name, "cat": "kernel", "pid": 0, "tid": iv.stream,
                       "ts": iv.start_us - t0, "dur": iv.duration_us, "args": args})
    return events


def write_chrome_trace(report: ProfileReport, path: Path) -> Path:
    """A trace for chrome://tracing or ui.perfetto.dev: one lane per stream, times from the first kernel."""
    path = _prepare(path)
    path.write_text(json.dumps({"traceEvents": _trace_events(report), "displayTimeUnit": "ms"}))
    return path


# -- timeline PNG ------------------------------------------------------------------------------------------------------

def _time_by_name(intervals: list[Interval]) -> list[str]:
    """Distinct kernel names, most total time first."""
    total: dict[str, float] = defaultdict(float)
    for iv in intervals:
        total[iv.name] += iv.duration_us
    return sorted(total, key=lambda n: (-total[n], n))


def _colours(names: list[str]) -> dict[str, Any]:
    """A stable colour per name (hash into a qualitative palette), the biggest names first to avoid clashes."""
    from matplotlib import colormaps

    palette = [c for cmap in ("tab20", "tab20b", "tab20c") for c in colormaps[cmap].colors]  # type: ignore[attr-defined]
    free, out = set(range(len(palette))), {}
    for name in names:
        slot = zlib.crc32(name.encode()) % len(palette)
        if free:  # probe to the next unused colour until the palette runs out, then share
            while slot not in free:
                slot = (slot + 1) % len(palette)
            free.discard(slot)
        out[name] = palette[slot]
    return out


def plot_timeline(report: ProfileReport, path: Path) -> Path:
    """One row per stream, kernels coloured by name, x in µs from the first kernel's start."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, no display, nothing left open
    from matplotlib.patches import Patch

    path = _prepare(path)
    streams = sorted({iv.stream for iv in report.intervals})
    names = _time_by_name(report.intervals)
    colours = _colours(names)
    legend = names[:LEGEND_KERNELS]
    legend_rows = -(-len(legend) // 3)
    fig = Figure(figsize=(12, 1.5 + 0.6 * max(len(streams), 1) + 0.22 * legend_rows), dpi=110,
                 layout="constrained")
    ax = fig.add_subplot()
    t0 = min((iv.start_us for iv in report.intervals), default=0.0)
    edge = 0.3 if len(report.intervals) < 500 else 0.0  # white seams between kernels, unless they would be all
    for row, stream in enumerate(streams):
        by_name: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for iv in report.intervals:
            if iv.stream == stream:
                by_name[iv.name].append((iv.start_us - t0, iv.duration_us))
        for name, bars in by_name.items():
            ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colours[name], edgecolor="white", linewidth=edge)
    ax.set_yticks(range(len(streams)), [f"stream {s}" for s in streams])
    ax.set_ylim(len(streams) - 0.5 if streams else 0.5, -0.5)
    ax.set_xlabel("µs from the first kernel's start")
    if report.intervals:
        ax.set_xlim(0, max(report.totals.get("span_us", 0.0), 1e-3) * 1.01)
    else:
        ax.set_xticks([])
        ax.text(0.5, 0.5, "no kernels", transform=ax.transAxes, ha="center", va="center", color="grey")
    ax.set_title(f"{_title(report)} — {_gap_text(report)}", loc="left", fontsize=10,
                 color="darkorange" if report.predicted else "black")
    if legend:
        handles = [Patch(color=colours[n]) for n in legend]
        fig.legend(handles, [_short(n, 45) for n in legend], loc="outside lower center", ncols=3, fontsize=8,
                   frameon=False)
    fig.savefig(path, format="png")
    fig.clear()
    return path


# -- HTML ----------------------------------------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em} h2{font-size:1.05em;margin-top:1.4em}
.tag{padding:.1em .5em;border-radius:.3em;font-size:.8em;color:#fff}
.predicted{background:#d97706} .measured{background:#15803d}
table{border-collapse:collapse;font-size:.85em;margin:.4em 0}
th,td{border:1px solid #ccc;padding:.2em .5em;text-align:right}
th:first-child,td:first-child{text-align:left}
td.name{max-width:40em;overflow-wrap:anywhere;font-family:monospace}
caption{caption-side:bottom;text-align:left;font-size:.8em;color:#666}
img{max-width:100%}
"""


def _html_table(headers: list[str] | tuple[str, ...], rows: list[list[str]], caption: str,
                name_column: bool = False) -> str:
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = [f'<td class="name">{e(c)}</td>' if name_column and i == 0 else f"<td>{e(c)}</td>"
                 for i, c in enumerate(row)]
        body.append(f"<tr>{''.join(cells)}</tr>")
    return (f"<table><caption>{e(caption)}</caption><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>")


def _png_bytes(report: ProfileReport, png: Path | None) -> bytes:
    if png is not None:
        return Path(png).read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        return plot_timeline(report, Path(tmp) / "timeline.png").read_bytes()


def write_html(report: ProfileReport, path: Path, png: Path | None = None) -> Path:
    """One self-contained page (inline CSS, the timeline embedded as base64): nothing else to ship."""
    path, e, caption = _prepare(path), html.escape, _caption(report)
    image = base64.b64encode(_png_bytes(report, png)).decode("ascii")
    headers, values = _totals_row(report)
    parts = [
        f"<h1>{e(report.label)} on {e(report.device)} <span class=\"tag {report.tag}\">{report.tag}</span></h1>",
        f"<p>{e(caption[0].upper() + caption[1:])}; {e(_gap_text(report))}.</p>",
        "<h2>Totals</h2>", _html_table(headers, [values], caption),
        f"<h2>Timeline ({report.tag})</h2>",
        f'<img alt="{e(_title(report))} timeline" src="data:image/png;base64,{image}">',
        "<h2>Streams</h2>", _html_table(STREAM_HEADERS, _stream_rows(report), f"{caption}; {STREAM_NOTE}"),
        f"<h2>Kernels ({len(report.kernels)})</h2>",
        _html_table(KERNEL_HEADERS, _kernel_rows(report, None, None), caption, name_column=True),
    ]
    samples = _sample_row(report)
    if samples:
        parts += ["<h2>NVML samples</h2>", _html_table(samples[0], [samples[1]], caption)]
    parts += ["<h2>Recommendations</h2>", "<ul>", *(f"<li>{e(r)}</li>" for r in report.recommendations), "</ul>"]
    page = (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{e(_title(report))}</title>"
            f"<style>{_CSS}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n")
    path.write_text(page, encoding="utf-8")
    return path


# -- everything at once --------------------------------------------------------------------------------------------------

def safe_stem(label: str) -> str:
    """A file name made from a label: letters, digits, '.', '_' and '-' only."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-.") or "profile"


def save_report(report: ProfileReport, out_dir: Path, stem: str | None = None) -> dict[str, Path]:
    """Writes <stem>.trace.json, .png, .html and .json (the summary) into out_dir; returns them by kind."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = stem or safe_stem(report.label)
    paths = {"trace": write_chrome_trace(report, out_dir / f"{stem}.trace.json"),
             "png": plot_timeline(report, out_dir / f"{stem}.png")}
    paths["html"] = write_html(report, out_dir / f"{stem}.html", png=paths["png"])
    paths["json"] = out_dir / f"{stem}.json"
    paths["json"].write_text(json.dumps(summary_dict(report), indent=2, default=str))
    return paths


def summary_text(report: ProfileReport, top: int = 12, per: str = "call") -> str:
    """A few plain lines for a benchmark's log: per-call totals and the kernels that took the most
    time, merged over streams (the same kernel on two streams is one line)."""
    t = report.totals
    calls = max(t["calls"], 1.0)
    lines = [f"{report.label}: {t['kernel_count'] / calls:.0f} kernels per {per}, GPU busy {t['busy_us'] / calls:.0f} µs "
             f"of a {t['span_us'] / calls:.0f} µs span per {per} (idle {100 * t['gap_ratio']:.0f}% of the busy time)"]
    if t.get("waiting_us", 0.0) >= 0.5 * calls:  # programmatic dependent launch (report.own_durations)
        lines.append(f"  kernels below are charged their own time: {t['waiting_us'] / calls:.0f} µs/{per} of their traced "
                     "durations was spent launched early, waiting for the kernel before them on their stream")
    merged: dict[str, list[float]] = {}
    for k in report.kernels:
        entry = merged.setdefault(k.name, [0.0, 0.0])
        entry[0] += k.calls
        entry[1] += k.total_us
    busy = max(t["busy_us"], 1e-9)
    ranked = sorted(merged.items(), key=lambda kv: -kv[1][1])
    for name, (count, total) in ranked[:top]:
        lines.append(f"  {total / calls:9.1f} µs/{per} {100 * total / busy:5.1f}%  {count / calls:6.1f}x  {_short(name, 90)}")
    rest = sum(total for _, (_, total) in ranked[top:])
    if rest:
        lines.append(f"  {rest / calls:9.1f} µs/{per} {100 * rest / busy:5.1f}%          {len(ranked) - top} other kernels")
    return "\n".join(lines)
