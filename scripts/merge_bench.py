"""Merge one run's `streamfuse bench --suite models` rows into docs/bench/models.json, the suite's
table across runs (each row keeps the label of the run that measured it; a model measured again
replaces its row), and recompute the geometric means of the same-run ratios per batch kind.

    python scripts/merge_bench.py "run 83" DIR/bench.json ["what the run measured"]
"""

from __future__ import annotations

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
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
