#!/usr/bin/env bash
# The main job: set up .venv/ (see env.sh), then serve the demo pair with the OpenAI API at
# http://127.0.0.1:8000 (Ctrl-C stops it). Extra arguments go to `raysd serve`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
exec "$VENV/bin/raysd" serve "$@"
