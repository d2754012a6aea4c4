"""The bench table (rich) and bar chart (matplotlib) of a suite's results."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from streamfuse.bench.runner import WorkloadResult


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


def failures(results: list[WorkloadResult]) -> list[str]:
    return [f"{r.workload} / {m}: {res.error}" for r in results for m, res in r.modes.items() if res.error]


def bar_chart(results: list[WorkloadResult], modes: list[str], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8.0, 1.1 * len(results) + 3), 5), dpi=110)
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
