#!/usr/bin/env bash
# Create or reuse the virtual environment at .venv/ and install raysd from the pinned constraints.
# Sourced by scripts/serve.sh and scripts/test.sh; safe to run again (it reinstalls only when
# pyproject.toml or constraints.txt changed).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
VENV="$ROOT/.venv"
STAMP="$VENV/.raysd-installed"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ ! -x "$VENV/bin/python" ]; then
  echo "raysd: creating $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
want="$(cat "$ROOT/pyproject.toml" "$ROOT/constraints.txt" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "raysd: installing dependencies into $VENV (first run: a few minutes)" >&2
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c "$ROOT/constraints.txt" \
    "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c "$ROOT/constraints.txt" \
    -e "$ROOT[dev,kernels]" 2>&1 | grep -v "^WARNING: Location" >&2 || true
  "$VENV/bin/python" -c "import raysd, raysd.kernels, torch, transformers, ray, deepspeed, pytest, triton" \
    || { echo "raysd: installation failed (see messages above)" >&2; exit 1; }
  echo "$want" > "$STAMP"
fi
