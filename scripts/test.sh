#!/usr/bin/env bash
# Usage: bash scripts/test.sh [pytest args]
# Sets up .venv (reusing it) and runs the test suite on CPU.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
source "$ROOT/scripts/setup_venv.sh"
cd "$ROOT"
# The 20 slowest tests are listed at the end: the suite's time budget is 20 minutes. Its files
# run on TEST_WORKERS processes (pytest-xdist; default 2, one per core of our machines; 0 runs
# them in this process): most tests wait on launched ranks, so two files side by side take ~30%
# less time than one after the other. A file's tests stay together, in order, on one worker;
# the files go heaviest first (tests/conftest.py's HEAVY_FIRST), so none is left running alone
# at the end.
exec python -m pytest -q --durations=20 -n "${TEST_WORKERS:-2}" --dist loadfile \
    --no-loadscope-reorder "$@" tests
