#!/usr/bin/env bash
# Usage: bash scripts/gpu_check.sh [--cpu] [scripts/gpu_check.py options: --steps a,b,c,d ...]
#
# The CUDA/NCCL check, prepared for a machine with ONE CUDA GPU where python3 is 3.12 with a CUDA
# build of torch 2.11, without network and without megatron-core. It installs the wheels carried
# in .whl/ into /tmp/site, then runs scripts/gpu_check.py: (a) tests/test_engine_cuda.py, (b) a
# tiny GPT on NCCL with --bf16, the distributed optimizer and --async-lazy-save, iteration 3's copy delayed while iteration 4
# runs, its checkpoint compared bit for bit with torch_dist sync's, (c) a bit-exact resume from it,
# (d) the engine's device-to-host snapshot rate against pinned torch copies, into its pinned cache
# and into a /dev/shm slot registered with CUDA (the in-memory level's one copy), (e) the cost of a save
# in the background, (f) the 117M GPT with an in-memory checkpoint every iteration against none;
# 8 minutes at most.
# Results: $OUT/gpu_check.json when $OUT is set, gpu_check_results.json otherwise (logs beside
# them); exit status 1 if any step failed, 2 if there is no CUDA device.
#
# Fill .whl/ (git-ignored) beforehand on a machine with network, from the repository root:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl megatron-core==0.16.1 numpy==2.4.6 packaging==26.4 psutil==7.2.2 crc32c==2.9.post0 safetensors==0.8.0 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0
#   python3 -m pip wheel --no-deps -w .whl .    # this repository; rebuild it after every edit
# torch 2.11 requires neither numpy nor packaging (megatron-core does), nor psutil (megatron-core's
# async writers and our benchmarks use it); pygments, pluggy, iniconfig and packaging are pytest's.
#
# --cpu (or GPU_CHECK_ALLOW_CPU=1) rehearses the check on a machine without a GPU: nothing is
# installed, $PYTHON (default python3) is used as it is, e.g.
#   PYTHON=.venv/bin/python bash scripts/gpu_check.sh --cpu
# GPU_CHECK_INSTALL=1 with --cpu installs the wheels all the same, to rehearse the install on a
# Python 3.12 with torch alone.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
export GPU_CHECK_START="$(date +%s)"  # the driver's 8-minute budget counts the install too
PY="${PYTHON:-python3}"
CPU="${GPU_CHECK_ALLOW_CPU:-0}"
for arg in "$@"; do
  if [ "$arg" = --cpu ]; then CPU=1; fi
done

if [ "$CPU" = 1 ] && [ "${GPU_CHECK_INSTALL:-0}" != 1 ]; then
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
  found=0
  "$PY" -W ignore -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" \
    || found=$?
  if [ "$found" = 3 ] && [ "$CPU" != 1 ]; then
    echo "gpu_check: no CUDA device is visible to $PY. This check is for a machine with one GPU;" \
         "pass --cpu (or GPU_CHECK_ALLOW_CPU=1) to rehearse it on CPU." >&2
    exit 2
  elif [ "$found" != 0 ] && [ "$found" != 3 ]; then
    echo "gpu_check: $PY cannot import torch; set PYTHON to the interpreter that has it" >&2
    exit 2
  fi
  if ! compgen -G ".whl/*.whl" >/dev/null; then
    echo "gpu_check: no wheels in $ROOT/.whl: fetch them first (see the header of $0)" >&2
    exit 2
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
exec "$PY" scripts/gpu_check.py "$@"
