"""Helpers for the trainer's multi-process tests: launch pretrain_gpt.py, parse Megatron log lines.

A megatron-core process takes ~5-9 s to start, so tests group their assertions into few launches.
Runs are killed with their whole process tree on timeout (torchrun's workers may outlive it).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import psutil

from megatron.training.model import ATTENTION_SWITCHES

REPO = Path(__file__).resolve().parent.parent
ENTRY = str(REPO / "pretrain_gpt.py")

# ~0.2M parameters: 4 layers so PP2, PP2xVPP2 and TP2xPP2 all split evenly.
TINY_MODEL = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "1e-3", "--lr-warmup-iters", "1", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
    "--mock-data", "--vocab-size", "255", "--log-interval", "1", "--seed", "1234",
    # The final validation, as in Megatron-LM, over 2 batches instead of the default 100: the
    # default cost each launch ~1.5 s (a third of a tiny run), the tests' budget.
    "--eval-iters", "2",
]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]

_TRAIN = re.compile(r" iteration\s+(\d+)/\s*(\d+) \|.*? lm loss: (\S+) \|(?:.*? grad norm: (\S+) \|)?")
_VALID = re.compile(r" validation loss at iteration (\d+) \| lm loss value: (\S+) \|")


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    def losses(self) -> Dict[int, str]:
        """iteration -> the `lm loss` field exactly as printed (for bit-exact comparison)."""
        return {int(m.group(1)): m.group(3) for m in _TRAIN.finditer(self.stdout)}

    def grad_norms(self) -> Dict[int, str]:
        return {int(m.group(1)): m.group(4) for m in _TRAIN.finditer(self.stdout)}

    def validation(self) -> Dict[int, str]:
        return {int(m.group(1)): m.group(2) for m in _VALID.finditer(self.stdout)}

    def describe(self) -> str:
        return f"rc={self.returncode}\n--- stdout ---\n{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-4000:]}"


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        parent = psutil.Process(proc.pid)
        victims = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        return
    for p in victims:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=10)


def launch(nproc: int, args: List[str], timeout: float = 240.0,
           on_line: Optional[Callable[[str, subprocess.Popen], None]] = None,
           entry: str = ENTRY, extra_env: Optional[Dict[str, str]] = None,
           torchrun_args: List[str] = ()) -> Run:
    """Run pretrain_gpt.py (or a launcher of it, `entry`) on ``nproc`` local ranks (plain python
    for 1, torchrun otherwise, with `torchrun_args`); ``extra_env`` reaches only this run (e.g.
    a DATASTATES_FAULT_DELAY_* fault point)."""
    if nproc == 1:
        cmd = [sys.executable, entry] + args
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", *torchrun_args, entry] + args
    # Also not transformer-engine's attention switches: megatron-core sets them in the process
    # that builds a model (in-process tests here) and a launch's build would assert on them.
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
           and k not in ATTENTION_SWITCHES}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    env.update(extra_env or {})
    proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + timeout
    out_lines: List[str] = []
    try:
        if on_line is not None:
            for line in proc.stdout:  # stream so the callback can react (e.g. send SIGTERM)
                out_lines.append(line)
                on_line(line, proc)
                if time.time() > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout)
            stdout_rest, stderr = proc.communicate(timeout=max(1.0, deadline - time.time()))
        else:
            stdout_rest, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        stdout_rest, stderr = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{''.join(out_lines)}"
                             f"{stdout_rest}\n{stderr}")
    return Run(proc.returncode, "".join(out_lines) + (stdout_rest or ""), stderr or "")


def spawn_ranks(fn: Callable, nprocs: int, args: tuple, bound_s: float = 120.0) -> None:
    """`fn(rank, *args)` in `nprocs` spawned processes (gloo ranks of a test), joined; fails the
    test, killing them, if they are not done within `bound_s` (a bound for a hang, never a timing
    assertion: one rank waiting in a collective the others never joined)."""
    import pytest
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, nprocs=nprocs, join=False, args=args)
    deadline = time.monotonic() + bound_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail("the ranks hung (one waited in a collective another never joined)")


def send_sigterm_to_tree(proc: subprocess.Popen) -> None:
    try:
        for p in [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True):
            p.send_signal(signal.SIGTERM)
    except psutil.NoSuchProcess:
        pass


def assert_close(actual: Dict[int, str], expected: Dict[int, str], rel: float = 2e-5) -> None:
    """Per-iteration values agree to fp32 reduction-order tolerance (printed with 7 digits)."""
    assert sorted(actual) == sorted(expected), (actual, expected)
    for it in expected:
        a, e = float(actual[it]), float(expected[it])
        assert abs(a - e) <= rel * abs(e), f"iteration {it}: {a} vs {e}"


def copy_checkpoints(src_root, iterations, latest, dst_root) -> str:
    """A --load root holding copies of `iterations` with the tracker at `latest` (as if the run
    had stopped there)."""
    for it in iterations:
        name = f"iter_{it:07d}"
        shutil.copytree(os.path.join(src_root, name), os.path.join(dst_root, name))
    with open(os.path.join(dst_root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(latest))
    return str(dst_root)


def after(values: Dict[int, str], iteration: int) -> Dict[int, str]:
    """The per-iteration values logged after `iteration`."""
    return {k: v for k, v in values.items() if k > iteration}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One torchrun agent of a multi-node job on this machine (`--nnodes N --node-rank R`, c10d
    rendezvous at 127.0.0.1:port); its output goes to files under `logdir`."""

    def __init__(self, node_rank: int, nnodes: int, nproc: int, port: int, args: List[str],
                 logdir: Path, extra_env: Optional[Dict[str, str]] = None):
        self.out_path = Path(logdir) / f"node{node_rank}.out"
        self.err_path = Path(logdir) / f"node{node_rank}.err"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
               f"--node-rank={node_rank}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=datastates-test", ENTRY] + args
        env = {k: v for k, v in os.environ.items()
               if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
        env.update(extra_env or {})
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=out, stderr=err,
                                         start_new_session=True)

    def stdout(self) -> str:
        return self.out_path.read_text()

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.time() + timeout
        while text not in self.stdout():
            if self.proc.poll() is not None or time.time() > deadline:
                raise AssertionError(f"{text!r} not printed: {self.result().describe()}")
            time.sleep(0.2)

    def wait_for_tracker(self, root, iteration: int, timeout: float) -> None:
        """Until the tracker of `root` names `iteration` or a later one. A commit's log line is
        printed by the poll that settles it, which never comes while training is held (a fault
        point, on purpose): the tracker, written by the commit thread, is what a kill waits for."""
        tracker, deadline = Path(root) / "latest_checkpointed_iteration.txt", time.time() + timeout
        while not (tracker.is_file() and int(tracker.read_text() or -1) >= iteration):
            if self.proc.poll() is not None or time.time() > deadline:
                raise AssertionError(f"the tracker of {root} never reached {iteration}: "
                                     f"{self.result().describe()}")
            time.sleep(0.2)

    def kill(self) -> None:
        _kill_tree(self.proc)

    def result(self, timeout: float = 0.0) -> Run:
        """Wait up to `timeout` s for the agent, kill what is left, return its output."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        _kill_tree(self.proc)
        self.proc.wait()
        return Run(self.proc.returncode, self.stdout(), self.err_path.read_text())


def convert_in_process(*args) -> subprocess.CompletedProcess:
    """tools/convert_checkpoint.py's main in this process, stdout and stderr captured: a
    subprocess spends ~2 s importing megatron-core before it starts. For the subcommands that
    start no process of their own with a spawn context (not to-torch-dist, whose writer's spawned
    Manager re-imports __main__), and refusals that come before any is started."""
    import contextlib
    import io

    sys.path.insert(0, str(REPO))
    try:
        from tools import convert_checkpoint
    finally:
        sys.path.remove(str(REPO))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = convert_checkpoint.main([str(a) for a in args])
    return subprocess.CompletedProcess(list(args), rc, out.getvalue(), err.getvalue())

