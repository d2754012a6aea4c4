"""Merge one run's `streamfuse bench --suite models` rows into docs/bench/models.json, the suite's
table across runs (each row keeps the label of the run that measured it; a model measured again
replaces its row), recompute the geometric means of the same-run ratios per batch kind, and render
the merged rows as docs/bench/models.txt (the suite's two tables, each row's run named) and
docs/bench/models.png (its chart). Every ratio in them is between modes of one run.

    python scripts/merge_bench.py "run 83" DIR/bench.json ["what the run measured"]
    python scripts/merge_bench.py --render
"""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "bench" / "models.json"
RATIOS = {"streamfuse_vs_reduce_overhead": "streamfuse_vs_reduce_overhead",
          "sf-backend_vs_reduce_overhead": "backend_vs_reduce_overhead"}


def geomeans(rows: list[dict]) -> dict[str, dict[str, dict[str, float | int]]]:
    out: dict[str, dict[str, dict[str, float | int]]] = {}
    for name, key in RATIOS.items():
        by_kind: dict[str, list[float]] = {}
        for r in rows:
            ratio = r.get(key)
            if ratio:
                by_kind.setdefault(str(r.get("info", {}).get("batch_kind", "all")), []).append(ratio)
        out[name] = {kind: {"geomean": math.exp(sum(map(math.log, v)) / len(v)), "workloads": len(v)}
                     for kind, v in by_kind.items()}
    return out


def main(label: str, path: str, desc: str | None = None) -> int:
    doc = json.loads(DOC.read_text())
    new = json.loads(Path(path).read_text())
    names = [r["workload"] for r in doc["rows"]]
    for r in new["rows"]:
        if not any(m.get("us") for m in r["modes"].values()):
            continue  # nothing timed (a chunk cut short)
        r["run"] = label
        if r["workload"] in names:
            doc["rows"][names.index(r["workload"])] = r
        else:
            doc["rows"].append(r)
            names.append(r["workload"])
    doc["settings"]["runs"][label] = dict(new.get("settings", {}), **({"models": desc} if desc else {}))
    doc["date"] = new["date"]
    doc["geomeans"] = geomeans(doc["rows"])
    DOC.write_text(json.dumps(doc, indent=1))
    print(f"{len(doc['rows'])} rows; geometric means: {json.dumps(doc['geomeans'])}")
    render(doc)
    return 0


def render(doc: dict) -> None:
    """models.txt and models.png beside models.json, from its rows (the suite's own table and chart)."""
    from dataclasses import fields

    from rich.console import Console

    sys.path.insert(0, str(DOC.parents[2] / "src"))
    from streamfuse.bench.report import bar_chart, models_table, streamfuse_table
    from streamfuse.bench.runner import ModeResult, WorkloadResult

    known = {f.name for f in fields(ModeResult)}
    results = [WorkloadResult(f"{r['workload']} ({r.get('run', '?')})",
                              {m: ModeResult(**{k: v for k, v in res.items() if k in known})
                               for m, res in r["modes"].items()},
                              info=r.get("info", {}), tolerance=r.get("tolerance")) for r in doc["rows"]]
    order = ["eager", "eager+graph", "compile", "compile-ro", "streamfuse", "sf-backend"]
    modes = [m for m in order if any(m in r.modes for r in results)]
    title = f"streamfuse bench (models), rows merged across runs on {doc.get('card', '?')} (each row's run in brackets)"
    console = Console(record=True, width=220, force_terminal=False, file=io.StringIO())
    console.print(models_table(results, modes, title))
    console.print(streamfuse_table(results, "streamfuse modes: checks (TF32 off) and compile times"))
    DOC.with_suffix(".txt").write_text(console.export_text())
    bar_chart(results, modes, DOC.with_suffix(".png"), title)
    print(f"wrote {DOC.with_suffix('.txt')} and {DOC.with_suffix('.png')}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--render"]:  # the table and chart of models.json as it is
        render(json.loads(DOC.read_text()))
        sys.exit(0)
    sys.exit(main(*sys.argv[1:4]))
