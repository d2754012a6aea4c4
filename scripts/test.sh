#!/usr/bin/env bash
# Sets up .venv if needed, then runs the test suite. Without a GPU, generated kernels run in
# Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); GPU tests are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
