"""Merging committed checkpoints into universal ones in a separate, low-priority process.

Policy (`MergeQueue.LATEST`): at most one merge process runs; a commit that arrives meanwhile
waits as the single pending job, and a newer one replaces it (the replaced iteration is reported
as skipped). So merges never pile up, and the newest checkpoint is always merged eventually.

Call order (one process, e.g. rank 0 of the trainer):
  1) `on_commit(iteration, directory)` after each checkpoint is committed (every N-th is merged);
  2) `poll()` now and then (e.g. every iteration): takes the workers' answers and the files
     thread's results (below), starts the pending merge when the running one is done (a merge in
     parts sends its requests at the poll after its announcement is made);
  3) `wait()` before exiting: lets the running and the pending merge finish, stops the workers.
Retention asks `iterations_in_use()` (any time) which sources it must keep.
The merges run in `MergerConfig.workers` persistent worker processes
(``nice -n <nice> [ionice -c 3] python -m datastates.megatron_adapter.merge.worker``, see
worker.py),
each started once per run at its first merge and fed requests through a pipe: processes, not
threads, so their reads, copies and writes never hold the trainer's GIL, and the scheduler gives
them only the CPU and disk time training leaves idle. With one worker it merges and commits; with
several, each writes its part of the tensors, and once all parts are durable worker 0 commits
(universal/parts.py); a worker that fails or dies fails the merge, whose temporary directory is
removed, and is started again for the next one. With `MergerConfig.nodes` > 1 every node runs
a merger and its workers: node 0's decides and commits, the others follow it (nodes.py;
a follower's `on_commit` only records the commit, its `poll` finds the merges node 0
announced). Workers exit with the trainer: at `wait()`/`close()`, at the end of their input, and
when the trainer is killed (PR_SET_PDEATHSIG, and a watchdog on the parent's pid).

The merger's own reads and writes under the universal root (a merge's announcement and the
removal of stale temporaries, the other nodes' parts watched while node 0 waits for them, the
announcements a follower looks for, failure reports, the telemetry line) run on one thread of
its own, in order (`_io`): on a shared file system each is a metadata round trip, and `on_commit`
and `poll` run on the training thread. What depends on a result runs back on the polling thread
(posted into the answers' queue, like the workers' answers), so every state change stays there.
"""
from __future__ import annotations

import concurrent.futures
import enum
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set

from ...universal import remove_stale_temporaries
from . import nodes as merge_nodes
from .run import TELEMETRY_FILE
from ..paths import checkpoint_dir


def die_with_parent() -> None:
    """In a child of the trainer (the merge child before exec; megatron's results-queue Manager):
    SIGKILL it when the trainer process dies (Linux PR_SET_PDEATHSIG), so a crashed or killed
    rank never leaves it running. A merge killed this way leaves only a .tmp- directory (see
    writer.py); the next merge removes it."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the merge then finishes on its own


#: A follower remembers this many committed iterations not yet merged (node 0 merges the newest).
_FOLLOWER_KNOWS = 64
#: The answers' queue index of a continuation posted by the merger's files thread (`_io`).
_FILES = -1


def worker_command(nice: Optional[int] = None, idle_io: bool = False) -> List[str]:
    """The command line of a merge worker, at niceness `nice` and in the idle I/O class when
    asked for (and the tools are installed)."""
    prefix = ["nice", "-n", str(nice)] if nice is not None and shutil.which("nice") else []
    if idle_io and shutil.which("ionice"):
        prefix += ["ionice", "-c", "3"]
    return prefix + [sys.executable, "-m", "datastates.megatron_adapter.merge.worker"]


class MergeQueue(str, enum.Enum):
    """What happens to a commit that arrives while a merge runs."""

    LATEST = "latest"  # keep only the newest waiting commit (queue of one)


@dataclass(frozen=True)
class MergerConfig:
    root: str
    """Universal root: ``<root>/iter_XXXXXXX`` checkpoints, its own tracker and telemetry."""
    every_n: int = 1
    """Merge every N-th committed checkpoint."""
    nice: int = 19
    """Niceness of the merge process (19 = lowest CPU priority)."""
    idle_io: bool = True
    """Run the merge in the idle I/O class (``ionice -c 3``) when ionice is installed."""
    max_file_bytes: int = 2 << 30
    """Split the universal safetensors files at this size."""
    max_bytes_per_s: Optional[float] = None
    """Throttle the merge's throughput (None: as fast as the low priority allows)."""
    queue: MergeQueue = MergeQueue.LATEST
    """Policy for commits that arrive while a merge runs."""
    workers: int = 1
    """Merge workers (of this node): each writes the safetensors files of its share of the
    tensors, and worker 0 of node 0 commits the manifest once every part is durable
    (universal/parts.py)."""
    nodes: int = 1
    """Nodes that merge, each with its own merger and `workers` workers (nodes.py)."""
    node: int = 0
    """This merger's node: 0 decides what is merged and commits, the others follow."""
    run_id: str = ""
    """The same on every node of one run and new each run (names the shared temporary
    directories; empty: this process's pid, for a single node)."""
    remote_timeout_s: float = 1800.0
    """Node 0 fails a merge when no other node's part became durable for this long (a node that
    died without saying so)."""

    @property
    def parts(self) -> int:
        return self.nodes * self.workers


@dataclass
class _Job:
    iteration: int
    source: str
    output: str
    started: float = field(default_factory=time.time)
    tmp: str = ""
    waiting: Set[int] = field(default_factory=set)  # workers whose answer is due
    # Node 0, once its own parts are durable: since when it waits for the others' (reset at each
    # new part record), and how many part records it has seen.
    remote_since: Optional[float] = None
    parts_seen: int = 0
    reading: bool = False  # node 0: a look at the other nodes' parts is on the files thread
    read_at: float = 0.0  # node 0: when the last look began
    committing: bool = False
    error: Optional[str] = None


class _Worker:
    """One persistent merge worker process (worker.py) and the thread that forwards its
    answers to the merger's queue ((index, answer), or (index, None) when it exits)."""

    def __init__(self, index: int, command: List[str], log_path: str, answers: queue.Queue,
                 log_mode: str):
        self.index = index
        # One thread of each math library: the merge copies bytes, it must not compete with
        # training for both cores.
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        self.log_path = log_path
        with open(log_path, log_mode) as log:
            self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, env=env, text=True, bufsize=1,
                                         preexec_fn=die_with_parent)
        self.alive = True
        threading.Thread(target=self._pump, args=(answers,), daemon=True,
                         name=f"merge-worker-{index}").start()

    def _pump(self, answers: queue.Queue) -> None:
        for line in self.proc.stdout:
            answers.put((self.index, json.loads(line)))
        answers.put((self.index, None))

    def send(self, request: dict) -> None:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def close(self, timeout: float = 30.0) -> None:
        try:
            self.proc.stdin.close()  # the worker exits at the end of its input
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class BackgroundMerger:
    def __init__(self, config: MergerConfig, log: Callable[[str], None] = print):
        self.config = config
        self.log = log
        self.run_id = config.run_id or str(os.getpid())
        self.commits = 0
        self.running: Optional[_Job] = None
        self.pending: Optional[_Job] = None
        self.results: List[dict] = []  # node 0: the merges it committed
        self.parts_written = 0  # the merges this node wrote its parts of
        self.workers: List[_Worker] = []
        self.worker_starts = 0  # interpreter starts in this run (one per worker unless one died)
        self._answers: queue.Queue = queue.Queue()
        self._committed: Dict[int, str] = {}  # a follower: iteration -> source, not yet merged
        self._looked = 0.0
        self._looking = False  # a follower: a look for announcements is on the files thread
        self._files: Optional[concurrent.futures.ThreadPoolExecutor] = None  # (`_io`)
        os.makedirs(config.root, exist_ok=True)

    @property
    def follows(self) -> bool:
        return self.config.node > 0

    def output_dir(self, iteration: int) -> str:
        return checkpoint_dir(self.config.root, iteration)

    # 1) ---------------------------------------------------------------------------------------
    def on_commit(self, iteration: int, directory: str) -> None:
        if self.follows:  # node 0 decides which of them are merged
            self._committed[iteration] = directory
            for old in sorted(self._committed)[:-_FOLLOWER_KNOWS]:
                del self._committed[old]
            return
        self.commits += 1
        if self.commits % self.config.every_n:
            return
        job = _Job(iteration, directory, self.output_dir(iteration))
        if self.running is None:
            self._start(job)
            return
        if self.pending is not None:
            self.log(f" universal merge iteration {self.pending.iteration:8d} | skipped: "
                     f"iteration {iteration} committed while a merge was running")
            self._record({"iteration": self.pending.iteration, "skipped_for": iteration})
        self.pending = job

    # 2) ---------------------------------------------------------------------------------------
    def poll(self) -> None:
        while True:
            try:
                index, answer = self._answers.get_nowait()
            except queue.Empty:
                break
            self._on_answer(index, answer)
        job = self.running
        if job is not None and job.remote_since is not None and not job.committing:
            self._check_parts(job)
        if self.running is None and self.pending is not None:
            self._start(self.pending)  # running before it stops waiting: `iterations_in_use`
            self.pending = None
        if self.running is None and self.follows:
            self._look_for_job()

    def iterations_in_use(self) -> List[int]:
        """The sources of the running and the waiting merge, which retention must keep: the
        merge workers hold their source (`fileio.hold_for_reading`) only once they started."""
        # Called on rank 0's commit thread while `poll` may move the waiting merge to running:
        # the waiting one is read first and `poll` makes it the running one before it stops
        # waiting, so a merge on its way is seen in one of the two.
        pending, running = self.pending, self.running
        return [job.iteration for job in (running, pending) if job is not None]

    # 3) ---------------------------------------------------------------------------------------
    def wait(self) -> None:
        """Let the running and the waiting merge finish, then stop the workers (the trainer
        calls it at exit: no merge process outlives the run). Node 0 then tells the followers
        that no merge follows; a follower serves merges until it is told so."""
        if self.follows:
            self._serve_until_done()
        else:
            self.drain()
            if self.config.nodes > 1:
                merge_nodes.mark_done(self.config.root, self.run_id)
        self.close()

    def drain(self) -> None:
        """Let the running and the waiting merge finish; the workers stay, for the next."""
        while self.running is not None or self.pending is not None:
            self._next_answer()
            self.poll()

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.workers = []
        if self._files is not None:  # what it still has to write (telemetry, removals)
            self._files.shutdown(wait=True)
            self._files = None

    def _io(self, work: Callable[[], object],
            then: Optional[Callable[[object, Optional[BaseException]], None]] = None) -> None:
        """`work` on the files thread, after what was handed to it before; `then(result, error)`
        afterwards on the polling thread (the next `poll`), or, without `then`, an error only
        said."""
        if self._files is None:
            self._files = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"datastates-merge-files-{self.config.node}")

        def run() -> None:
            try:
                result, error = work(), None
            except Exception as err:  # a failed read or write fails its merge, not training
                result, error = None, err
            if then is not None:
                self._answers.put((_FILES, lambda: then(result, error)))
            elif error is not None:
                self.log(f" universal merge node {self.config.node}: {error}")

        self._files.submit(run)

    # -- internals -----------------------------------------------------------------------------
    def _next_answer(self) -> None:
        if self.running is None:
            return
        try:  # short waits: node 0 also polls the other nodes' parts meanwhile
            self._on_answer(*self._answers.get(timeout=0.1))
        except queue.Empty:
            pass

    def _serve_until_done(self) -> None:
        marker = merge_nodes.done_marker(self.config.root, self.run_id)
        last = time.time()
        while not (self.running is None and os.path.exists(marker)):
            busy = self.running is not None
            self._next_answer()
            self.poll()
            if busy or self.running is not None:
                last = time.time()
            elif time.time() - last > self.config.remote_timeout_s:
                self.log(f" universal merge node {self.config.node}: node 0 did not say that "
                         f"its merges are done within {self.config.remote_timeout_s:.0f} s; "
                         f"stopping this node's merge workers")
                return
            if self.running is None:
                time.sleep(0.1)

    def _command(self) -> List[str]:
        return worker_command(self.config.nice, self.config.idle_io)

    def _worker(self, k: int) -> _Worker:
        """Worker `k`, started at its first use (again only if it died)."""
        while len(self.workers) <= k:
            self.workers.append(None)
        if self.workers[k] is None or not self.workers[k].alive:
            logs = os.path.join(self.config.root, "merge_logs")
            os.makedirs(logs, exist_ok=True)
            name = f"node-{self.config.node}-worker-{k}" if self.follows else f"worker-{k}"
            # A run's first worker k starts its log afresh; a restarted one appends to it.
            self.workers[k] = _Worker(k, self._command(), os.path.join(logs, f"{name}.log"),
                                      self._answers, "a" if self.workers[k] else "w")
            self.worker_starts += 1
        return self.workers[k]

    def _request(self, job: _Job, **fields) -> dict:
        c = self.config
        return dict(fields, id=job.iteration, source=job.source, output=job.output,
                    root=c.root, max_file_bytes=c.max_file_bytes,
                    max_bytes_per_s=c.max_bytes_per_s / c.workers if c.max_bytes_per_s else None)

    def _start(self, job: _Job) -> None:
        job.started = time.time()
        self.running = job
        c = self.config
        if c.parts == 1:
            job.waiting = {0}
            self._send(job, 0, self._request(job, op="merge"))
            return
        if not self.follows:
            job.tmp = merge_nodes.job_tmp(job.output, self.run_id)

            def announce() -> None:
                remove_stale_temporaries(job.output)
                merge_nodes.remove_leftovers(c.root, self.run_id)
                merge_nodes.announce(job.tmp, merge_nodes.Job(job.iteration, c.parts))

            def announced(_, error: Optional[BaseException]) -> None:
                if error is not None:
                    job.error = f"cannot create {job.tmp}: {error}"
                    self._finish(job, {})
                else:
                    self._send_parts(job)

            self._io(announce, announced)  # running meanwhile: `iterations_in_use` keeps it
            return
        self._send_parts(job)

    def _send_parts(self, job: _Job) -> None:
        c = self.config
        job.waiting = set(range(c.workers))
        for k in range(c.workers):
            self._send(job, k, self._request(job, op="part", tmp=job.tmp, create=False,
                                             part=c.node * c.workers + k, parts=c.parts))

    def _look_for_job(self) -> None:
        """A follower: start its parts of the merge node 0 announced, if any (see
        nodes.py); looks at most every 0.2 s, on the files thread."""
        if not self._committed or self._looking or time.time() - self._looked < 0.2:
            return
        self._looked, self._looking = time.time(), True  # (every 0.2 s from its start)
        committed = dict(self._committed)

        def look():
            for it in sorted(committed, reverse=True):
                output = self.output_dir(it)
                tmp = merge_nodes.job_tmp(output, self.run_id)
                job = _Job(it, committed[it], output, tmp=tmp)
                try:
                    found = merge_nodes.announced(tmp, it)
                except Exception as err:  # a damaged announcement fails that merge only
                    found, job.error = None, str(err)
                if found is not None or job.error is not None:
                    return job, found
            return None

        def seen(result, error: Optional[BaseException]) -> None:
            self._looking = False
            if error is not None:
                self.log(f" universal merge node {self.config.node}: cannot look for node 0's "
                         f"merges: {error}")
            elif result is not None and self.running is None:
                self._take_job(*result)

        self._io(look, seen)

    def _take_job(self, job: _Job, announced) -> None:
        """A follower: the merge node 0 announced (`announced`), or one whose announcement
        could not be read (`job.error`)."""
        for old in [i for i in self._committed if i <= job.iteration]:
            del self._committed[old]
        if announced is not None and announced.parts != self.config.parts:
            job.error = (f"node 0 split the merge into {announced.parts} parts, this node "
                         f"expected {self.config.parts} ({self.config.nodes} nodes of "
                         f"{self.config.workers} workers): every node must be given the "
                         f"same --universal-merge-workers")
        if job.error is not None:
            self.running = job
            self._finish(job, {})
        else:
            self._start(job)

    def _send(self, job: _Job, k: int, request: dict) -> None:
        try:
            self._worker(k).send(request)
        except OSError as err:  # died between two requests: its pump reports it
            job.error = job.error or f"worker {k} could not take the request: {err}"

    def _on_answer(self, index: int, answer) -> None:
        if index == _FILES:  # a continuation of the files thread's work (`_io`)
            answer()
            return
        job = self.running
        if answer is None:
            self.workers[index].alive = False
            self.workers[index].proc.wait()
            if job is None or index not in job.waiting:
                return
            answer = {"ok": False, "error": f"merge worker {index} exited (code "
                                            f"{self.workers[index].proc.returncode})"}
        if job is None or index not in job.waiting:
            return
        job.waiting.discard(index)
        if not answer.get("ok"):
            job.error = job.error or answer.get("error", "failed")
        if job.waiting:
            return
        if job.error is None and job.tmp and not job.committing and not self.follows:
            job.remote_since = time.time()  # own parts durable: now every node's
            self._check_parts(job)
            return
        self._finish(job, answer)

    def _check_parts(self, job: _Job) -> None:
        """Node 0, its own parts durable: a look at every node's, on the files thread (one at a
        time, at most every 0.2 s; `_parts_seen` follows)."""
        if job.reading or time.time() - job.read_at < 0.2:
            return
        job.reading, job.read_at = True, time.time()
        self._io(lambda: merge_nodes.progress(job.tmp),
                 lambda seen, error: self._parts_seen(job, seen, error))

    def _parts_seen(self, job: _Job, seen, error: Optional[BaseException]) -> None:
        """Node 0: commit once every node's parts are durable, fail on a failure."""
        job.reading = False
        if job is not self.running or job.committing:
            return
        c = self.config
        if error is not None:
            job.error = f"cannot read the parts in {job.tmp}: {error}"
            self._finish(job, {})
            return
        missing = sorted(set(range(c.parts)) - set(seen.done))
        if len(seen.done) > job.parts_seen:
            job.parts_seen, job.remote_since = len(seen.done), time.time()
        if seen.failures:
            job.error = "; ".join(seen.failures)
        elif missing and time.time() - job.remote_since > c.remote_timeout_s:
            nodes = sorted({p // c.workers for p in missing})
            job.error = (f"parts {missing} (of node(s) {nodes}) not durable: no node's part "
                         f"became durable for {c.remote_timeout_s:.0f} s")
        elif missing:
            return
        if job.error is not None:
            self._finish(job, {})
            return
        job.committing = True

        def withdrawn(_, error: Optional[BaseException]) -> None:
            if error is not None:
                job.error = f"cannot withdraw the announcement in {job.tmp}: {error}"
                self._finish(job, {})
                return
            job.waiting = {0}
            self._send(job, 0, self._request(job, op="commit", tmp=job.tmp, parts=c.parts,
                                             nodes=c.nodes, started=job.started))

        self._io(lambda: merge_nodes.withdraw(job.tmp), withdrawn)

    def _finish(self, job: _Job, answer: dict) -> None:
        self.running = None
        wall = time.time() - job.started
        if job.error is None and self.follows:
            self.parts_written += 1
            self.log(f" universal merge iteration {job.iteration:8d} | node {self.config.node}: "
                     f"parts of {self.config.workers} worker(s) durable | process (s): {wall:.1f}")
            return
        if job.error is None:
            result = dict(answer["result"], process_s=round(wall, 3))
            # The merge's own line times reading and writing; process (s) adds the wait for
            # CPU at low priority (and, for the first merge of a run, the worker's start-up).
            self.log(f"{answer['line']} | process (s): {wall:.1f}")
            self.results.append(result)
            self.parts_written += 1
            return
        logs = ", ".join(w.log_path for w in self.workers if w is not None)
        if self.follows:  # node 0 fails the merge and removes its directory
            error = job.error
            self._io(lambda: merge_nodes.report_failure(job.tmp, self.config.node, error))
            self.log(f" universal merge iteration {job.iteration:8d} | node "
                     f"{self.config.node}: FAILED, see {logs}: {job.error}")
            return
        if job.tmp:  # nothing of a failed merge is kept
            self._io(lambda: shutil.rmtree(job.tmp, ignore_errors=True))
        self.log(f" universal merge iteration {job.iteration:8d} | FAILED, see {logs}: "
                 f"{job.error}")
        self._record({"iteration": job.iteration, "error": job.error, "log": logs})

    def _record(self, doc: dict) -> None:
        line = json.dumps(dict(doc, time=time.time())) + "\n"

        def append() -> None:
            with open(os.path.join(self.config.root, TELEMETRY_FILE), "a") as f:
                f.write(line)

        self._io(append)

