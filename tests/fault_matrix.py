"""The fault matrix: one step of a save fails on one rank while the others go on.

A cell is (ranks, format, step, failing rank, kind). Its launch trains 3 iterations with a save
after each (`--keep-last-n-checkpoints 1`, so retention runs) and makes `step` fail on one rank
at iteration 2 (the start-up probe at start-up) through `DATASTATES_FAULT_FAIL_<STEP>`
(`datastates/faults.py`). Each cell asserts:
  1) the job ends on its own, well within the bound: no rank hangs (`--ckpt-drain-timeout`
     bounds the checkpoint collectives; the launch's own timeout is the backstop);
  2) one error line for the whole job, the same agreed one, naming the failing rank (a rank
     killed by SIGKILL prints nothing; torchrun then stops the others: at most one line each);
  3) no process of the job is left;
  4) every committed checkpoint reads back with its checksums, the tracker names a committed
     one, and a resume from it prints the same losses as an uninterrupted run, string for
     string.

    python tests/fault_matrix.py --list                 # every cell
    python tests/fault_matrix.py --all --seed 0         # the full pass (hours on 2 cores)
    python tests/fault_matrix.py --sample 6 --seed 7    # a seeded sample

CI runs a seeded sample (`tests/test_faults_matrix.py`): the seed is printed, so a failing cell
can be rerun alone with `--cell NAME`.
"""
from __future__ import annotations

import argparse
import itertools
import os
import random
import re
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from crash_harness import memory_root, newest_complete, verify_committed  # noqa: E402
from trainer_launch import NO_DROPOUT, TINY_MODEL, launch  # noqa: E402

FORMATS = {
    "torch_dist": [],
    "async_save": ["--async-save"],
    "lazy": ["--async-lazy-save"],
    "lazy_local": ["--async-lazy-save", "--lazy-save-local-dir", "{work}/local/r{rank}"],
    # In-memory versions at iterations 1 and 2 (the fault's), --save at 3 (`args_for`).
    "lazy_memory": ["--async-lazy-save", "--non-persistent-ckpt-type", "in_memory",
                    "--non-persistent-save-interval", "1"],
}
#: Steps done by one rank (rank 0) and steps every rank does.
RANK0_STEPS = ("prepare", "common", "commit", "tracker", "retention")
EVERY_RANK_STEPS = ("probe", "write")
KINDS = ("error", "enospc", "erofs", "eacces", "kill")
SIZES = (2, 4)
FAULT_ITERATION = 2
TRAIN_ITERS = 3
DRAIN_TIMEOUT_S = 20  # collectives give up after 1.1x + 10 s (`initialize.control_timeout`)
LAUNCH_TIMEOUT_S = 240  # the backstop: a cell that needs it has hung

_ERROR_LINE = "pretrain_gpt.py: error:"
_LOADED = re.compile(r"loaded checkpoint \S+ \(format \S+, iteration (\d+);")


@dataclass(frozen=True)
class Cell:
    ranks: int
    fmt: str
    step: str
    rank: int
    kind: str

    @property
    def name(self) -> str:
        return f"{self.ranks}r-{self.fmt}-{self.step}-rank{self.rank}-{self.kind}"


def positions(ranks: int) -> List[int]:
    """First, middle and last rank (deduplicated)."""
    return sorted({0, ranks // 2, ranks - 1})


def all_cells() -> List[Cell]:
    cells = []
    for ranks, fmt, kind in itertools.product(SIZES, FORMATS, KINDS):
        for step in RANK0_STEPS:
            cells.append(Cell(ranks, fmt, step, 0, kind))
        for step in EVERY_RANK_STEPS:
            for rank in positions(ranks):
                cells.append(Cell(ranks, fmt, step, rank, kind))
    return cells


def sample(n: int, seed: int, cells: Optional[Sequence[Cell]] = None) -> List[Cell]:
    """`n` cells drawn with `seed`, spread over formats and steps first."""
    pool = list(cells or all_cells())
    rng = random.Random(seed)
    rng.shuffle(pool)
    picked: List[Cell] = []
    seen = set()
    for cell in pool:  # one per (format, step) before any repeat
        key = (cell.fmt, cell.step)
        if key not in seen:
            seen.add(key)
            picked.append(cell)
        if len(picked) == n:
            return picked
    rest = [c for c in pool if c not in picked]
    return picked + rest[:n - len(picked)]


def args_for(fmt: str, work: Path, save: Path, train_iters: int = TRAIN_ITERS,
             load: bool = False) -> List[str]:
    extra = [a.replace("{work}", str(work)) for a in FORMATS[fmt]]
    interval = str(TRAIN_ITERS) if fmt == "lazy_memory" else "1"  # memory saves the others
    out = TINY_MODEL + NO_DROPOUT + extra + [
        "--train-iters", str(train_iters), "--save", str(save), "--save-interval", interval,
        "--keep-last-n-checkpoints", "1", "--eval-iters", "0",
        "--ckpt-drain-timeout", str(DRAIN_TIMEOUT_S)]
    if load:
        out += ["--load", str(save)]
    return out


MARKER = "FAULT_MATRIX_CELL"  # in the environment of every process a cell's job starts


def _left_processes(marker: str) -> List[str]:
    """Processes whose environment carries `marker`: the job's, its workers' and whatever they
    started (multiprocessing helpers inherit the environment but not a telling command line)."""
    left = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.pid != os.getpid() and p.environ().get(MARKER) == marker:
                left.append(f"{p.info['pid']}: {' '.join(p.info['cmdline'] or [])[:200]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return left


def verify_saved(save: Path, fmt: str) -> List[str]:
    """What is wrong with the complete checkpoints under `save`: DataStates ones are read back in
    full with their checksums (`crash_harness.verify_committed`); torch_dist ones must hold
    metadata.json and common.pt (the resume reads them back); the tracker must name one."""
    if fmt == "lazy_memory" and os.path.isdir(memory_root(str(save))):
        bad = [f"in memory: {b}" for b in verify_committed(memory_root(str(save)))]
        return bad + verify_saved(save, "lazy")
    if not save.is_dir():
        return []
    if fmt.startswith("lazy"):
        return verify_committed(str(save))
    from datastates.megatron_adapter import paths

    bad = []
    complete = paths.complete_iterations(str(save))
    for it in complete:
        d = Path(paths.checkpoint_dir(str(save), it))
        bad += [f"{d.name}: no {n}" for n in ("metadata.json", "common.pt") if not (d / n).is_file()]
    tracked = paths.tracked_iteration(str(save))
    if tracked is not None and tracked not in complete:
        bad.append(f"tracker names iteration {tracked}, which is not complete")
    return bad


def reference(ranks: int, work: Path) -> Dict[int, str]:
    """Losses of an uninterrupted run (the format does not change training)."""
    run = launch(ranks, args_for("torch_dist", work, work / "ref"), timeout=LAUNCH_TIMEOUT_S)
    losses = run.losses()
    assert run.returncode == 0 and sorted(losses) == list(range(1, TRAIN_ITERS + 1)), \
        run.describe()
    return losses


def run_cell(cell: Cell, work: Path, ref: Dict[int, str]) -> Dict[str, object]:
    """Run one cell in `work` (its own directory); raises AssertionError naming what broke.
    Returns the figures: seconds to fail, the iteration resumed from, error lines. The
    in-memory level's directory (/dev/shm), which a failed job leaves, goes at the end."""
    try:
        return _run_cell(cell, work, ref)
    finally:
        shutil.rmtree(os.path.dirname(os.path.dirname(memory_root(str(work / "save")))),
                      ignore_errors=True)


def _run_cell(cell: Cell, work: Path, ref: Dict[int, str]) -> Dict[str, object]:
    save = work / "save"
    marker = f"{cell.name}-{uuid.uuid4().hex}"
    env = {f"DATASTATES_FAULT_FAIL_{cell.step.upper()}": f"{cell.kind}@"
           f"{0 if cell.step == 'probe' else FAULT_ITERATION}:{cell.rank}", MARKER: marker}
    t0 = time.monotonic()
    run = launch(cell.ranks, args_for(cell.fmt, work, save), timeout=LAUNCH_TIMEOUT_S,
                 extra_env=env)
    seconds = time.monotonic() - t0
    where = f"cell {cell.name}:\n{run.describe()}"
    assert f"DATASTATES_FAULT fail={cell.step}" in run.stderr, f"fault point not reached; {where}"
    assert run.returncode != 0, f"the job did not fail; {where}"
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith(_ERROR_LINE)]
    if cell.kind == "kill":
        assert len(errors) <= cell.ranks - 1, f"more error lines than survivors; {where}"
    else:
        assert len(errors) == 1, f"expected one error line for the job; {where}"
        assert f"rank(s) [{cell.rank}" in errors[0] or f", {cell.rank}]" in errors[0] \
            or f"[rank {cell.rank}," in errors[0], f"the error does not name rank {cell.rank}; " \
            f"{where}"
        words = {"enospc": "full", "erofs": "read-only", "eacces": "may not write"}
        if cell.kind in words:
            word = words[cell.kind]
            assert word in errors[0], f"the error does not say {word!r}; {where}"
    deadline = time.monotonic() + 10  # helpers notice their parent's death within moments
    while (left := _left_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes left: {left}; {where}"
    bad = verify_saved(save, cell.fmt)
    assert not bad, f"damaged committed checkpoints: {bad}; {where}"
    resumed_from = newest_complete(str(save), memory=cell.fmt == "lazy_memory") or None
    if resumed_from is not None:
        resume = launch(cell.ranks, args_for(cell.fmt, work, save, load=True),
                        timeout=LAUNCH_TIMEOUT_S)
        rwhere = f"cell {cell.name}, resume:\n{resume.describe()}"
        assert resume.returncode == 0, rwhere
        loaded = _LOADED.search(resume.stdout)
        assert loaded and int(loaded.group(1)) == resumed_from, rwhere
        expected = {it: v for it, v in ref.items() if it > resumed_from}
        assert resume.losses() == expected, f"losses {resume.losses()} != {expected}; {rwhere}"
    return {"cell": cell.name, "fail_s": round(seconds, 1), "resumed_from": resumed_from,
            "error_lines": len(errors), "error": errors[0][len(_ERROR_LINE):] if errors else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--sample", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cell", action="append", default=[])
    ap.add_argument("--ranks", type=int, choices=SIZES)
    ap.add_argument("--start", type=int, default=0,
                    help="with --all: skip the first N cells of the seeded order (a full pass "
                         "split over several runs)")
    a = ap.parse_args(argv)
    cells = [c for c in all_cells() if a.ranks is None or c.ranks == a.ranks]
    if a.list:
        print("\n".join(c.name for c in cells))
        print(f"{len(cells)} cells")
        return 0
    if a.cell:
        chosen = [c for c in cells if c.name in a.cell]
    elif a.all:
        chosen = random.Random(a.seed).sample(cells, len(cells))[a.start:]
    else:
        chosen = sample(a.sample or 6, a.seed, cells)
    base = Path(tempfile.mkdtemp(prefix="fault-matrix-"))
    refs: Dict[int, Dict[int, str]] = {}
    passed = failed = 0
    t0 = time.monotonic()
    try:
        for cell in chosen:
            if cell.ranks not in refs:
                refs[cell.ranks] = reference(cell.ranks, base / f"ref{cell.ranks}")
            work = base / cell.name
            work.mkdir()
            try:
                print(run_cell(cell, work, refs[cell.ranks]), flush=True)
                passed += 1
            except AssertionError as err:
                print(f"FAILED {cell.name}: {str(err)[:3000]}", flush=True)
                failed += 1
            shutil.rmtree(work, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    part = f", cells {a.start + 1}-{a.start + len(chosen)} of the seeded order" if a.start else ""
    print(f"fault matrix: {passed} passed, {failed} failed ({len(chosen)} cells, seed {a.seed}"
          f"{part}, {time.monotonic() - t0:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
