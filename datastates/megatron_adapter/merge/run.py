"""The merge process: ``python -m datastates.megatron_adapter.merge --source DIR --output DIR``.

Run by `BackgroundMerger` (low priority, one at a time) after a checkpoint is committed; usable by
hand too. Order: 1) merge and commit the universal checkpoint atomically (writer.py); 2) advance
``<root>/latest_checkpointed_iteration.txt`` (never backwards), so ``--load <root>`` resumes from
the newest universal checkpoint; 3) append the result to ``<root>/universal_merges.jsonl`` and print
it as a Megatron-style line plus a JSON line. Killed anywhere, it leaves the previous universal
checkpoints, the tracker and the source as they were; rerun, it finishes the job (a committed
output is not rewritten).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

from ...errors import CheckpointError
from ...fileio import atomic_write, read_iteration
from ...universal import MergeResult, write_universal
from .sources import open_source
from ..paths import TRACKER_FILENAME

TELEMETRY_FILE = "universal_merges.jsonl"


def advance_tracker(root: str, iteration: int) -> None:
    path = os.path.join(root, TRACKER_FILENAME)
    try:
        current = read_iteration(path)
    except CheckpointError:  # missing, unreadable or not a plain number: ours to rewrite
        current = -1
    if iteration > current:
        atomic_write(path, str(iteration).encode())


def log_line(r: MergeResult) -> str:
    return (f" universal merge iteration {r.iteration:8d} | bytes: {r.bytes} | merge (s): "
            f"{r.seconds:.3f} | throughput (GB/s): {r.gbps:.3f} | committed: {r.directory}")


def run_merge(source_dir: str, output_dir: str, root: Optional[str] = None,
              max_file_bytes: int = 2 << 30, max_bytes_per_s: Optional[float] = None) -> MergeResult:
    source = open_source(source_dir)
    try:
        result = write_universal(source, output_dir, max_file_bytes=max_file_bytes,
                                 max_bytes_per_s=max_bytes_per_s)
    finally:
        source.close()
    if root is not None:
        record(root, result, source_dir)
    return result


def record(root: str, result: MergeResult, source_dir: str, **extra) -> None:
    """After a merge committed: advance the universal tracker of `root`, append the telemetry."""
    advance_tracker(root, result.iteration)
    with open(os.path.join(root, TELEMETRY_FILE), "a") as f:
        f.write(json.dumps(dict(result.to_json(), source=source_dir, time=time.time(), **extra))
                + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="merge one committed checkpoint into a universal one")
    p.add_argument("--source", required=True, help="committed iter_XXXXXXX directory")
    p.add_argument("--output", required=True, help="universal checkpoint directory to commit")
    p.add_argument("--root", help="universal root: advance its tracker, append telemetry")
    p.add_argument("--max-file-bytes", type=int, default=2 << 30)
    p.add_argument("--max-bytes-per-s", type=float, default=None)
    a = p.parse_args(argv)
    try:
        r = run_merge(a.source, a.output, a.root, a.max_file_bytes, a.max_bytes_per_s)
    except CheckpointError as err:
        print(f"universal merge: error: {err}", file=sys.stderr, flush=True)
        return 2
    print(log_line(r), flush=True)
    print(json.dumps(r.to_json()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
