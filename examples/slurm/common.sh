#!/usr/bin/env bash
# Shared part of the Slurm experiments; sourced by the *.sbatch scripts, never run directly.
#
# Site settings (environment variables, with defaults):
#   REPO          repository root on the shared file system    (default: $SLURM_SUBMIT_DIR)
#   PYTHON        python of the environment with our package   (default: $REPO/.venv/bin/python)
#   CKPT_ROOT     where checkpoints go (parallel file system)  (default: $REPO/checkpoints/slurm)
#   RESULTS_DIR   logs and results.csv                         (default: $REPO/runs/slurm)
#   DATA_PATH     megatron --data-path prefix; empty: --mock-data (default: empty)
#   GPUS_PER_NODE GPUs (= ranks) per node                      (default: 4, as the paper's Polaris)
#   MASTER_PORT   rendezvous port on the first node            (default: 29500)
#   EXTRA_ARGS    extra pretrain_gpt.py arguments, word-split  (default: empty)
#   ONLY_VARIANTS space-separated subset of the variants to run (default: all four)
#   DRY_RUN=1     no srun: check each run's arguments with tools/dry_run.py (on any CPU machine:
#                 DRY_RUN=1 SLURM_JOB_NUM_NODES=2 bash examples/slurm/throughput.sbatch 7B)
# ACCOUNT and PARTITION are given to sbatch (-A, -p) or by examples/slurm/submit_all.sh.

REPO="${REPO:-${SLURM_SUBMIT_DIR:-$(pwd)}}"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
CKPT_ROOT="${CKPT_ROOT:-$REPO/checkpoints/slurm}"
RESULTS_DIR="${RESULTS_DIR:-$REPO/runs/slurm}"
DATA_PATH="${DATA_PATH:-}"
GPUS_PER_NODE="${GPUS_PER_NODE:-4}"
MASTER_PORT="${MASTER_PORT:-29500}"
EXTRA_ARGS="${EXTRA_ARGS:-}"

ALL_VARIANTS=(torch torch_dist torch_dist_async datastates_lazy)
# shellcheck disable=SC2206  # ONLY_VARIANTS is a space-separated subset
VARIANTS=(${ONLY_VARIANTS:-${ALL_VARIANTS[*]}})
TP=4
SEQ_LENGTH=2048
MICRO_BATCH=16

die() { echo "error: $*" >&2; exit 2; }

# set_model NAME: the paper's model table (layers / hidden / heads / nodes of 4 GPUs), PP = nodes.
set_model() {
  MODEL="$1"
  MODEL_EXTRA=()
  case "$MODEL" in
    3B)  LAYERS=30; HIDDEN=2560; HEADS=32; MODEL_NODES=1 ;;
    7B)  LAYERS=32; HIDDEN=4096; HEADS=32; MODEL_NODES=2 ;;
    13B) LAYERS=40; HIDDEN=5120; HEADS=40; MODEL_NODES=4 ;;
    # 60 layers do not split evenly over 8 stages; the embedding stages get fewer: 6 + 6x8 + 6.
    30B) LAYERS=60; HIDDEN=6656; HEADS=52; MODEL_NODES=8
         MODEL_EXTRA=(--decoder-first-pipeline-num-layers 6 --decoder-last-pipeline-num-layers 6) ;;
    70B) LAYERS=80; HIDDEN=8192; HEADS=64; MODEL_NODES=20 ;;
    *) die "unknown model '$MODEL'; expected one of 3B 7B 13B 30B 70B" ;;
  esac
  PP=$MODEL_NODES
}

# variant_args VARIANT: checkpoint-format arguments of one variant of the paper's comparison.
variant_args() {
  case "$1" in
    torch)            VARIANT_ARGS=(--ckpt-format torch) ;;
    torch_dist)       VARIANT_ARGS=(--ckpt-format torch_dist) ;;
    torch_dist_async) VARIANT_ARGS=(--ckpt-format torch_dist --async-save) ;;
    datastates_lazy)  VARIANT_ARGS=(--async-lazy-save) ;;
    *) die "unknown variant '$1'; expected one of ${ALL_VARIANTS[*]}" ;;
  esac
}

# build_args MODEL DP ITERATIONS SAVE_INTERVAL VARIANT CKPT_DIR: fills ARGS for pretrain_gpt.py.
build_args() {
  local model="$1" dp="$2" iters="$3" interval="$4" variant="$5" ckpt_dir="$6"
  set_model "$model"
  variant_args "$variant"
  MODEL_ARGS=(
    --num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS"
    --ffn-hidden-size $((4 * HIDDEN))
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
    "${MODEL_EXTRA[@]}"
  )
  PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --use-distributed-optimizer  # ZeRO-1, as the paper's DeepSpeed runs
  )
  TRAINING_ARGS=(
    --micro-batch-size "$MICRO_BATCH" --global-batch-size $((MICRO_BATCH * dp))
    --train-iters "$iters" --bf16 --seed 1234
    --lr 1.0e-4 --min-lr 1.0e-5 --lr-decay-style cosine --lr-warmup-iters 0
    --weight-decay 0.1 --clip-grad 1.0
  )
  if [ -n "$DATA_PATH" ]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --split 98,2,0 --tokenizer-type ByteLevelTokenizer)
  else
    # GPT-2's vocabulary size (50256 ids + eod), as the paper's models.
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50256)
  fi
  CHECKPOINT_ARGS=(--save "$ckpt_dir" --save-interval "$interval" "${VARIANT_ARGS[@]}")
  LOGGING_ARGS=(--log-interval 1 --eval-interval "$((iters + 1))" --eval-iters 0)
  # shellcheck disable=SC2206  # EXTRA_ARGS is meant to be word-split
  ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}"
        "${CHECKPOINT_ARGS[@]}" "${LOGGING_ARGS[@]}" $EXTRA_ARGS)
}

# check_nodes NEEDED: the allocation must match the layout exactly (DP is derived from it).
check_nodes() {
  local have="${SLURM_JOB_NUM_NODES:-0}"
  [ "$have" -eq "$1" ] || die "this run needs $1 nodes (TP=$TP x PP=$PP x DP per node of $GPUS_PER_NODE GPUs), the job has $have; submit with sbatch -N $1"
}

# launch TAG: one torchrun per node via srun, rendezvous on the first node; log to RESULTS_DIR/TAG.log.
launch() {
  local tag="$1" log="$RESULTS_DIR/$1.log" start end
  mkdir -p "$RESULTS_DIR"
  if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "== dry run: $tag"
    "$PYTHON" "$REPO/tools/dry_run.py" --world-size $((SLURM_JOB_NUM_NODES * GPUS_PER_NODE)) -- "${ARGS[@]}"
    return
  fi
  MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
  export MASTER_ADDR MASTER_PORT
  LAUNCH_ARGS=(
    --nnodes "$SLURM_JOB_NUM_NODES" --nproc-per-node "$GPUS_PER_NODE"
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID-$tag"
  )
  echo "[$(date -u +%FT%TZ)] $tag: $SLURM_JOB_NUM_NODES nodes, args: ${ARGS[*]}" | tee "$log"
  start=$(date +%s.%N)
  srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
    "$PYTHON" -m torch.distributed.run "${LAUNCH_ARGS[@]}" "$REPO/pretrain_gpt.py" "${ARGS[@]}" >>"$log" 2>&1
  local rc=$?
  end=$(date +%s.%N)
  echo "[run] tag=$tag rc=$rc wall_seconds=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.3f", b - a }')" >>"$log"
  return $rc
}

# record EXPERIMENT MODEL DP VARIANT ITERATIONS INTERVAL TAG: append the run's figures to results.csv.
record() {
  "$PYTHON" "$REPO/tools/slurm_results.py" --csv "$RESULTS_DIR/results.csv" \
    --experiment "$1" --model "$2" --dp "$3" --variant "$4" --iterations "$5" --save-interval "$6" \
    --nodes "$SLURM_JOB_NUM_NODES" --log "$RESULTS_DIR/$7.log"
}

# run_matrix EXPERIMENT MODEL DP ITERATIONS INTERVAL...: every variant at every interval, one after another.
run_matrix() {
  local experiment="$1" model="$2" dp="$3" iters="$4"; shift 4
  set_model "$model"
  check_nodes $((MODEL_NODES * dp))
  local interval variant tag status=0
  for variant in "${VARIANTS[@]}"; do variant_args "$variant"; done  # fail before the first launch
  for interval in "$@"; do
    for variant in "${VARIANTS[@]}"; do
      tag="${experiment}_${model}_dp${dp}_every${interval}_${variant}_${SLURM_JOB_ID}"
      build_args "$model" "$dp" "$iters" "$interval" "$variant" "$CKPT_ROOT/$tag"
      launch "$tag" || status=1  # keep going: one failed variant must not hide the others
      [ "${DRY_RUN:-0}" = 1 ] && continue
      record "$experiment" "$model" "$dp" "$variant" "$iters" "$interval" "$tag" || status=1
      rm -rf "${CKPT_ROOT:?}/$tag"  # checkpoints of a benchmark are not kept (they are TBs)
    done
  done
  return $status
}
