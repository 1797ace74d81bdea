#!/usr/bin/env bash
# Usage: ACCOUNT=myproj PARTITION=prod bash examples/slurm/submit_all.sh [--dry-run]
# Submits every experiment of the paper with the node count each needs:
#   throughput and end-to-end for 3B 7B 13B 30B 70B (DP 1), DP scaling for 13B and 30B (DP 1..16).
# --dry-run prints the sbatch commands instead of submitting. Results: $RESULTS_DIR/results.csv.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export REPO
source "$REPO/examples/slurm/common.sh"
: "${ACCOUNT:?set ACCOUNT to your Slurm account}"
: "${PARTITION:?set PARTITION to the GPU partition}"
SUBMIT=(sbatch --account "$ACCOUNT" --partition "$PARTITION" --chdir "$REPO")
if [ "${1:-}" = "--dry-run" ]; then SUBMIT=(echo "${SUBMIT[@]}"); fi

for model in 3B 7B 13B 30B 70B; do
  set_model "$model"
  "${SUBMIT[@]}" --nodes "$MODEL_NODES" "$REPO/examples/slurm/throughput.sbatch" "$model"
  "${SUBMIT[@]}" --nodes "$MODEL_NODES" "$REPO/examples/slurm/end_to_end.sbatch" "$model"
done
for model in 13B 30B; do
  set_model "$model"
  for dp in 1 2 4 8 16; do
    "${SUBMIT[@]}" --nodes $((MODEL_NODES * dp)) "$REPO/examples/slurm/dp_scaling.sbatch" "$model" "$dp"
  done
done
