#!/usr/bin/env bash
# Usage: bash scripts/test.sh [pytest args]
# Sets up .venv (reusing it) and runs the test suite on CPU.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
source "$ROOT/scripts/setup_venv.sh"
cd "$ROOT"
exec python -m pytest -q "$@" tests
