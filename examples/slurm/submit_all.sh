#!/usr/bin/env bash
# Usage: [ACCOUNT=myproj] [PARTITION=gpu] [QOS=q] [TIME=HH:MM:SS] [GPUS_PER_NODE=4] \
#          bash examples/slurm/submit_all.sh [--dry-run] [MODEL...]
# Submits every experiment of the paper with the node count each needs (from the layout knobs of
# common.sh: TP, PP, GPUS_PER_NODE, ...):
#   throughput and end-to-end for 3B 7B 13B 30B 70B (DP 1), DP scaling for 13B and 30B (DP 1..16);
#   MODEL... restricts the list (e.g. `tiny` on a CPU cluster, with GPUS_PER_NODE=0).
# Each job asks for --gpus-per-node=$GPUS_PER_NODE and, unless TIME is set, the time limit
# tools/project_scale.py projects for it (paper models) plus a margin; the scripts' own limit
# otherwise. A refused submission is reported and the others still go; the exit status is 1 if any
# was refused. --dry-run prints the sbatch commands instead. Results: $RESULTS_DIR/results.csv.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export REPO
source "$REPO/examples/slurm/common.sh"

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
MODELS=("$@")
[ ${#MODELS[@]} -gt 0 ] || MODELS=(3B 7B 13B 30B 70B)
SUBMIT=(sbatch --chdir "$REPO" --gpus-per-node="$GPUS_PER_NODE"
        ${ACCOUNT:+--account "$ACCOUNT"} ${PARTITION:+--partition "$PARTITION"} ${QOS:+--qos "$QOS"})
refused=()

# projected_time EXPERIMENT MODEL DP: a --time for the job, or nothing (the script's default).
projected_time() {
  [ -n "${TIME:-}" ] && { echo "--time=$TIME"; return; }
  local experiment=throughput limit
  [ "$1" = end_to_end ] && experiment=e2e
  # shellcheck disable=SC2086  # SAVE_INTERVALS is a list
  [ "$GPUS_PER_NODE" -gt 0 ] || return 0  # the projection is of GPU nodes
  limit="$("$PYTHON" "$REPO/tools/project_scale.py" --slurm-time --experiment "$experiment" --models "$2" \
           --dp "$3" --gpus-per-node "$GPUS_PER_NODE" ${ITERATIONS:+--iterations "$ITERATIONS"} ${SAVE_INTERVALS:+--checkpoint-interval $SAVE_INTERVALS} \
           --variants "${VARIANTS[@]}" --persistent-every "$PERSISTENT_EVERY" \
           2>/dev/null | sed -n 's/^slurm time limit: //p')"
  [ -n "$limit" ] && echo "--time=$limit"
}

# submit SCRIPT MODEL [DP]
submit() {
  local script="$1" model="$2" dp="${3:-1}" time out
  if ! out="$( (set_model "$model" && set_layout "$dp") 2>&1 >/dev/null)"; then  # die exits the subshell only
    echo "refused: $script $model${3:+ dp$dp}: $out" >&2
    refused+=("$script $model${3:+ dp$dp}: $out")
    return
  fi
  set_model "$model"; set_layout "$dp"
  time="$(projected_time "${script%.sbatch}" "$model" "$dp")"
  local cmd=("${SUBMIT[@]}" --nodes "$NODES" ${time:+"$time"} "$REPO/examples/slurm/$script" "$model" ${3:+"$dp"})
  if [ "$DRY" = 1 ]; then echo "${cmd[*]}"; return; fi
  if out="$("${cmd[@]}" 2>&1)"; then
    echo "$out ($script $model${3:+ dp$dp}, $NODES nodes${time:+, $time})"
  else
    echo "refused: $script $model${3:+ dp$dp}: $out" >&2
    refused+=("$script $model${3:+ dp$dp}: $out")
  fi
}

for model in "${MODELS[@]}"; do
  submit throughput.sbatch "$model"
  submit end_to_end.sbatch "$model"
done
for model in "${MODELS[@]}"; do
  case "$model" in 13B|30B) ;; *) continue ;; esac
  for dp in 1 2 4 8 16; do submit dp_scaling.sbatch "$model" "$dp"; done
done
if [ ${#refused[@]} -gt 0 ]; then
  echo "${#refused[@]} submission(s) refused:" >&2
  printf '  %s\n' "${refused[@]}" >&2
  exit 1
fi
