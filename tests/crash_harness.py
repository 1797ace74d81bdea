"""Crash trials: SIGKILL a training job (or one of its ranks) inside a checkpoint phase, restart it
with --load, and check it resumes from the newest complete checkpoint with bit-identical losses.

Used by tests/test_faults_crash.py (a few trials) and benchmarks/crash_trials.py (many).

A chain of launches shares one --save/--load directory. Every launch but the last is killed: its
plan names a phase (see datastates/faults.py) and a step; the launch runs with
DATASTATES_FAULT_DELAY_<PHASE>=<delay>@<step>, the harness waits for the fault line on stderr and
SIGKILLs at a seeded moment inside the pause. The next launch of the chain is the restart.
Phase "random" uses no pause: the kill lands a seeded time after the loss line of the step.
"""
from __future__ import annotations

import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import psutil

from trainer_launch import ENTRY, REPO, TINY_MODEL

PHASES = ("copy", "flush", "commit", "tracker", "random")
MERGE = "merge"  # needs the universal merge (--universal-checkpoint-interval); opt-in
VICTIMS = ("job", "rank")
TRACKER = "latest_checkpointed_iteration.txt"
_LOSS = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? lm loss: (\S+) \|")
_LOADED = re.compile(r"loaded checkpoint \S+ \(format \S+, iteration (\d+);")
_FAULT = re.compile(r"^DATASTATES_FAULT phase=(\w+) step=(\d+) rank=(\d+)")


#: --memory: an in-memory version every iteration, --save every this many.
MEMORY_PERSISTENT_INTERVAL = 4


def trial_args(train_iters: int, universal: bool = False, memory: bool = False) -> List[str]:
    """DP2 with the distributed optimizer and dropout on (so RNG restore matters), a checkpoint
    every iteration with --async-lazy-save (and a universal merge after each commit). With
    `memory`: the in-memory level every iteration and --save every MEMORY_PERSISTENT_INTERVAL."""
    every = (["--save-interval", str(MEMORY_PERSISTENT_INTERVAL), "--non-persistent-ckpt-type",
              "in_memory", "--non-persistent-save-interval", "1"] if memory
             else ["--save-interval", "1"])
    return TINY_MODEL + ["--train-iters", str(train_iters), "--eval-interval", "0",
                         "--use-distributed-optimizer", "--async-lazy-save"] + every + (
                             ["--universal-checkpoint-interval", "1"] if universal else [])


def memory_root(root: str) -> str:
    """The in-memory level's directory of --save `root` on this machine's node 0."""
    from megatron.training.config import shared_memory_dir

    return shared_memory_dir(root, "in_memory/node0")


@dataclass
class Plan:
    phase: str
    step: int
    victim: str  # "job": the whole process tree; "rank": one worker
    rank: int  # the worker killed when victim == "rank"
    frac: float  # where in the pause (or after the loss line, for "random") the kill lands


@dataclass
class Trial:
    plan: Plan
    hit: bool = False  # the kill landed inside the planned phase
    last_iteration: int = 0  # newest loss line printed before the kill
    tracker_after: Optional[int] = None  # what the tracker named after the crash
    resumed_from: Optional[int] = None  # iteration the restart loaded (0: from scratch)
    lost: Optional[int] = None  # iterations the restart had to redo
    bit_identical: Optional[bool] = None  # restart's losses equal the reference
    corrupt: List[str] = field(default_factory=list)  # committed dirs that fail verification


@dataclass
class Launch:
    returncode: Optional[int]
    lines: List[str]

    def losses(self) -> Dict[int, str]:
        return {int(m.group(1)): m.group(2) for line in self.lines
                if (m := _LOSS.search(line))}

    def resumed_from(self) -> Optional[int]:
        for line in self.lines:
            if (m := _LOADED.search(line)):
                return int(m.group(1))
            if "starting from scratch" in line or "training from iteration 0" in line:
                return 0
        return None

    def tail(self, n: int = 60) -> str:
        return "".join(self.lines[-n:])


def _command(nproc: int, args: List[str]) -> List[str]:
    if nproc == 1:
        return [sys.executable, ENTRY] + args
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", ENTRY] + args


def _tree(pid: int) -> List[psutil.Process]:
    try:
        parent = psutil.Process(pid)
        return [parent] + parent.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def kill_tree(pid: int) -> None:
    victims = _tree(pid)
    for p in victims:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=10)


def kill_rank(pid: int, rank: int) -> bool:
    """SIGKILL the worker whose RANK is `rank` (a descendant of the launcher)."""
    for p in _tree(pid)[1:]:
        try:
            if p.environ().get("RANK") == str(rank) and "pretrain_gpt.py" in " ".join(p.cmdline()):
                p.send_signal(signal.SIGKILL)
                return True
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return False


def _spawn(nproc: int, args: List[str], env_extra: Dict[str, str]) -> subprocess.Popen:
    """Start pretrain_gpt.py in its own session, stderr merged into stdout (fault lines)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore",
               TORCHELASTIC_ERROR_FILE="", **env_extra)
    return subprocess.Popen(_command(nproc, args), cwd=str(REPO), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def run_launch(nproc: int, args: List[str], env_extra: Dict[str, str], plan: Optional[Plan],
               delay: float, timeout: float) -> Launch:
    """One launch; with a plan, SIGKILL it inside the planned phase (then reap the tree)."""
    proc = _spawn(nproc, args, env_extra)
    lines: List[str] = []
    q: "queue.Queue[Optional[str]]" = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.append(line)
            q.put(line)
        q.put(None)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    stop_watch = threading.Event()
    if plan is not None and plan.phase == MERGE:
        # The merge process logs to files, not to the job's output: forward its fault line.
        logs = os.path.join(args[args.index("--save") + 1], "universal", "merge_logs")
        threading.Thread(target=_watch_merge_logs, args=(logs, q, lines, stop_watch),
                         daemon=True).start()
    deadline = time.monotonic() + timeout
    try:
        while plan is not None:
            try:
                line = q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"launch timed out after {timeout}s:\n{''.join(lines[-60:])}")
            if line is None:
                break  # ended before the fault point (e.g. past train_iters)
            if _trigger(line, plan):
                wait = plan.frac * (delay if plan.phase != "random" else 0.6)
                time.sleep(wait)
                if plan.victim == "job" or not kill_rank(proc.pid, plan.rank):
                    kill_tree(proc.pid)
                break
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"launch timed out after {timeout}s:\n{''.join(lines[-60:])}")
    finally:
        stop_watch.set()
        kill_tree(proc.pid)  # torchrun's workers may outlive it; leave nothing running
        reader.join(timeout=10)
    return Launch(proc.returncode, lines)


def _watch_merge_logs(logs: str, q: "queue.Queue", lines: List[str], stop: threading.Event):
    """Forward fault lines of merge logs written during this launch (logs of earlier launches in
    the chain hold fault lines too: those must not trigger a kill)."""
    started = time.time()
    seen = set()
    while not stop.is_set():
        for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
            path = os.path.join(logs, name)
            try:
                mtime = os.stat(path).st_mtime
                text = open(path).read() if mtime >= started else ""
            except OSError:
                continue
            for line in text.splitlines(keepends=True):
                if line.startswith("DATASTATES_FAULT") and (name, mtime, line) not in seen:
                    seen.add((name, mtime, line))
                    lines.append(line)
                    q.put(line)
        stop.wait(0.05)


def stream_launch(nproc: int, args: List[str], env_extra: Dict[str, str],
                  on_line: Optional[Callable[[str, subprocess.Popen], None]] = None,
                  timeout: float = 240.0) -> Launch:
    """One launch with stderr merged into stdout (fault lines go to stderr), each line passed to
    `on_line` as it arrives (e.g. to send a signal). The tree is killed on timeout."""
    proc = _spawn(nproc, args, env_extra)
    lines: List[str] = []
    timer = threading.Timer(timeout, kill_tree, (proc.pid,))
    timer.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if on_line is not None:
                on_line(line, proc)
        proc.wait()
    finally:
        timed_out = not timer.is_alive()
        timer.cancel()
        kill_tree(proc.pid)
    assert not timed_out, f"launch timed out after {timeout}s:\n{''.join(lines[-60:])}"
    return Launch(proc.returncode, lines)


def _trigger(line: str, plan: Plan) -> bool:
    if plan.phase == "random":
        m = _LOSS.search(line)
        return bool(m) and int(m.group(1)) == plan.step
    m = _FAULT.match(line)
    if plan.phase == MERGE:  # merges may be skipped (queue of one): any merge will do
        return bool(m) and m.group(1) == MERGE
    return bool(m) and m.group(1) == plan.phase and int(m.group(2)) == plan.step


def fault_env(plan: Optional[Plan], delay: float) -> Dict[str, str]:
    if plan is None or plan.phase == "random":
        return {}
    if plan.phase == MERGE:
        return {"DATASTATES_FAULT_DELAY_MERGE": f"{delay}"}
    return {f"DATASTATES_FAULT_DELAY_{plan.phase.upper()}": f"{delay}@{plan.step}"}


def verify_committed(root: str, shard_by_shard: bool = False) -> List[str]:
    """Every committed iteration directory must read back completely with all checksums; the
    tracker must name a committed one. Returns descriptions of failures. `shard_by_shard`: read
    each saved shard's own box instead of whole tensors (a node-local version holds only its
    node's ranks' shards)."""
    from datastates import CheckpointReader, is_committed

    bad = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not name.startswith("iter_") or not is_committed(path):
            continue
        try:
            with CheckpointReader(path) as reader:
                for key in reader.tensor_keys():
                    if not shard_by_shard:
                        reader.read(key)
                        continue
                    for _, offset, shape in reader.tensor_meta(key).shards:
                        reader.read(key, offset, shape)
                for rank in reader.ranks():
                    reader.load_objects(rank)
            for needed in ("metadata.json", "common.pt"):
                if not os.path.isfile(os.path.join(path, needed)):
                    raise FileNotFoundError(needed)
        except Exception as err:  # noqa: BLE001 - every failure is a finding to report
            bad.append(f"{name}: {err}")
    tracker = os.path.join(root, TRACKER)
    if os.path.isfile(tracker):
        it = int(open(tracker).read().strip())
        if not is_committed(os.path.join(root, f"iter_{it:07d}")):
            bad.append(f"tracker names iteration {it}, which is not committed")
    return bad + verify_universal(os.path.join(root, "universal"))


def verify_universal(root: str) -> List[str]:
    """Every universal checkpoint with a final name (iter_NNNNNNN, not .tmp-) must be committed
    and read back in full; its tracker must name a committed one."""
    if not os.path.isdir(root):
        return []
    from datastates.universal import UniversalCheckpoint

    bad = []
    for name in sorted(os.listdir(root)):
        if not re.fullmatch(r"iter_\d{7}", name):
            continue
        try:
            with UniversalCheckpoint(os.path.join(root, name)) as u:
                for tensor in u.names():
                    u.read(tensor)
        except Exception as err:  # noqa: BLE001 - every failure is a finding to report
            bad.append(f"universal/{name}: {err}")
    tracker = os.path.join(root, TRACKER)
    if os.path.isfile(tracker):
        it = int(open(tracker).read().strip())
        if not os.path.isdir(os.path.join(root, f"iter_{it:07d}")):
            bad.append(f"universal tracker names iteration {it}, which does not exist")
    return bad


def read_tracker(root: str) -> int:
    path = os.path.join(root, TRACKER)
    return int(open(path).read().strip()) if os.path.isfile(path) else 0


def newest_complete(root: str, memory: bool) -> int:
    """The newest iteration a restart may resume from: --save's, or the in-memory level's."""
    return max(read_tracker(root), read_tracker(memory_root(root)) if memory else 0)


def reference_losses(nproc: int, train_iters: int, workdir: str, timeout: float,
                     memory: bool = False) -> Dict[int, str]:
    run = run_launch(nproc, trial_args(train_iters, memory=memory)
                     + ["--save", os.path.join(workdir, "ref")], {}, None, 0.0, timeout)
    losses = run.losses()
    assert run.returncode == 0 and sorted(losses) == list(range(1, train_iters + 1)), run.tail()
    return losses


def make_plan(rng: random.Random, phase: str, start: int, nproc: int,
              victim: Optional[str] = None) -> Plan:
    victim = victim or (rng.choice(VICTIMS) if nproc > 1 else "job")
    return Plan(phase=phase, step=start + rng.randint(1, 3), victim=victim,
                rank=rng.randrange(nproc), frac=rng.uniform(0.1, 0.9))


def run_trials(n_trials: int, workdir: str, seed: int = 0, nproc: int = 2, train_iters: int = 12,
               delay: float = 1.5, phases=PHASES, timeout: float = 300.0,
               victims: Optional[List[str]] = None, log=lambda msg: None,
               memory: bool = False) -> List[Trial]:
    """`n_trials` crashes in chains of launches; phases cycle through `phases` in a seeded order
    (victims through `victims` when given, else seeded). Each restart is checked against an
    uninterrupted reference run of the same flags. `memory`: with the in-memory level (its
    versions are verified like --save's, and restarts may resume from them)."""
    rng = random.Random(seed)
    reference = reference_losses(nproc, train_iters, workdir, timeout, memory)
    trials: List[Trial] = []
    order: List[str] = []
    while len(order) < n_trials:  # rounds of every phase once, each round in a seeded order
        round_ = list(phases)
        rng.shuffle(round_)
        order += round_
    chain, root = 0, None
    crashed: Optional[Trial] = None  # the trial whose restart is the next launch of the chain
    while len(trials) < n_trials:
        start = newest_complete(root, memory) if root else 0
        if root is None or start + 3 >= train_iters:
            if crashed is not None:
                _finish_chain(nproc, root, train_iters, reference, crashed, timeout, memory)
                crashed = None
            chain += 1
            root = os.path.join(workdir, f"chain{chain:03d}")
            os.makedirs(root)
            start = 0
        plan = make_plan(rng, order[len(trials)], start, nproc,
                         victims[len(trials) % len(victims)] if victims else None)
        trial = Trial(plan)
        args = trial_args(train_iters, universal=plan.phase == MERGE, memory=memory) + [
            "--save", root, "--load", root]
        run = run_launch(nproc, args, fault_env(plan, delay), plan, delay, timeout)
        if crashed is not None:
            _record_restart(crashed, run, reference)
        trial.hit = any(_trigger(line, plan) for line in run.lines)
        trial.last_iteration = max(run.losses(), default=start)
        trial.tracker_after = newest_complete(root, memory)
        trial.corrupt = verify_committed(root) + (
            verify_committed(memory_root(root)) if memory and os.path.isdir(memory_root(root))
            else [])
        trials.append(trial)
        crashed = trial
        log(f"trial {len(trials):3d}: {plan.phase:7s} step {plan.step:2d} kill {plan.victim}"
            f"{'' if plan.victim == 'job' else ' ' + str(plan.rank)} | hit {trial.hit} | "
            f"last iteration {trial.last_iteration} | tracker {trial.tracker_after} | corrupt "
            f"{len(trial.corrupt)}")
    if crashed is not None:
        _finish_chain(nproc, root, train_iters, reference, crashed, timeout, memory)
    return trials


def _record_restart(crashed: Trial, run: Launch, reference: Dict[int, str]) -> None:  # noqa
    """`run` restarted after `crashed`: where it resumed, how much was lost, and whether every
    loss it printed (before its own crash, if any) equals the reference."""
    crashed.resumed_from = run.resumed_from()
    crashed.lost = (None if crashed.resumed_from is None
                    else crashed.last_iteration - crashed.resumed_from)
    losses = run.losses()
    # A restart from the last iteration has nothing left to train: nothing to compare.
    nothing_left = crashed.resumed_from == max(reference)
    crashed.bit_identical = (bool(losses) or nothing_left) and \
        all(reference.get(k) == v for k, v in losses.items())


def _finish_chain(nproc: int, root: str, train_iters: int, reference: Dict[int, str],
                  crashed: Trial, timeout: float, memory: bool = False) -> None:
    """Restart without faults to the end: proves the chain's last crash recovers too (with the
    in-memory level, its clean end gives the memory back)."""
    run = run_launch(nproc, trial_args(train_iters, memory=memory)
                     + ["--save", root, "--load", root], {}, None, 0.0, timeout)
    assert run.returncode == 0, run.tail()
    _record_restart(crashed, run, reference)
    crashed.bit_identical = crashed.bit_identical and \
        max(run.losses(), default=crashed.resumed_from) == train_iters
    crashed.corrupt += verify_committed(root)


def summary(trials: List[Trial]) -> str:
    """The figures the crash-trial script prints (and docs/FAULTS.md quotes)."""
    phases = {}
    for t in trials:
        key = f"{t.plan.phase}/{t.plan.victim}"
        phases.setdefault(key, [0, 0])
        phases[key][0] += 1
        phases[key][1] += int(t.hit)
    lost = [t.lost for t in trials if t.lost is not None]
    hist: Dict[int, int] = {}
    for n in lost:
        hist[n] = hist.get(n, 0) + 1
    lines = [
        f"trials: {len(trials)}",
        "phases (planned/victim: trials, kills inside the phase): " + ", ".join(
            f"{k}: {v[0]} ({v[1]} hit)" for k, v in sorted(phases.items())),
        f"corrupt or unloadable committed checkpoints: {sum(len(t.corrupt) for t in trials)}",
        f"restarts that found no checkpoint to resume or failed: "
        f"{sum(1 for t in trials if t.resumed_from is None)}",
        f"restarts that resumed from the newest complete checkpoint (the tracker after the "
        f"crash; with --memory the newer of --save's and memory's): "
        f"{sum(1 for t in trials if t.resumed_from == t.tracker_after)}/{len(trials)}",
        f"restarts with lm loss bit-identical to the uninterrupted run: "
        f"{sum(1 for t in trials if t.bit_identical)}/{len(trials)}",
        "lost iterations per crash (newest iteration printed before the kill minus the "
        "iteration resumed from): " + ", ".join(f"{k}: {v}" for k, v in sorted(hist.items())) +
        (f"; mean {sum(lost) / len(lost):.2f}, max {max(lost)}" if lost else ""),
    ]
    return "\n".join(lines)
