#!/usr/bin/env bash
# The device-machine check in one call (docs/PERF.md): GPU test suite, then the benchmarks whose
# numbers the issues ask for. Results and logs go under $OUT (default ./gpu-check).
#   run on the device:  bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-check}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
step() {  # name, time limit in seconds, command...
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "   exit $? ($(wc -l < "$OUT/$name.txt") lines in $OUT/$name.txt)"
}
step tests 200 python3 -m pytest -q -n 16 -W ignore -p no:logging --tb=line tests
step epilogue 200 python3 benchmarks/epilogue.py --out "$OUT/epilogue"
step streams 150 python3 benchmarks/streams_graphs.py --out "$OUT/streams"
step bench 150 streamfuse bench --out "$OUT/bench"
tail -4 "$OUT/tests.txt"
grep -E "^Linear|^conv|^32|auto_vs|folded_vs|packed_vs" "$OUT/epilogue.txt"
grep -E "vs 1 stream|host time|demo" "$OUT/streams.txt"
