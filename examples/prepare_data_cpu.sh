#!/usr/bin/env bash
# Usage: bash examples/prepare_data_cpu.sh [OUTPUT_DIR] [MAX_DOCUMENTS]
#
# Builds a small training corpus from text already on this machine (Python standard library
# docstrings and /usr/share/common-licenses; nothing is downloaded or committed), tokenizes it
# byte-level with an end-of-document token after each document, and prints the value to pass as
#   pretrain_gpt.py --data-path <printed> --tokenizer-type ByteLevelTokenizer --split 98,2,0
# Defaults: OUTPUT_DIR=data, MAX_DOCUMENTS=all (about 2,400 documents, 1.5 M tokens on Python 3.11).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUTPUT_DIR="${1:-$ROOT/data}"
MAX_DOCUMENTS="${2:-}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
if [ ! -x "$PYTHON" ]; then
  echo "error: $PYTHON not found; run 'source scripts/setup_venv.sh' first or set PYTHON" >&2
  exit 2
fi
mkdir -p "$OUTPUT_DIR"

CORPUS_ARGS=(
  --output "$OUTPUT_DIR/corpus.jsonl"
  --source stdlib licenses
  --min-chars 200
)
if [ -n "$MAX_DOCUMENTS" ]; then
  CORPUS_ARGS+=(--max-documents "$MAX_DOCUMENTS")
fi
PREPROCESS_ARGS=(
  --input "$OUTPUT_DIR/corpus.jsonl"
  --output-prefix "$OUTPUT_DIR/corpus"
  --json-keys text
  --tokenizer-type ByteLevelTokenizer
  --append-eod
  --workers 2
)

"$PYTHON" "$ROOT/tools/make_corpus.py" "${CORPUS_ARGS[@]}"
# preprocess_data.py prints only the --data-path prefix on stdout (progress goes to stderr).
# megatron-core warns at import that apex / transformer-engine are absent: expected on CPU.
DATA_PATH="$(PYTHONWARNINGS=ignore "$PYTHON" "$ROOT/tools/preprocess_data.py" "${PREPROCESS_ARGS[@]}")"
echo "$DATA_PATH"
