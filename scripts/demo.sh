#!/usr/bin/env bash
# Sets up .venv if needed, then runs `streamfuse demo` (extra arguments are passed on).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/streamfuse demo "$@"
