#!/usr/bin/env bash
# The test suite, from nothing: sets up .venv/ (see env.sh), checks lint, runs pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
"$VENV/bin/ruff" check .
set +e
"$VENV/bin/python" -m pytest "$@"
status=$?
set -e
# pytest exits 5 when no test was collected: that is a failure of the suite, not a pass.
if [ "$status" -eq 5 ]; then echo "raysd: no tests were collected" >&2; exit 1; fi
exit "$status"
