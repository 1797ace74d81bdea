#!/usr/bin/env bash
# Train a tiny GPT on CPU with mock data, checkpoint, stop, and resume from the checkpoint.
#
# Usage: bash examples/train_tiny_cpu.sh [OUT_DIR] [NPROC] [extra pretrain_gpt.py flags...]
#   OUT_DIR  where checkpoints go (default: runs/tiny_cpu; wiped first)
#   NPROC    local ranks (default 1). With 2 or 4, add layout flags, e.g.
#            bash examples/train_tiny_cpu.sh runs/tp2 2 --tensor-model-parallel-size 2
#
# Phase 1 trains to iteration 20 and stops there (--exit-interval), saving a torch_dist
# checkpoint; phase 2 resumes from it and trains to 40. Needs the repo's .venv
# (source scripts/setup_venv.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-$ROOT/runs/tiny_cpu}"
NPROC="${2:-1}"
shift $(( $# > 2 ? 2 : $# ))
PY="${PYTHON:-$ROOT/.venv/bin/python}"

MODEL_ARGS=(
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 512
  --seq-length 128 --max-position-embeddings 128
)
DATA_ARGS=(
  --mock-data --tokenizer-type NullTokenizer --vocab-size 1023
)
TRAIN_ARGS=(
  --micro-batch-size 4 --global-batch-size 8 --train-iters 40
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 4
  --weight-decay 0.01 --clip-grad 1.0 --seed 1234
)
EVAL_LOG_ARGS=(
  --log-interval 5 --eval-interval 20 --eval-iters 2
)
CKPT_ARGS=(
  --save "$OUT" --load "$OUT" --save-interval 20 --ckpt-format torch_dist
)

if [ "$NPROC" -gt 1 ]; then
  LAUNCH=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC")
else
  LAUNCH=("$PY")
fi

if [ -e "$OUT" ]; then
  echo "== removing $OUT (this example starts from an empty output directory)"
fi
rm -rf "$OUT" && mkdir -p "$OUT"
echo "== phase 1: train to iteration 20, save, stop"
"${LAUNCH[@]}" "$ROOT/pretrain_gpt.py" "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAIN_ARGS[@]}" \
  "${EVAL_LOG_ARGS[@]}" "${CKPT_ARGS[@]}" --exit-interval 20 "$@"
echo "== phase 2: resume from $(cat "$OUT/latest_checkpointed_iteration.txt") and train to 40"
"${LAUNCH[@]}" "$ROOT/pretrain_gpt.py" "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAIN_ARGS[@]}" \
  "${EVAL_LOG_ARGS[@]}" "${CKPT_ARGS[@]}" "$@"
