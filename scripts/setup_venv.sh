#!/usr/bin/env bash
# Usage: source scripts/setup_venv.sh
# Creates .venv in the repository root if it is missing (reuses it otherwise) and installs the
# project with its CPU dependencies (tensorboard and wandb too: optional for training, needed by
# tests/test_trainer_logging.py; transformers, pinned, by the Hugging Face export tests; deepspeed,
# pinned, by the DeepSpeed engine tests). torch is
# pinned to 2.13.0 for CPU installs: that wheel is on local disk on our machines; any other version
# downloads several GB.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
# Install only what is missing so a reused venv costs a second, not a minute.
if ! "$PY" -c "import torch, megatron.core, psutil, pytest, xdist, safetensors, crc32c, matplotlib, importlinter, tensorboard, wandb, transformers, deepspeed" >/dev/null 2>&1; then
  # One resolver run for torch and the rest (two cost ~10 s more on a fresh venv). pip compiles
  # what it installs to bytecode on one core; compileall does the same files on every core: 41 +
  # 26 s against 76 s for a fresh venv on 2 cores (the same 13,846 .pyc files).
  "$PY" -m pip install -q --disable-pip-version-check --no-compile torch==2.13.0 \
    -r "$ROOT/requirements.txt"
  SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  # A few packaged files are not valid Python 3.11 (templates, tests of other versions): pip
  # skips them too.
  "$PY" -m compileall -q -j 0 "$SITE" >/dev/null 2>&1 || true
fi
# From / so that the repository's own directory on sys.path cannot hide a missing install.
if ! (cd / && "$PY" -c "import datastates, megatron.training, tools.errors") >/dev/null 2>&1 \
   || ! "$PY" -m pip show -q datastates-llm >/dev/null 2>&1; then
  "$PY" -m pip install -q --disable-pip-version-check --no-deps -e "$ROOT"
fi
# Our sources compiled to bytecode once, as pip does for every package it installs (an editable
# install does not). Without it a process started with PYTHONDONTWRITEBYTECODE set (as on our
# machines) compiles the ~80 modules of ours it imports again each time: 0.17 s of CPU per
# process (3.64 s against 3.47 s for a one-rank tiny run, median of 8), in every rank, converter
# and probe the tests start. Only files that changed are compiled again; Python never runs a
# stale one (it checks each source's size and mtime).
"$PY" -m compileall -q -j 0 -x '/\.venv/' "$ROOT/datastates" "$ROOT/megatron" "$ROOT/tools" \
  "$ROOT/tests" "$ROOT/benchmarks" "$ROOT/examples" "$ROOT/scripts" >/dev/null \
  || echo "setup_venv: compiling the sources to bytecode failed; they run, compiled at each start" >&2
# The engine's one-pass copy + checksum library; optional (the engine falls back without it).
bash "$ROOT/scripts/build_copycrc.sh" || echo "setup_venv: datastates/_copycrc.so not built" >&2
export PATH="$VENV/bin:$PATH"
