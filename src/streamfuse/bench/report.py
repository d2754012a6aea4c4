"""The bench table (rich) and bar chart (matplotlib) of a suite's results."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape
from rich.table import Table

from streamfuse.bench.runner import SF_MODES, ModeResult, WorkloadResult, geomean_vs


def bench_table(results: list[WorkloadResult], modes: list[str], title: str) -> Table:
    table = Table(title=title)
    table.add_column("workload", no_wrap=True)
    for m in modes:
        table.add_column(f"{m} µs", justify="right")
    for col in ("streamfuse vs best other", "sf kernels/call", "sf gap ratio", "sf compile s"):
        table.add_column(col, justify="right")
    for r in results:
        cells = []
        for m in modes:
            res = r.modes.get(m)
            cells.append("-" if res is None else ("[red]failed[/]" if res.us is None else f"{res.us:.1f}"))
        sf = r.modes.get("streamfuse")
        ratio, best = r.streamfuse_ratio(), r.best_other()
        ratio_cell = "-" if ratio is None else (f"[{'green' if ratio >= 1 else 'yellow'}]{ratio:.2f}x[/] "
                                                f"({best[0] if best else '-'})")
        cells += [
            ratio_cell,
            "-" if sf is None or sf.kernels_per_call is None else f"{sf.kernels_per_call:.0f}",
            "-" if sf is None or sf.gap_ratio is None else f"{100 * sf.gap_ratio:.1f}%",
            "-" if sf is None or sf.compile_s is None else f"{sf.compile_s:.1f}",
        ]
        table.add_row(r.workload, *cells)
    return table


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"[{'green' if value >= 1 else 'yellow'}]{value:.2f}x[/]"


def _time(res: ModeResult | None) -> str:
    if res is None:
        return "-"
    if res.us is not None:
        return f"{res.us:.1f}"
    return "[dim]n/a[/]" if res.error in ("needs CUDA",) or (res.error or "").startswith("workload unavailable") \
        else "[red]failed[/]"


def models_table(results: list[WorkloadResult], modes: list[str], title: str) -> Table:
    """The models suite's times: one row per workload, every mode's µs, and the two streamfuse ratios
    against torch.compile mode="reduce-overhead" (its time / theirs: above 1 is faster)."""
    table = Table(title=title)
    table.add_column("workload", no_wrap=True)
    for m in modes:
        table.add_column(f"{m} µs", justify="right")
    table.add_column("streamfuse vs reduce-overhead", justify="right")
    table.add_column("backend vs reduce-overhead", justify="right")
    for r in results:
        table.add_row(r.workload, *[_time(r.modes.get(m)) for m in modes],
                      _ratio(r.ratio("streamfuse", "compile-ro")), _ratio(r.ratio("sf-backend", "compile-ro")))
    sf, backend = geomean_vs(results, "streamfuse"), geomean_vs(results, "sf-backend")
    for kind in sorted(set(sf) | set(backend)):
        cell = lambda g: "-" if g is None else f"{_ratio(g[0])} ({g[1]})"  # noqa: E731
        table.add_row(f"geometric mean, {kind}", *[""] * len(modes), cell(sf.get(kind)), cell(backend.get(kind)),
                      style="bold", end_section=False)
    return table


def streamfuse_table(results: list[WorkloadResult], title: str) -> Table:
    """One row per workload and streamfuse mode: check, second-batch check, kernels, compile times."""
    table = Table(title=title)
    table.add_column("workload", no_wrap=True)
    table.add_column("mode", no_wrap=True)
    for col in ("max rel err", "tolerance", "err at 2nd batch", "kernels/call", "cold compile s", "warm compile s"):
        table.add_column(col, justify="right")
    table.add_column("status")
    for r in results:
        for mode in SF_MODES:
            res = r.modes.get(mode)
            if res is None or (res.error or "").startswith("workload unavailable"):
                continue
            tol = r.tolerance
            ok = res.error is None and res.second_error is None and res.fallback is None
            err = "-" if res.max_rel_err is None else (
                f"[{'green' if tol is None or res.max_rel_err <= tol else 'red'}]{res.max_rel_err:.1e}[/]")
            second = ("-" if res.second_batch is None else
                      f"b{res.second_batch}: " + ("[red]failed[/]" if res.second_rel_err is None else
                                                  f"{res.second_rel_err:.1e}"))
            kernels = (f"{res.kernels_per_call:.0f}" if res.kernels_per_call is not None else
                       "-" if res.planned_kernels is None else f"{res.planned_kernels} (plan)")
            problems = "; ".join(filter(None, [res.error, res.second_error,
                                                 res.fallback and f"fell back: {res.fallback}"]))
            status = "[green]ok[/]" if ok else f"[red]{escape(problems[:90])}[/]"
            if ok and res.f32_rel_err is not None and res.eager_f32_rel_err is not None:
                status = (f"[green]ok[/]: from float32 {res.f32_rel_err:.1e}, eager "  # judged on float32 (runner.judge)
                          f"{res.eager_f32_rel_err:.1e}")
            table.add_row(r.workload, mode, err, "-" if tol is None else f"{tol:.0e}", second, kernels,
                          _seconds(res.compile_s, res.dynamo_s), _seconds(res.compile_warm_s, res.dynamo_warm_s), status)
    return table


def _seconds(total: float | None, dynamo: float | None) -> str:
    """A compile time, with torch.compile's own frame compilation (Dynamo and AOTAutograd) beside it."""
    if total is None:
        return "-"
    return f"{total:.1f}" if dynamo is None else f"{total:.1f} ({dynamo:.1f} Dynamo)"


def failures(results: list[WorkloadResult]) -> list[str]:
    lines = [f"{r.workload} / {m}: {res.error}" for r in results for m, res in r.modes.items() if res.error]
    lines += [f"{r.workload} / {m} (extra checks): {res.second_error}"
              for r in results for m, res in r.modes.items() if res.second_error]
    return lines + [f"{r.workload} / {m} fell back (eagerly or through the backend, in part or whole): {res.fallback}"
                    for r in results for m, res in r.modes.items() if res.fallback]


def bar_chart(results: list[WorkloadResult], modes: list[str], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(min(max(8.0, 1.1 * len(results) + 3), 60.0), 5), dpi=110)
    width = 0.8 / max(len(modes), 1)
    for j, mode in enumerate(modes):
        xs, ys = [], []
        for i, r in enumerate(results):
            res = r.modes.get(mode)
            if res is not None and res.us is not None:
                xs.append(i + (j - (len(modes) - 1) / 2) * width)
                ys.append(res.us)
        ax.bar(xs, ys, width=width, label=mode)
    ax.set_yscale("log")
    ax.set_ylabel("µs per call (log scale, lower is better)")
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels([r.workload for r in results], rotation=35, ha="right", fontsize=8)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def row_summary(row: WorkloadResult) -> str:
    """One line for a finished workload: each mode's µs (or why it has none), the speed-up of the
    streamfuse modes over reduce-overhead where both ran, and streamfuse's check."""
    parts = []
    for mode, r in row.modes.items():
        if r.us is not None:
            ratio = row.ratio(mode, "compile-ro") if mode in SF_MODES else None
            spread = "" if r.us_spread is None else f" ±{50 * r.us_spread:.0f}%"
            parts.append(f"{mode} {r.us:.1f} µs{spread}" + (f" ({ratio:.2f}x reduce-overhead)" if ratio else ""))
        else:
            parts.append(f"{mode} -" + (f" ({r.error[:60]})" if r.error else ""))
    check = row.modes.get("streamfuse")
    if check is not None and check.max_rel_err is not None:
        parts.append(f"max rel err {check.max_rel_err:.1e}")
    return f"{row.workload}: " + ", ".join(parts)
