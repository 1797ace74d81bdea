"""Append one run's figures (parsed from its log) to a results CSV; used by examples/slurm/.

Usage:
    python tools/slurm_results.py --csv runs/slurm/results.csv --log run.log \
        --experiment throughput --model 7B --dp 1 --nodes 2 --variant torch --iterations 5 --save-interval 1

``checkpoint_bytes`` is the size on disk of the newest complete checkpoint the log names (measured
the same way for every format; run this before deleting the checkpoints).
Several jobs may append to the same CSV at once: the file is locked while a row is written.
"""
from __future__ import annotations

import argparse
import csv
import fcntl
import os
import sys

from tools.errors import ToolInputError
from tools.runlog import CSV_COLUMNS, csv_row, parse_log


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--csv", required=True)
    parser.add_argument("--log", required=True)
    for name in ("experiment", "model", "variant"):
        parser.add_argument(f"--{name}", required=True)
    for name in ("dp", "nodes", "iterations", "save-interval"):
        parser.add_argument(f"--{name}", type=int, required=True)
    return parser


def directory_bytes(directory) -> "int | None":
    """Bytes of the files under `directory`; None if it is not there."""
    if not directory or not os.path.isdir(directory):
        return None
    return sum(os.path.getsize(os.path.join(top, name))
               for top, _, files in os.walk(directory) for name in files)


def append_row(csv_path: str, row: dict) -> None:
    with open(csv_path, "a+", newline="", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released on close
        f.seek(0)
        header = f.readline().rstrip("\r\n")
        if header and header != ",".join(CSV_COLUMNS):
            raise ToolInputError(f"its columns are not this version's (expected "
                                 f"{','.join(CSV_COLUMNS)}; found {header}); move it aside or "
                                 "name another --csv", path=csv_path)
        f.seek(0, os.SEEK_END)
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        if f.tell() == 0:
            writer.writeheader()
        writer.writerow(row)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with open(args.log, encoding="utf-8", errors="replace") as f:
            figures = parse_log(f)
    except FileNotFoundError:
        print(f"error: {args.log}: log not found", file=sys.stderr)
        return 2
    row = csv_row(figures, experiment=args.experiment, model=args.model, dp=args.dp, nodes=args.nodes,
                  variant=args.variant, iterations=args.iterations, save_interval=args.save_interval, log=args.log,
                  checkpoint_bytes=directory_bytes(figures.newest_checkpoint))
    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    try:
        append_row(args.csv, row)
    except ToolInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{args.csv}: {args.experiment} {args.model} dp{args.dp} {args.variant}: "
          f"{row['iterations_logged']} iterations, mean {row['mean_iteration_ms']} ms, "
          f"{row['checkpoints_saved']} checkpoints, mean save {row['mean_save_ms']} ms", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
