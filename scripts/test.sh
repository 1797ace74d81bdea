#!/usr/bin/env bash
# Usage: bash scripts/test.sh [pytest args]
# Sets up .venv (reusing it) and runs the test suite on CPU.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
source "$ROOT/scripts/setup_venv.sh"
cd "$ROOT"
# The 20 slowest tests are listed at the end: the suite's time budget is 20 minutes.
exec python -m pytest -q --durations=20 "$@" tests
