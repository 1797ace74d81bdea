#!/usr/bin/env bash
# Usage: bash scripts/quickstart.sh [OUT_DIR]
# The main job on a fresh CPU machine: set up .venv (reused if present), train a tiny GPT on two
# gloo ranks (data parallel, distributed optimizer) with DataStates --async-lazy-save checkpoints
# every 2 iterations, stop at iteration 20, resume from the newest committed checkpoint to 40, and
# draw the checkpoint timeline (if matplotlib is installed).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
source "$ROOT/scripts/setup_venv.sh"
OUT="${1:-$ROOT/runs/quickstart}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
LAZY_ARGS=(
  --async-lazy-save --save-interval 2 --keep-last-n-checkpoints 3 --use-distributed-optimizer
)
bash "$ROOT/examples/train_tiny_cpu.sh" "$OUT" 2 "${LAZY_ARGS[@]}"
echo "== checkpoints kept under $OUT: $(cd "$OUT" && ls -d iter_* | tr '\n' ' ')"
if python -c "import matplotlib" 2>/dev/null; then
  python "$ROOT/tools/plot_checkpoint_timeline.py" "$OUT/datastates_checkpoints.jsonl" \
    -o "$OUT/checkpoint_timeline.png"
fi
