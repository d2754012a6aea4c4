#!/usr/bin/env bash
# torchvision's models on this CPU machine, for looking at plans (not for CI): the registry's wheel
# is a CUDA build whose operator registrations fail to load with the CPU torch, but the model code
# is plain Python. Unpacks the wheel into DIR (default /tmp/tvx) with its meta registrations
# stubbed out and prints the PYTHONPATH to use, e.g.
#   PYTHONPATH=$(bash scripts/cpu_torchvision.sh) .venv/bin/python -c "import torchvision.models as m; ..."
# torchvision.ops (nms, roi_align) do not work this way; the classification models do.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-/tmp/tvx}"
if [ ! -f "$dir/torchvision/__init__.py" ]; then
  tmp=$(mktemp -d)
  .venv/bin/pip download -q --no-deps -d "$tmp" torchvision >&2
  mkdir -p "$dir"
  (cd "$dir" && unzip -q -o "$tmp"/torchvision-*.whl)
  rm -rf "$tmp"
  echo "" > "$dir/torchvision/_meta_registrations.py"
fi
echo "$dir"
