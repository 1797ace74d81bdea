"""What the memory levels of a --save hold in this node's shared memory, and giving it back.

The in-memory level (--non-persistent-ckpt-type in_memory) and the peer replicas keep versions
in /dev/shm, which outlives the training processes, so that a restart on the same nodes resumes
from them. A clean end of training gives that memory back; a job that ends otherwise for good (it
crashed and is not restarted there, it was cancelled, it gave up) leaves it, and the node has
that much less memory until someone removes it. Run this on every node of the job, e.g.
`srun --ntasks-per-node=1 python tools/memory_level.py SAVE --remove`, as
examples/slurm/train.sbatch does after its last attempt.

Usage:
    python tools/memory_level.py SAVE            # what this node holds for --save SAVE
    python tools/memory_level.py SAVE --remove   # give it back (refused while a process uses it)

SAVE is --save as the job gave it, from the directory the job was launched in (it is made
absolute, as the trainer makes it).
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys

MiB = 1 << 20


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("save", help="the job's --save")
    parser.add_argument("--remove", action="store_true",
                        help="remove it (the versions newer than --save's are lost)")
    parser.add_argument("--force", action="store_true",
                        help="remove it even while a process on this node uses it")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from datastates.megatron_adapter import held_bytes, held_versions, paths, processes_using
    from megatron.training.config import shared_memory_dir

    top = os.path.dirname(shared_memory_dir(args.save, "level"))
    host = socket.gethostname()
    if not os.path.isdir(top):
        print(f"{host}: no shared memory held for --save {args.save} ({top})")
        return 0
    persistent = paths.tracked_iteration(args.save)
    held, size = held_versions(top), held_bytes(top)
    print(f"{host}: {top} holds {size / MiB:.0f} MiB for --save {args.save} (its newest "
          f"complete checkpoint: {'none' if persistent is None else f'iteration {persistent}'})")
    for h in held:
        print(f"  {os.path.relpath(h.path, top)}: complete iteration(s) {h.complete}"
              + ("" if h.tracked is None else f", a restart takes {h.tracked}")
              + (f"; unfinished: {h.other}" if h.other else ""))
    newer = sorted({it for h in held for it in h.complete
                    if persistent is None or it > persistent})
    if newer:
        print(f"  newer than --save's: iteration(s) {newer} (a restart on this node resumes from "
              "them; removing them loses them)")
    if not args.remove:
        return 0
    users = processes_using(top)
    if users and not args.force:
        print(f"error: {host}: not removing {top}: process(es) {users} on this node use it (a "
              "job still running here); stop them first, or pass --force", file=sys.stderr)
        return 1
    shutil.rmtree(top)
    print(f"{host}: removed {top} ({size / MiB:.0f} MiB"
          + (f"; lost iteration(s) {newer}" if newer else "") + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
