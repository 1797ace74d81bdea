"""Crash trials at scale: SIGKILL training jobs inside checkpoint phases, restart, check.

    python benchmarks/crash_trials.py --trials 50 --seed 0 [--workdir DIR] [--nproc 2]

Each trial kills a DP2 --async-lazy-save job (checkpoint every iteration) with SIGKILL, either the
whole process tree or one rank, inside a seeded phase (copy, flush, commit, tracker, or a random
moment after an iteration), then restarts it with --load. Prints one line per trial and the
summary quoted in docs/FAULTS.md: trials, phases hit, corrupt or unloadable checkpoints (must be
0), restarts that resumed from the newest complete checkpoint (must be all), restarts
bit-identical to an uninterrupted run, lost iterations per crash. Exit status 1 when any check
fails. Uses 2 cores for ~30 s per trial; run nothing else multi-process meanwhile.
`--memory` runs the trials with the in-memory level (issue 30's kill trials).
"""
import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import crash_harness  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--train-iters", type=int, default=12)
    p.add_argument("--delay", type=float, default=1.5,
                   help="seconds each planned phase is paused so the kill lands inside it")
    p.add_argument("--phases", default=",".join(crash_harness.PHASES))
    p.add_argument("--workdir", default=None, help="default: a fresh temporary directory")
    p.add_argument("--memory", action="store_true",
                   help="with the in-memory level (--non-persistent-ckpt-type in_memory) every "
                        "iteration and --save every "
                        f"{crash_harness.MEMORY_PERSISTENT_INTERVAL}: kills land in either "
                        "level's saves, restarts resume from whichever is newest")
    a = p.parse_args(argv)
    workdir = a.workdir or tempfile.mkdtemp(prefix="crash_trials_")
    os.makedirs(workdir, exist_ok=True)
    t0 = time.time()
    trials = crash_harness.run_trials(
        a.trials, workdir, seed=a.seed, nproc=a.nproc, train_iters=a.train_iters, delay=a.delay,
        phases=tuple(a.phases.split(",")), log=lambda m: print(m, flush=True), memory=a.memory)
    print(crash_harness.summary(trials))
    print(f"wall time: {time.time() - t0:.0f} s, workdir {workdir}")
    failed = [t for t in trials if t.corrupt or t.resumed_from is None or not t.bit_identical
              or t.resumed_from != t.tracker_after]
    for t in failed:
        print(f"FAILED: {t}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
