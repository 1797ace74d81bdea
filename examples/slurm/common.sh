#!/usr/bin/env bash
# Shared part of the Slurm experiments; sourced by the *.sbatch scripts and submit_all.sh, never run
# directly. Every knob is an environment variable (sbatch passes the submitting shell's environment
# on); the defaults are the paper's (Polaris: 4 A100s per node, TP=4, one pipeline stage per node).
#
# Where things are:
#   REPO           repository root on the shared file system (default: the sbatch submit directory)
#   SETUP_FILE     sourced first, on the job's first node: `module load ...`, `conda activate ...`,
#                  site NCCL settings (default: none); srun passes the environment it sets on
#   PYTHON         python with torch and megatron-core (default: $REPO/.venv/bin/python if present,
#                  else python3 from PATH after SETUP_FILE); PYTHONPATH gets $REPO first
#   CKPT_ROOT      checkpoints, on the parallel file system (default: $REPO/checkpoints/slurm)
#   RESULTS_DIR    logs and results.csv (default: $REPO/runs/slurm)
#   DATA_PATH      megatron --data-path prefix (default: empty, --mock-data with the model's vocabulary:
#                  Llama's 32000 for the paper's models)
# Layout (MODEL and DP are the scripts' arguments; models: python tools/models.py):
#   GPUS_PER_NODE  GPUs per node (default: sbatch's --gpus-per-node, else 4); 0 on a CPU cluster
#                  (then submit with --gpus-per-node=0)
#   NPROC_PER_NODE ranks per node at most (default: GPUS_PER_NODE, or 1 without GPUs)
#   TP, PP         tensor- and pipeline-parallel sizes (default: the model's, 4 and its paper nodes)
#   MICRO_BATCH    micro-batch size (default 16); GLOBAL_BATCH (default: MICRO_BATCH x DP)
#   SEQ_LENGTH     (default: the model's, 2048); PRECISION bf16 (default) or fp32
#   ITERATIONS, SAVE_INTERVALS   iterations and the save intervals to run (default: the experiment's)
# Checkpointing:
#   LAZY_CACHE_MB  --lazy-save-cache-mb (default: the largest rank's checkpoint, from tools/dry_run.py,
#                  so a whole snapshot fits in host memory)
#   ONLY_VARIANTS  a subset of: torch torch_dist torch_dist_async datastates_lazy (default: these
#                  four, the paper's), or datastates_memory (beyond the paper, only when named: an
#                  in-memory version at the run's save interval in /dev/shm of each node, and a
#                  persistent one to --save every PERSISTENT_EVERY of them, default 10)
#   KEEP_CHECKPOINTS=1   keep each run's checkpoints (default: deleted after the run; they are TBs)
# Launch:
#   MASTER_PORT    rendezvous port on the first node (default 29500)
#   EXTRA_ARGS     more pretrain_gpt.py flags, appended last (word-split)
#   DRY_RUN=1      no srun: tools/dry_run.py checks each run's arguments, on any CPU machine:
#                  DRY_RUN=1 SLURM_JOB_NUM_NODES=2 bash examples/slurm/throughput.sbatch 7B
# Job settings (account, partition, QOS, time limit, nodes, GPUs per node) are sbatch options: give
# them to sbatch, or to submit_all.sh as ACCOUNT, PARTITION, QOS, TIME and GPUS_PER_NODE.

die() { echo "error: $*" >&2; exit 2; }

REPO="${REPO:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}}"
[ -f "$REPO/pretrain_gpt.py" ] || die "REPO=$REPO is not the repository root (no pretrain_gpt.py); set REPO"
if [ -n "${SETUP_FILE:-}" ]; then
  [ -f "$SETUP_FILE" ] || die "SETUP_FILE=$SETUP_FILE does not exist"
  # shellcheck disable=SC1090  # the site's file
  source "$SETUP_FILE"
fi
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON="$(command -v python3 || true)"; fi
fi
[ -n "$PYTHON" ] || die "no python found; set PYTHON or SETUP_FILE"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, whatever the venv has installed
CKPT_ROOT="${CKPT_ROOT:-$REPO/checkpoints/slurm}"
RESULTS_DIR="${RESULTS_DIR:-$REPO/runs/slurm}"
DATA_PATH="${DATA_PATH:-}"
MASTER_PORT="${MASTER_PORT:-29500}"
EXTRA_ARGS="${EXTRA_ARGS:-}"
JOB_ID="${SLURM_JOB_ID:-dryrun}"
# sbatch --gpus-per-node=N sets SLURM_GPUS_PER_NODE, possibly with a type ("a100:4").
GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_PER_NODE:-4}}"
GPUS_PER_NODE="${GPUS_PER_NODE##*:}"
if [ "$GPUS_PER_NODE" -gt 0 ]; then NPROC_PER_NODE="${NPROC_PER_NODE:-$GPUS_PER_NODE}"; else NPROC_PER_NODE="${NPROC_PER_NODE:-1}"; fi

# megatron-core orders its tensor-parallel communication on one CUDA stream queue (Megatron-LM's
# examples set it); a rank whose NCCL call fails must abort instead of hanging the job. Site
# settings (SETUP_FILE or the environment) win.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"

ALL_VARIANTS=(torch torch_dist torch_dist_async datastates_lazy)
KNOWN_VARIANTS=("${ALL_VARIANTS[@]}" datastates_memory)
PERSISTENT_EVERY="${PERSISTENT_EVERY:-10}"  # datastates_memory: in-memory versions per --save one
# shellcheck disable=SC2206  # ONLY_VARIANTS is a space-separated subset
VARIANTS=(${ONLY_VARIANTS:-${ALL_VARIANTS[*]}})

# set_model NAME: the model's shape and default layout from tools/models.py (MODEL_* variables),
# then the run's layout (RUN_*): the knobs where set, else the model's.
set_model() {
  local table
  table="$("$PYTHON" "$REPO/tools/models.py" --shell "$1")" || die "unknown model '$1' (python tools/models.py lists them)"
  eval "$table"
  MODEL="$1"
  RUN_TP="${TP:-$MODEL_TP}" RUN_PP="${PP:-$MODEL_PP}" RUN_SEQ="${SEQ_LENGTH:-$MODEL_SEQ_LENGTH}"
  RUN_MICRO="${MICRO_BATCH:-16}"
  MODEL_EXTRA=()
  # The model's uneven pipeline split applies only at its own pipeline size.
  if [ "$RUN_PP" = "$MODEL_PP" ] && [ -n "$MODEL_FIRST_STAGE_LAYERS" ]; then
    MODEL_EXTRA=(--decoder-first-pipeline-num-layers "$MODEL_FIRST_STAGE_LAYERS"
                 --decoder-last-pipeline-num-layers "$MODEL_LAST_STAGE_LAYERS")
  fi
}

# set_layout DP: WORLD ranks on NODES nodes of NPROC ranks each; a TP group stays on one node.
set_layout() {
  local dp="$1"
  WORLD=$((RUN_TP * RUN_PP * dp))
  NODES=$(( (WORLD + NPROC_PER_NODE - 1) / NPROC_PER_NODE ))
  NPROC=$((WORLD / NODES))
  [ $((NPROC * NODES)) -eq "$WORLD" ] && [ $((NPROC % RUN_TP)) -eq 0 ] || die "$MODEL at TP=$RUN_TP x PP=$RUN_PP x DP=$dp ($WORLD ranks) does not fill nodes of $NPROC_PER_NODE ranks with whole TP groups; change GPUS_PER_NODE/NPROC_PER_NODE, TP, PP or DP"
  RUN_GLOBAL="${GLOBAL_BATCH:-$((RUN_MICRO * dp))}"
}

# variant_args VARIANT: checkpoint-format arguments of one variant of the paper's comparison.
variant_args() {
  case "$1" in
    torch)            VARIANT_ARGS=(--ckpt-format torch) ;;
    torch_dist)       VARIANT_ARGS=(--ckpt-format torch_dist) ;;
    torch_dist_async) VARIANT_ARGS=(--ckpt-format torch_dist --async-save) ;;
    datastates_lazy)  VARIANT_ARGS=(--async-lazy-save ${LAZY_CACHE_MB:+--lazy-save-cache-mb "$LAZY_CACHE_MB"}) ;;
    datastates_memory)
      [[ "$PERSISTENT_EVERY" =~ ^[0-9]+$ ]] && [ "$PERSISTENT_EVERY" -ge 2 ] || die "PERSISTENT_EVERY must be an integer >= 2 (in-memory versions per persistent one), got '$PERSISTENT_EVERY'"
      VARIANT_ARGS=(--async-lazy-save ${LAZY_CACHE_MB:+--lazy-save-cache-mb "$LAZY_CACHE_MB"}
                    --non-persistent-ckpt-type in_memory) ;;
    *) die "unknown variant '$1'; expected one of ${KNOWN_VARIANTS[*]}" ;;
  esac
}

# save_args VARIANT INTERVAL CKPT_DIR: the save flags of one run (SAVE_ARGS). datastates_memory
# saves in memory every INTERVAL iterations and to --save every PERSISTENT_EVERY x INTERVAL
# (Megatron-LM's non-persistent flags; at an iteration where both fall due --save takes it).
save_args() {
  if [ "$1" = datastates_memory ]; then
    SAVE_ARGS=(--save "$3" --save-interval "$(($2 * $PERSISTENT_EVERY))" --non-persistent-save-interval "$2")
  else
    SAVE_ARGS=(--save "$3" --save-interval "$2")
  fi
}

# build_args MODEL DP ITERATIONS SAVE_INTERVAL VARIANT CKPT_DIR: fills ARGS for pretrain_gpt.py.
build_args() {
  local model="$1" dp="$2" iters="$3" interval="$4" variant="$5" ckpt_dir="$6"
  set_model "$model"
  set_layout "$dp"
  variant_args "$variant"
  MODEL_ARGS=(
    "${MODEL_ARCH_ARGS[@]}"  # shape and family (Llama flags for the paper's models): tools/models.py
    --seq-length "$RUN_SEQ" --max-position-embeddings "$RUN_SEQ"
    "${MODEL_EXTRA[@]}"
  )
  PARALLEL_ARGS=(
    --tensor-model-parallel-size "$RUN_TP" --pipeline-model-parallel-size "$RUN_PP"
    --use-distributed-optimizer  # ZeRO-1, as the paper's DeepSpeed runs
  )
  # What makes the model fit a 40 GB GPU (docs/SCALE.md); sequence parallelism needs TP > 1.
  MEMORY_ARGS=("${MODEL_RECOMPUTE_ARGS[@]}")
  if [ -n "$MODEL_SEQUENCE_PARALLEL" ] && [ "$RUN_TP" -gt 1 ]; then MEMORY_ARGS=(--sequence-parallel "${MEMORY_ARGS[@]}"); fi
  TRAINING_ARGS=(
    --micro-batch-size "$RUN_MICRO" --global-batch-size "$RUN_GLOBAL"
    --train-iters "$iters" --seed 1234
    --lr 1.0e-4 --min-lr 1.0e-5 --lr-decay-style cosine --lr-warmup-iters 0
    --weight-decay 0.1 --clip-grad 1.0
  )
  case "${PRECISION:-bf16}" in
    bf16) TRAINING_ARGS+=(--bf16) ;;
    fp32) ;;
    *) die "PRECISION must be bf16 or fp32, got '$PRECISION'" ;;
  esac
  if [ -n "$DATA_PATH" ]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --split 98,2,0 --tokenizer-type ByteLevelTokenizer)
  else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "$MODEL_VOCAB")
  fi
  save_args "$variant" "$interval" "$ckpt_dir"
  CHECKPOINT_ARGS=("${SAVE_ARGS[@]}" "${VARIANT_ARGS[@]}")
  LOGGING_ARGS=(--log-interval 1 --eval-interval "$((iters + 1))" --eval-iters 0)
  # shellcheck disable=SC2206  # EXTRA_ARGS is meant to be word-split
  ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${MEMORY_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}"
        "${CHECKPOINT_ARGS[@]}" "${LOGGING_ARGS[@]}" $EXTRA_ARGS)
}

# check_nodes: the allocation must match the layout exactly (sbatch -N NODES).
check_nodes() {
  local have="${SLURM_JOB_NUM_NODES:-0}"
  [ "$have" -eq "$NODES" ] || die "this run needs $NODES nodes ($WORLD ranks: TP=$RUN_TP x PP=$RUN_PP x DP, $NPROC per node), the job has $have; submit with sbatch -N $NODES"
}

# size_lazy_cache MODEL DP ITERATIONS: LAZY_CACHE_MB from the dry run of the lazy variant's launch
# (a bad launch fails here, before any allocation time is spent on srun).
size_lazy_cache() {
  [ -n "${LAZY_CACHE_MB:-}" ] && return
  [[ " ${VARIANTS[*]} " == *" datastates_lazy "* || " ${VARIANTS[*]} " == *" datastates_memory "* ]] || return 0
  build_args "$1" "$2" "$3" 1 datastates_lazy "$CKPT_ROOT/sizing"
  local out
  out="$("$PYTHON" "$REPO/tools/dry_run.py" --world-size "$WORLD" --lazy-cache-mb -- "${ARGS[@]}")" || die "tools/dry_run.py refused the launch: ${ARGS[*]}"
  LAZY_CACHE_MB="$(sed -n 's/^lazy cache per rank (MiB): //p' <<<"$out")"
  echo "lazy cache per rank: $LAZY_CACHE_MB MiB (the largest rank's checkpoint; set LAZY_CACHE_MB to override)"
}

# launch TAG: one torchrun per node via srun, rendezvous on the first node; log to RESULTS_DIR/TAG.log.
launch() {
  local tag="$1" log="$RESULTS_DIR/$1.log" start end
  mkdir -p "$RESULTS_DIR"
  if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "== dry run: $tag"
    "$PYTHON" "$REPO/tools/dry_run.py" --world-size "$WORLD" --ranks-per-node "$NPROC" -- "${ARGS[@]}"
    return
  fi
  MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
  export MASTER_ADDR MASTER_PORT
  LAUNCH_ARGS=(
    --nnodes "$NODES" --nproc-per-node "$NPROC"
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$JOB_ID-$tag"
  )
  SRUN_ARGS=(--nodes "$NODES" --ntasks-per-node=1 --kill-on-bad-exit=1
             ${SLURM_CPUS_ON_NODE:+--cpus-per-task="$SLURM_CPUS_ON_NODE"})  # the ranks share the node's CPUs
  echo "[$(date -u +%FT%TZ)] $tag: $NODES nodes x $NPROC ranks, args: ${ARGS[*]}" | tee "$log"
  start=$(date +%s.%N)
  srun "${SRUN_ARGS[@]}" "$PYTHON" -m torch.distributed.run "${LAUNCH_ARGS[@]}" "$REPO/pretrain_gpt.py" "${ARGS[@]}" >>"$log" 2>&1
  local rc=$?
  end=$(date +%s.%N)
  echo "[run] tag=$tag rc=$rc wall_seconds=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.3f", b - a }')" >>"$log"
  return $rc
}

# record EXPERIMENT MODEL DP VARIANT ITERATIONS INTERVAL TAG: append the run's figures to results.csv.
record() {
  "$PYTHON" "$REPO/tools/slurm_results.py" --csv "$RESULTS_DIR/results.csv" \
    --experiment "$1" --model "$2" --dp "$3" --variant "$4" --iterations "$5" --save-interval "$6" \
    --nodes "$NODES" --log "$RESULTS_DIR/$7.log"
}

# run_matrix EXPERIMENT MODEL DP ITERATIONS INTERVAL...: every variant at every interval, one after
# another (ITERATIONS and SAVE_INTERVALS override the experiment's).
run_matrix() {
  local experiment="$1" model="$2" dp="$3" iters="${ITERATIONS:-$4}"; shift 4
  # shellcheck disable=SC2206  # SAVE_INTERVALS is a space-separated list
  local intervals=(${SAVE_INTERVALS:-$*}) interval variant tag status=0
  for variant in "${VARIANTS[@]}"; do variant_args "$variant"; done  # fail before the first launch
  set_model "$model"
  set_layout "$dp"
  if [ "${DRY_RUN:-0}" != 1 ] || [ -n "${SLURM_JOB_NUM_NODES:-}" ]; then check_nodes; fi
  size_lazy_cache "$model" "$dp" "$iters"
  for interval in "${intervals[@]}"; do
    for variant in "${VARIANTS[@]}"; do
      tag="${experiment}_${model}_dp${dp}_every${interval}_${variant}_${JOB_ID}"
      build_args "$model" "$dp" "$iters" "$interval" "$variant" "$CKPT_ROOT/$tag"
      launch "$tag" || status=1  # keep going: one failed variant must not hide the others
      [ "${DRY_RUN:-0}" = 1 ] && continue
      record "$experiment" "$model" "$dp" "$variant" "$iters" "$interval" "$tag" || status=1
      [ "${KEEP_CHECKPOINTS:-0}" = 1 ] || rm -rf "${CKPT_ROOT:?}/$tag"
    done
  done
  return $status
}
