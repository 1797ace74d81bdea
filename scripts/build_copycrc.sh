#!/usr/bin/env bash
# Usage: bash scripts/build_copycrc.sh
# Compiles datastates/_copycrc.c (the engine's one-pass copy + CRC-32C; datastates/copycrc.py)
# into datastates/_copycrc.so, unless that is already newer than the source. Needs a C compiler
# and an x86-64 CPU with SSE4.2; without the library the engine still works (memmove, then the
# checksum in its writer thread: one more pass over memory per byte saved).
set -euo pipefail
PKG="$(cd "$(dirname "${BASH_SOURCE[0]}")/../datastates" && pwd)"
SRC="$PKG/_copycrc.c"
OUT="$PKG/_copycrc.so"
if [ -f "$OUT" ] && [ "$OUT" -nt "$SRC" ]; then
  exit 0
fi
CC="${CC:-$(command -v gcc || command -v cc || true)}"
if [ -z "$CC" ]; then
  echo "build_copycrc: no C compiler (gcc/cc); the engine copies and checksums in two passes" >&2
  exit 1
fi
"$CC" -O2 -msse4.2 -shared -fPIC -o "$OUT.tmp.$$" "$SRC"
mv -f "$OUT.tmp.$$" "$OUT"
