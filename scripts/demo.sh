#!/usr/bin/env bash
# The main job on a fresh machine: set up .venv/, then decode held-out code/JSON/prose prompts on the
# shipped demo pair with speculation off and adaptive, and show acceptance and speed per workload.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
exec "$VENV/bin/raysd" demo run "$@"
