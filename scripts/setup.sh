#!/usr/bin/env bash
# Creates .venv (if missing) and installs streamfuse with what it needs, on a machine with or
# without a GPU. Where no torch is installed yet, the CPU build of torch 2.13.0 is used.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
V=.venv/bin/python
stamp=.venv/.streamfuse-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
"$V" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$V" -c "import torch" >/dev/null 2>&1; then
  "$V" -m pip install -q "torch==2.13.0"
fi
# triton 3.6.0 (its interpreter runs the generated kernels on CPU; it needs numpy < 2.3)
"$V" -m pip install -q "triton==3.6.0" "numpy<2.3"
"$V" -m pip install -q -e ".[test]" matplotlib nvidia-ml-py
echo "$want" > "$stamp"
