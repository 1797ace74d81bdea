"""The save worker: a steady save's work off the training thread, during the next forward/backward.

Parameters and optimizer state do not change between optimizer step i and step i+1, so a save of
iteration i needs nothing from the training thread but what the next forward/backward changes
(the RNG states, which the caller captures in its save call). A level that saves every iteration
(the in-memory one, or --save with --save-interval 1) otherwise costs the training thread its
whole save call each iteration (~4-5 ms for the 117M GPT on our CPU: the sharded state dict, the
plan check, the payload, the engine's call), which at GPU speed (~45 ms per iteration) is most of
what a 1.05x budget allows.
`SaveWorker` runs such work on one thread of its own instead; the training thread joins it right
before the optimizer step, where it waits for the snapshot's copies anyway, and then hands it an
in-memory version's agreement and commit (collectives: at scale, rounds over every rank), which
it makes during the optimizer step, joined by the next save call.

Rules that keep every rank in step (the checkpointer follows them; see `LazyCheckpointer`):

- One job at a time, in order: jobs run on one thread, in the order they were submitted.
- The control plane is used by one thread at a time: while a job is in flight (submitted and
  not yet joined), the training thread issues no checkpoint collective; what it would issue
  meanwhile (the end-of-iteration poll) is submitted after the job instead, and any other use of
  the group on the training thread joins the worker first. Whether work is
  submitted depends only on what every rank agreed on, so every rank's jobs issue the same
  collectives in the same order.
- A job that raises stops the jobs after it (the training thread would not have gone on either);
  `join` raises its exception, once.
- What a job says (log lines, records) is said on the training thread, at the join, in order:
  the trainer's own lines are never interleaved with them.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, List, Optional

from ...devices import use_device

__all__ = ["SaveWorker"]


class SaveWorker:
    """One thread for the checkpointer's offloaded jobs (see module doc)."""

    def __init__(self, name: str = "datastates-save", device: Optional[int] = None) -> None:
        """`device`: the CUDA device the jobs run on (`devices.creator_device()` of the training
        thread; None without CUDA)."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                                        initializer=use_device, initargs=(device,))
        self._jobs: List[Future] = []
        self._held: List[Callable[[], None]] = []  # calls for the training thread, in order
        self._held_lock = threading.Lock()
        self._error: Optional[BaseException] = None
        self._on_worker = threading.local()

    @property
    def in_flight(self) -> bool:
        """Whether a job was submitted and not yet joined (not whether it still runs): the same
        on every rank that submitted the same jobs."""
        return bool(self._jobs)

    def on_worker(self) -> bool:
        """Whether the caller is this worker's thread (inside a job)."""
        return getattr(self._on_worker, "active", False)

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.append(self._pool.submit(self._run, job))

    def _run(self, job: Callable[[], None]) -> None:
        if self._error is not None:
            return  # an earlier job raised: `join` raises it; nothing after it runs
        self._on_worker.active = True
        try:
            job()
        except BaseException as err:  # noqa: BLE001 - raised by `join` on the training thread
            self._error = err
        finally:
            self._on_worker.active = False

    def join(self) -> None:
        """Training thread: wait for every job submitted, say what they said (`spoken`), then
        raise the first job's exception, if one raised."""
        jobs, self._jobs = self._jobs, []
        for job in jobs:
            job.result()  # `_run` keeps the job's exception: this only waits
        with self._held_lock:
            held, self._held = self._held, []
        err, self._error = self._error, None
        try:
            for call in held:
                call()
        finally:
            if err is not None:
                raise err

    def spoken(self, fn: Callable[..., None]) -> Callable[..., None]:
        """`fn` (a log line, a record for the trainer), called at once, except inside a job:
        there it is held, and called on the training thread at the next `join`."""
        def call(*args, **kwargs) -> None:
            if not self.on_worker():
                fn(*args, **kwargs)
                return
            with self._held_lock:
                self._held.append(lambda: fn(*args, **kwargs))

        return call

    def close(self) -> None:
        """After the last `join`: the thread ends."""
        self._pool.shutdown(wait=True)
