"""Fault-matrix tier (tests/fault_matrix.py): one step of a save fails on one rank, and nothing
hangs, one error is printed, no process is left, and what was committed resumes bit-exactly.
A launch costs seconds, so CI runs a seeded sample that covers a different set of cells on each
run (FAULT_MATRIX_SEED fixes it; the seed is in the test id); the full pass is
`python tests/fault_matrix.py --all`.

Also here: a committed checkpoint is never rewritten. Re-running a finished run, and killing
such re-runs at seeded random moments, leaves every committed file byte-identical.
"""
from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fault_matrix  # noqa: E402
from trainer_launch import ENTRY, REPO, launch  # noqa: E402

#: Cells per CI run: each is a failing launch plus, where a checkpoint was committed, a resume
#: (three keep the suite within its 20 minutes; the full matrix is `fault_matrix.py --all`).
SAMPLE = 3
SEED = int(os.environ.get("FAULT_MATRIX_SEED", str(int(time.time()) // 86400)))
CELLS = fault_matrix.sample(SAMPLE, SEED, [c for c in fault_matrix.all_cells() if c.ranks == 2])


@pytest.fixture(scope="module")
def reference_2(tmp_path_factory) -> Dict[int, str]:
    return fault_matrix.reference(2, tmp_path_factory.mktemp("ref2"))


@pytest.mark.parametrize("cell", CELLS, ids=[f"seed{SEED}-{c.name}" for c in CELLS])
def test_fault_matrix_cell(cell, reference_2, tmp_path):
    print(fault_matrix.run_cell(cell, tmp_path, reference_2))


def test_matrix_covers_every_step_format_and_kind():
    """The full pass names every (format, step, kind) and the first, middle and last rank of
    steps every rank does, at 2 and 4 ranks."""
    cells = fault_matrix.all_cells()
    assert {c.fmt for c in cells} == set(fault_matrix.FORMATS)
    assert {c.kind for c in cells} == set(fault_matrix.KINDS)
    assert {c.step for c in cells} == set(fault_matrix.RANK0_STEPS + fault_matrix.EVERY_RANK_STEPS)
    assert {c.rank for c in cells if c.ranks == 4 and c.step == "write"} == {0, 2, 3}
    assert len(set(fault_matrix.sample(SAMPLE, SEED))) == SAMPLE


def _hashes(root: Path) -> Dict[str, str]:
    """sha256 of every file of every complete version directory under `root`."""
    from datastates.megatron_adapter import paths

    out = {}
    for it in paths.complete_iterations(str(root)):
        d = Path(paths.checkpoint_dir(str(root), it))
        for f in sorted(d.rglob("*")):
            if f.is_file():
                out[str(f.relative_to(root))] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def test_rerunning_a_finished_run_never_rewrites_a_committed_checkpoint(tmp_path):
    """A launch line run again on a finished run: it loads the newest checkpoint,
    trains nothing and saves nothing (it used to save the committed iteration again, in place);
    killed at seeded random moments of such re-runs, every committed file stays byte-identical and
    the tracker still names a committed checkpoint that resumes."""
    save = tmp_path / "save"
    args = fault_matrix.args_for("lazy", tmp_path, save, load=True)
    first = launch(2, args, timeout=fault_matrix.LAUNCH_TIMEOUT_S)
    assert first.returncode == 0, first.describe()
    before = _hashes(save)
    tracker = (save / "latest_checkpointed_iteration.txt").read_text()
    assert before and tracker == str(fault_matrix.TRAIN_ITERS)

    again = launch(2, args, timeout=fault_matrix.LAUNCH_TIMEOUT_S)
    assert again.returncode == 0, again.describe()
    assert f"training from iteration {tracker} to {tracker}" in again.stdout, again.describe()
    assert "checkpoints: 0 (complete: 0) |" in again.stdout, again.describe()
    assert _hashes(save) == before

    rng = random.Random(SEED)
    trials = int(os.environ.get("RERUN_KILL_TRIALS", "1"))
    for trial in range(trials):
        delay = rng.uniform(2.0, 9.0)  # start-up, load, the (empty) loop, exit
        env = {k: v for k, v in os.environ.items()
               if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc_per_node=2", ENTRY] + args, cwd=str(REPO), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        time.sleep(delay)
        tree = [proc] if proc.poll() is not None else \
            psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
        for p in tree:
            try:
                p.send_signal(signal.SIGKILL)
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
        proc.wait(timeout=60)
        assert _hashes(save) == before, f"trial {trial} (kill after {delay:.1f} s, seed {SEED})"
        assert (save / "latest_checkpointed_iteration.txt").read_text() == tracker
