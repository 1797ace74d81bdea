"""When things happen: the asynchronous save pipeline and its life cycle.

Call order, per rank:
  1) `save(state, directory, step)`: small objects are encoded now; tensors are queued for the
     copy threads (live -> host cache), which hand each copied piece to the writer threads
     (host cache -> shard file). Returns a `SaveHandle` at once. With `defer_copies=True` the
     copies are held until `start_copies()` (or the next call of any step here), so that a
     caller with more to do before it returns keeps the GIL to itself meanwhile.
  2) `wait_for_snapshot()`: right before the caller mutates its tensors (optimizer step).
  3) `poll()` now and then, or `wait_for_durable()`: get `SaveRecord`s of finished saves and any
     background error. A save is durable when its shard and index are fsync'd and its rank marker
     is written. With `CommitPolicy.RANK0`, rank 0 also writes the commit marker once every
     rank's marker is there (see `try_commit`).
  4) `close()` (or leaving the `with` block, or interpreter exit): drain and stop.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import queue
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import checksum, devices, layout
from .cache import HostCache
from .config import Checksum, CommitPolicy, EngineConfig, WriteMode
from .errors import CheckpointError
from .faults import fault_point
from .flush import migrate_version_files, write_block, write_version_files
from .mapped import MappedShard, SlotPool, map_new_file
from .job import FILE_ALIGN, SaveHandle, SaveJob, Segment, is_small, plan_layout
from .flatten import FlatState, TensorEntry, flatten_state
from .telemetry import SaveRecord, append_record
from .transfer import Copier, InFlight, iter_pieces

logger = logging.getLogger(__name__)


_STOP = object()
#: Device-to-host copies a copy thread keeps queued on its copy stream before it waits for the
#: oldest (`InFlight`): enough that the copy engine always has the next one.
COPIES_IN_FLIGHT = 4


class CheckpointEngine:
    """Lazy asynchronous checkpointing of one rank's state. Thread-safe for one caller thread.

    `CheckpointEngine(EngineConfig(...))` is this engine. `CheckpointEngine(deepspeed_config,
    rank)`, DeepSpeed's call in its `DataStatesCheckpointEngine`, builds a
    `deepspeed_engine.DeepSpeedCheckpointEngine` on top of one instead (DeepSpeed's file-per-call
    interface; see that module)."""

    def __new__(cls, config: Any = None, rank: Optional[int] = None):
        if cls is CheckpointEngine and not isinstance(config, EngineConfig):
            from .deepspeed_engine import DeepSpeedCheckpointEngine
            return DeepSpeedCheckpointEngine(config, rank)
        return super().__new__(cls)

    def __init__(self, config: EngineConfig):
        self.cfg = config
        # Resolved once; a missing checksum package fails here, not mid-save.
        self._crc = checksum.function(config.checksum)
        if config.local_dir is not None:  # created here only, see save()
            try:
                os.makedirs(config.local_dir, exist_ok=True)
            except OSError as e:
                raise CheckpointError(f"cannot create the node-local directory (level 3): {e}",
                                      rank=config.rank, file=config.local_dir) from e
        self._cond = threading.Condition()
        self._saves: List[SaveJob] = []
        self._errors: List[CheckpointError] = []
        self._uncommitted: List[SaveJob] = []
        self._next_id = 0
        self._closed = False
        self._final_peak = 0
        # Allocated (and its pages touched) once, here, so no save pays for page faults. Pinned
        # whenever CUDA is present, since then the saved tensors normally live on the device.
        self._cache = HostCache(config.host_cache_bytes, pinned=torch.cuda.is_available())
        self._cache.buffer.fill_(0)
        self._cache.add_peak_listener(self._on_cache_use)
        self._copier = Copier(self._cache, crc32c=config.checksum is Checksum.CRC32C)
        self._slots: Optional[SlotPool] = None  # WriteMode.MAPPED with a slot directory
        if config.write_mode is WriteMode.MAPPED and config.mapped_slot_dir is not None:
            try:
                # Registered for DMA under the same rule as the cache is pinned.
                self._slots = SlotPool(config.mapped_slot_dir, config.rank,
                                       config.mapped_slots,
                                       register_with_cuda=torch.cuda.is_available())
            except OSError as e:
                raise CheckpointError(f"cannot prepare the slot directory: {e}",
                                      rank=config.rank, file=config.mapped_slot_dir) from e
        self._copy_q: "queue.Queue" = queue.Queue()
        self._held: List[tuple] = []  # (save, its copy groups) not yet handed to copy threads
        self._marked: Dict[Any, Any] = {}  # `mark_ready`'s CUDA event, for the next save
        self._write_q: "queue.Queue" = queue.Queue()
        self._device = devices.creator_device()  # the copy threads' (a new thread's: GPU 0)
        self._threads = [threading.Thread(target=self._copy_loop, name=f"datastates-copy-{i}",
                                          daemon=True) for i in range(config.copy_threads)]
        self._threads += [threading.Thread(target=self._write_loop, name=f"datastates-write-{i}",
                                           daemon=True) for i in range(config.writer_threads)]
        self._migrate_q: "queue.Queue" = queue.Queue()
        if config.local_dir is not None:
            self._threads.append(threading.Thread(target=self._migrate_loop,
                                                  name="datastates-migrate", daemon=True))
        for t in self._threads:
            t.start()
        atexit.register(self._atexit)

    # ----------------------------------------------------------------- public API
    def save(self, state: Any, directory: str, step: int, *,
             defer_copies: bool = False) -> SaveHandle:
        """Register a snapshot of `state` into version directory `directory` and return at once.
        The tensors must not be mutated until `wait_for_snapshot()` returns. `state` may also be
        a `FlatState`: what `flatten_state` returns for it, made by the caller."""
        t0 = time.perf_counter()
        self._check_open()
        self.start_copies()  # an earlier save's held copies go first
        self._raise_pending()
        if self.cfg.local_dir is not None and not os.path.isdir(self.cfg.local_dir):
            raise self._local_dir_gone()
        layouts = None
        if isinstance(state, FlatState):
            skeleton, entries, layouts = state.skeleton, state.entries, state.layouts
        else:
            skeleton, entries = flatten_state(state, self.cfg.allow_pickle)
        write_dir = (directory if self.cfg.local_dir is None
                     else layout.local_version_dir(self.cfg.local_dir, directory))
        shard_path = os.path.join(write_dir, layout.shard_file(self.cfg.rank))
        with self._cond:
            if any(os.path.abspath(s.handle.directory) == os.path.abspath(directory)
                   and not s.done for s in self._saves):
                raise CheckpointError("a save into this directory is still in flight; wait for it "
                                      "(wait_for_durable) before saving there again",
                                      rank=self.cfg.rank, file=directory)
        mapped = self.cfg.write_mode is WriteMode.MAPPED
        fd = -1
        if mapped:  # the copies land in the file: it exists before they start (in memory)
            self._withdraw(directory, write_dir, shard_path)
        offsets, groups, total = self._layout(entries, layouts)
        mapping = None
        if mapped:
            size = offsets[-1] + entries[-1].nbytes if entries else 0
            try:
                fd, mapping = self._map_shard(shard_path, size)
            except (OSError, RuntimeError) as e:
                raise CheckpointError(f"cannot reserve {size} bytes for the shard file: {e}",
                                      rank=self.cfg.rank, file=shard_path) from e
        with self._cond:
            handle = SaveHandle(self._next_id, int(step), directory)
            self._next_id += 1
            sv = SaveJob(handle, entries, skeleton, shard_path, fd, -1, offsets, total, t0,
                         chunks=[[] for _ in entries])
            sv.write_dir = write_dir
            sv.ready_events = self._record_ready_events(entries)
            if mapped:
                sv.files_open = True
                sv.mapped, sv.mapping = True, mapping
                if mapping is not None:
                    sv.copier = Copier(MappedShard(mapping),
                                       crc32c=self.cfg.checksum is Checksum.CRC32C)
            self._saves.append(sv)
        self._held.append((sv, groups))
        if not defer_copies:
            self.start_copies()
        if not entries:  # nothing to copy: a writer makes its files (`_write_loop`)
            self._write_q.put((sv, None, 0, 0))
        sv.blocked_s += time.perf_counter() - t0
        return handle

    def start_copies(self) -> None:
        """Hand the copies that `save(..., defer_copies=True)` held back to the copy threads.
        Every wait, `poll`, `close` and the next `save` call it too: no snapshot is left
        waiting for it."""
        held, self._held = self._held, []
        for sv, groups in held:
            # One hand-off per copy thread, not per group: each put wakes a thread that then
            # contends for the GIL with the caller.
            n = min(self.cfg.copy_threads, len(groups))
            for k in range(n):
                self._copy_q.put((sv, groups[k::n]))

    def wait_for_snapshot(self, timeout: Optional[float] = None) -> None:
        """Block until every tensor of every pending save is in the host cache (or on disk).
        Raises CheckpointError after `timeout` seconds (None: no limit)."""
        self._wait(lambda: all(s.copied for s in self._saves), timeout=timeout,
                   what="wait_for_snapshot")

    def poll(self) -> List[SaveRecord]:
        """Non-blocking: records of saves that became durable since the last poll/wait; raises a
        pending background error. Rank 0 (CommitPolicy.RANK0) also retries pending commits."""
        self.start_copies()
        self._raise_pending()
        self._retry_commits()
        return self._collect()

    def wait_for_durable(self, handle: Optional[SaveHandle] = None,
                         timeout: Optional[float] = None) -> List[SaveRecord]:
        """Block until `handle`'s save (or every pending save) is durable on this rank. Returns the
        records not yet returned by poll/wait. Raises CheckpointError naming the stuck save after
        `timeout` seconds (None: no limit)."""
        if handle is None:
            self._wait(lambda: all(s.done for s in self._saves), timeout=timeout,
                       what="wait_for_durable")
        else:
            self._wait(lambda: all(s.done for s in self._saves if s.handle is handle),
                       timeout=timeout, what="wait_for_durable")
        self._retry_commits()
        return self._collect()

    def wait_for_commit(self, handle: SaveHandle, timeout: Optional[float] = None) -> bool:
        """Rank 0 helper: wait until `handle`'s version is committed (every rank's marker present);
        returns False on timeout. Other ranks use it to wait for rank 0's commit."""
        self.wait_for_durable(handle)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.cfg.rank == 0 and self.cfg.commit_policy is CommitPolicy.RANK0:
                if layout.try_commit(handle.directory, self.cfg.world_size):
                    self._retry_commits()
                    return True
            elif layout.is_committed(handle.directory):
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.02)

    def close(self, timeout: Optional[float] = None) -> None:
        """Drain in-flight saves, stop the threads; raise a pending error, if any. With `timeout`,
        a drain that takes longer raises CheckpointError naming the stuck save; the hung threads
        are then abandoned (daemon threads: they cannot keep the process alive) and their saves
        never get a marker."""
        if self._closed:
            self._raise_pending()
            return
        stuck = None
        try:
            self._wait(lambda: all(s.done for s in self._saves), raise_errors=False,
                       timeout=timeout, what="close (draining in-flight saves)")
            self._retry_commits()
        except CheckpointError as e:
            stuck = e
        finally:
            self._closed = True
            for _ in range(self.cfg.copy_threads):
                self._copy_q.put(_STOP)
            for _ in range(self.cfg.writer_threads):
                self._write_q.put(_STOP)
            self._migrate_q.put(_STOP)
            atexit.unregister(self._atexit)
            if stuck is None:
                for t in self._threads:
                    t.join()
                self._final_peak = self._cache.peak
                # Give the cache's memory back now, not whenever the engine object is collected.
                self._cache = None
                self._copier = None
                if self._slots is not None:  # every save is done: no copy uses a slot
                    self._slots.close()
        if stuck is not None:
            # Hung threads may still touch the cache: it is kept (not freed) and they are left.
            raise stuck
        self._raise_pending()

    def __enter__(self) -> "CheckpointEngine":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the caller's exception with ours
            try:
                self.close()
            except CheckpointError as e:
                logger.error("DataStates: error while closing after an exception: %s", e)

    @property
    def peak_cache_bytes(self) -> int:
        return self._cache.peak if self._cache is not None else self._final_peak

    # ----------------------------------------------------------------- internals: caller side
    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("the engine is closed", rank=self.cfg.rank)

    def _raise_pending(self) -> None:
        with self._cond:
            if self._errors:
                raise self._errors.pop(0)

    def _wait(self, pred, raise_errors: bool = True, timeout: Optional[float] = None,
              what: str = "wait") -> None:
        self.start_copies()
        t0 = time.perf_counter()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            pending = [s for s in self._saves if not s.done]
            while not pred() and not (raise_errors and self._errors):
                if deadline is not None and time.monotonic() >= deadline:
                    raise self._stuck_error(what, timeout)
                self._cond.wait(0.5 if deadline is None
                                else max(0.01, min(0.5, deadline - time.monotonic())))
        dt = time.perf_counter() - t0
        for s in pending:
            s.blocked_s += dt
        if raise_errors:
            self._raise_pending()

    def _stuck_error(self, what: str, timeout: float) -> CheckpointError:
        """Name the oldest unfinished save and how far it got (called with the lock held)."""
        sv = next(s for s in self._saves if not s.done)
        stage = (f"copied {sv.entries_copied}/{len(sv.entries)} tensors"
                 if not sv.copied else f"wrote {sv.bytes_written}/{sv.total_bytes} bytes"
                 if sv.bytes_written < sv.total_bytes else "all bytes written, fsync/index/marker "
                 "not done")
        return CheckpointError(f"{what} timed out after {timeout:g} s: the save of step "
                               f"{sv.handle.step} is stuck ({stage}); a background copy or writer "
                               "thread is hung (storage not responding?). The version stays "
                               "uncommitted; earlier versions are intact", rank=self.cfg.rank,
                               file=sv.shard_path)

    def mark_ready(self) -> None:
        """Before a `save` made on another thread (e.g. the adapter's save worker, during the
        next forward/backward): records, on the caller's current CUDA stream, the point after
        which the tensors of that save are ready (the optimizer step's kernels are queued before
        it), so that its copies do not also wait for the kernels queued between now and the
        `save`. Without CUDA, nothing."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            dev = torch.device("cuda", torch.cuda.current_device())
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(dev))
            self._marked = {dev: event}

    def _record_ready_events(self, entries: List[TensorEntry]) -> Dict[Any, Any]:
        """Per CUDA device of `entries`, an event after which their tensors are ready: the one
        `mark_ready` recorded for it, else one recorded now on the device's current stream."""
        events, self._marked = self._marked, {}
        for e in entries:
            dev = e.tensor.device
            if e.tensor.is_cuda and dev not in events:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(dev))
                events[dev] = ev
        return events

    def _on_cache_use(self, used: int) -> None:
        for s in list(self._saves):
            if not s.done and used > s.peak_cache:
                s.peak_cache = used

    def _collect(self) -> List[SaveRecord]:
        with self._cond:
            out = [s.record for s in self._saves if s.done and s.record and not s.reported]
            for s in self._saves:
                if s.done and (s.record or s.error):
                    s.reported = True
            self._saves = [s for s in self._saves if not s.reported]
        return out

    def _retry_commits(self) -> None:
        if self.cfg.rank != 0 or self.cfg.commit_policy is not CommitPolicy.RANK0:
            return
        for s in list(self._uncommitted):
            if layout.try_commit(s.handle.directory, self.cfg.world_size):
                self._uncommitted.remove(s)
                logger.info("DataStates: committed step %d in %s", s.handle.step,
                            s.handle.directory)

    def _atexit(self) -> None:
        try:
            self.close()
        except CheckpointError as e:
            logger.error("DataStates: error while draining saves at exit: %s", e)

    # ----------------------------------------------------------------- internals: threads
    def _fail(self, sv: SaveJob, err: CheckpointError) -> None:
        if err.__cause__ is None and sys.exc_info()[1] is not err:
            err.__cause__ = sys.exc_info()[1]  # the OSError behind it tells a full disk apart
        with self._cond:
            if sv.error is None:
                sv.error = err
                self._errors.append(err)
                logger.error("DataStates: save of step %d failed: %s", sv.handle.step, err)
            sv.done = True
            self._cond.notify_all()
        self._release_failed(sv)

    def _release_failed(self, sv: SaveJob) -> None:
        """Close a failed save's files once no thread can still write to them (closing earlier
        would let a late pwrite hit a reused descriptor of another file)."""
        with self._cond:
            if sv.error is not None and sv.copied and sv.inflight == 0:
                self._close_fd(sv)

    def _map_shard(self, path: str, size: int):
        """WriteMode.MAPPED: (write descriptor, shared mapping or None when empty) of the shard
        file at its final size: a free slot of the pool linked there, else a new file."""
        if self._slots is not None:
            taken = self._slots.take(path, size)
            if taken is not None:
                return taken
        return map_new_file(path, size)

    @staticmethod
    def _close_fd(sv: SaveJob) -> None:
        sv.mapping = sv.copier = None  # unmapped once the last view is gone
        if sv.fd >= 0:
            os.close(sv.fd)
            sv.fd = -1
        if sv.dfd >= 0:
            os.close(sv.dfd)
            sv.dfd = -1

    def _withdraw(self, directory: str, write_dir: str, shard_path: str) -> None:
        """Before a save's shard is touched: its directories made, and for an overwritten
        version its commit and this rank's marker withdrawn (durably), so no reader can pair old
        markers with new, partial bytes."""
        try:
            for d in {directory, write_dir}:
                if d == write_dir and self.cfg.local_dir is not None:
                    try:  # in the node-local directory, never recreating it
                        os.mkdir(d)
                    except FileExistsError:
                        pass
                    except FileNotFoundError:
                        raise self._local_dir_gone() from None
                else:
                    os.makedirs(d, exist_ok=True)
                layout.invalidate(d, self.cfg.rank)
        except OSError as e:
            raise CheckpointError(f"cannot create the shard file: {e}", rank=self.cfg.rank,
                                  file=shard_path) from e

    def _local_dir_gone(self) -> CheckpointError:
        # Not recreated: on an unmounted node-local disk that would write into the mount point,
        # on the root file system.
        return CheckpointError("the node-local directory (level 3) disappeared (deleted or "
                               "unmounted); it is not recreated: restore it, or save without it",
                               rank=self.cfg.rank, file=self.cfg.local_dir)

    def _open_files(self, sv: SaveJob) -> None:
        """A writer thread, before a save's first write (or, without tensors, its index): the
        version directory, the markers withdrawn, the shard file created and opened (O_DIRECT
        too in that mode). Not in `save`: on a shared file system each is a round trip to its
        metadata server, which a busy one (every rank creating its files at once) stretches to
        seconds; the caller's thread, and every rank behind it at its next collective, would
        wait for them. Files that cannot be made fail the save like a failed write."""
        with sv.files_lock:
            if sv.files_open:
                return
            self._withdraw(sv.handle.directory, sv.write_dir, sv.shard_path)
            try:
                fd = os.open(sv.shard_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            except OSError as e:
                raise CheckpointError(f"cannot create the shard file: {e}", rank=self.cfg.rank,
                                      file=sv.shard_path) from e
            dfd = (self._open_direct(sv.shard_path) if self.cfg.write_mode is WriteMode.DIRECT
                   else -1)
            with self._cond:
                sv.fd, sv.dfd = fd, dfd
            sv.files_open = True

    def _open_direct(self, path: str) -> int:
        try:
            return os.open(path, os.O_WRONLY | os.O_DIRECT)
        except OSError as e:  # e.g. tmpfs: EINVAL. Buffered writes still work there.
            logger.info("DataStates: O_DIRECT unavailable for %s (%s); writing buffered", path, e)
            return -1

    def _nice(self) -> None:
        if self.cfg.background_nice:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.cfg.background_nice)

    def _layout(self, entries: List[TensorEntry], layouts: Optional[dict]
                ) -> Tuple[List[int], List[List[int]], int]:
        """`plan_layout` of `entries` and their bytes, kept in (and taken from) the caller's
        `layouts` (`FlatState.layouts`), keyed by the piece size and every entry's size in
        order (the objects' tensors, e.g. RNG states, may change between saves of one plan).
        Its lists are shared between saves: nothing changes them."""
        piece = self._max_piece()
        key = (piece, tuple([e.nbytes for e in entries])) if layouts is not None else None
        laid = None if key is None else layouts.get(key)
        if laid is None:
            laid = (*plan_layout(entries, piece), sum(e.nbytes for e in entries))
            if key is not None:
                layouts.clear()  # one layout per plan: the newest
                layouts[key] = laid
        return laid

    def _max_piece(self) -> int:
        if self.cfg.write_mode is WriteMode.MAPPED:  # no cache in between: a checksum per chunk
            return max(FILE_ALIGN, self.cfg.chunk_bytes)
        # Half the cache, so that a copy can fill one half while a writer drains the other.
        return max(FILE_ALIGN, min(self.cfg.chunk_bytes, self._cache.capacity // 2))

    def _copy_loop(self) -> None:
        # Copy threads keep their priority: the training loop waits for them before the next
        # optimizer step, so starving them turns background work into stall.
        devices.use_device(self._device)
        while True:
            item = self._copy_q.get()
            if item is _STOP:
                return
            sv, groups = item
            inflight = InFlight(COPIES_IN_FLIGHT)
            for group in groups:
                self._copy_group(sv, group, inflight)
            inflight.drain()

    def _copy_group(self, sv: SaveJob, group: List[int], inflight: InFlight) -> None:
        """Issue the group's copies into `inflight`, then, once they have landed, count its
        tensors as copied (in that order: `wait_for_snapshot` returns only after)."""
        try:
            if group[0] == 0:
                fault_point("copy", sv.handle.step, self.cfg.rank)
            if sv.error is None:
                if not is_small(sv.entries[group[0]].nbytes, self._max_piece()):
                    self._copy_large(sv, group[0], inflight)
                else:
                    self._copy_bundle(sv, group, inflight)
        except CheckpointError as e:
            self._fail(sv, e)
        except Exception as e:  # noqa: BLE001 - re-raised in the caller as CheckpointError
            self._copy_failed(sv, group[0], e)
        inflight.add((), lambda: self._group_copied(sv, group), None)

    def _copy_failed(self, sv: SaveJob, i: int, err: BaseException) -> None:
        self._fail(sv, CheckpointError(f"copy to host cache failed: {err!r}",
                                       rank=self.cfg.rank, file=sv.shard_path,
                                       tensor=sv.entries[i].key))

    def _group_copied(self, sv: SaveJob, group: List[int]) -> None:
        with self._cond:
            sv.entries_copied += len(group)
            if sv.entries_copied == len(sv.entries):
                sv.t_copied = time.perf_counter()
            for i in group:
                sv.entries[i].tensor = None  # drop our reference to the live tensor
            self._cond.notify_all()
        self._maybe_finalize(sv)
        self._release_failed(sv)

    def _alloc(self, sv: SaveJob, nbytes: int) -> int:
        return self._cache.alloc(nbytes, abort=lambda: sv.error is not None)

    def _hand_over(self, sv: SaveJob, segments: List[Segment], start: int, total: int) -> None:
        with self._cond:
            sv.inflight += 1
        self._write_q.put((sv, segments, start, total))

    def _copy_large(self, sv: SaveJob, i: int, inflight: InFlight) -> None:
        """One big tensor, streamed through the cache in pieces of at most `_max_piece()`."""
        t = sv.entries[i].tensor.detach()  # may be a parameter (see TensorEntry)
        ready = sv.ready_events.get(t.device) if t.is_cuda else None
        for piece, off in iter_pieces(t, self._max_piece()):
            nbytes = piece.numel() * piece.element_size()
            if sv.mapped:  # straight into the shard's pages; the writer only checksums
                start = sv.file_offsets[i] + off
                crc, landed = sv.copier.issue(piece, start, ready)
            else:
                start = self._take_cache(sv, nbytes, inflight)
                try:
                    crc, landed = self._copier.issue(piece, start, ready)
                except BaseException:
                    self._cache.free(start)
                    raise
            self._land(sv, i, [Segment(i, off, nbytes, 0, crc)], start, nbytes,
                       [] if landed is None else [landed], inflight)

    def _copy_bundle(self, sv: SaveJob, group: List[int], inflight: InFlight) -> None:
        """Small tensors packed into one cache block and written with one write, as laid out
        contiguously in the file by `plan_layout`."""
        base = sv.file_offsets[group[0]]
        total = sv.file_offsets[group[-1]] + sv.entries[group[-1]].nbytes - base
        if total == 0:
            return
        start = base if sv.mapped else self._take_cache(sv, total, inflight)
        copier = sv.copier if sv.mapped else self._copier
        segments, events = [], []
        try:
            for i in group:
                e = sv.entries[i]
                if e.nbytes:
                    pos = sv.file_offsets[i] - base
                    ready = sv.ready_events.get(e.tensor.device) if e.tensor.is_cuda else None
                    crc, landed = copier.issue(e.tensor.detach(), start + pos, ready)
                    segments.append(Segment(i, 0, e.nbytes, pos, crc))
                    if landed is not None:
                        events.append(landed)
        except BaseException:
            try:  # copies already queued must land before their block can be reused
                for ev in events:
                    ev.synchronize()
            finally:
                if not sv.mapped:
                    self._cache.free(start)
            raise
        self._land(sv, group[0], segments, start, total, events, inflight)

    def _take_cache(self, sv: SaveJob, nbytes: int, inflight: InFlight) -> int:
        """A host cache block; with none free, the copies in flight are handed over first (only
        handed-over blocks are ever freed, by the writers) and then the cache is waited for."""
        start = self._cache.alloc(nbytes, wait=False)
        if start is None:
            inflight.drain()
            start = self._alloc(sv, nbytes)
        return start

    def _land(self, sv: SaveJob, i: int, segments: List[Segment], start: int, total: int,
              events: List, inflight: InFlight) -> None:
        """Hand the block to a writer once `events` have completed (its bytes are on the host);
        a copy that failed fails the save, and the writer then only frees the block."""
        inflight.add(events, lambda: self._hand_over(sv, segments, start, total),
                     lambda err: self._copy_failed(sv, i, err))

    def _write_loop(self) -> None:
        self._nice()
        while True:
            item = self._write_q.get()
            if item is _STOP:
                return
            sv, segments, start, total = item
            if segments is None:  # a save without tensors
                self._maybe_finalize(sv)
                continue
            try:
                if sv.error is None:
                    self._write_block(sv, segments, start, total)
            except CheckpointError as e:
                self._fail(sv, e)
            except Exception as e:  # noqa: BLE001 - re-raised in the caller as CheckpointError
                self._fail(sv, CheckpointError(f"write failed: {e!r}", rank=self.cfg.rank,
                                               file=sv.shard_path,
                                               tensor=sv.entries[segments[0].entry].key))
            finally:
                if not sv.mapped:
                    self._cache.free(start)
                with self._cond:
                    sv.inflight -= 1
            self._maybe_finalize(sv)
            self._release_failed(sv)

    def _write_block(self, sv: SaveJob, segments: List[Segment], start: int, total: int) -> None:
        self._open_files(sv)
        if sv.t_first_write is None:
            sv.t_first_write = time.perf_counter()
        if sv.mapped:  # the bytes are in the file already: checksum what the copy did not
            view = MappedShard(sv.mapping)
            crcs = [s.crc if s.crc is not None else self._crc(view.memview(start + s.pos,
                                                                          s.nbytes))
                    for s in segments]
        else:
            crcs = write_block(self.cfg, self._crc, self._cache, sv, segments, start, total,
                               self._cond)
        with self._cond:
            for seg, crc in zip(segments, crcs):
                sv.chunks[seg.entry].append([seg.offset, seg.nbytes, crc])
                sv.bytes_written += seg.nbytes

    def _maybe_finalize(self, sv: SaveJob) -> None:
        with self._cond:
            if (sv.finalizing or sv.error is not None or not sv.copied
                    or sv.bytes_written != sv.total_bytes):
                return
            sv.finalizing = True
        try:
            self._finalize(sv)
        except CheckpointError as e:
            self._fail(sv, e)
        except Exception as e:  # noqa: BLE001 - re-raised in the caller as CheckpointError
            self._fail(sv, CheckpointError(f"finalizing the save failed: {e!r}",
                                           rank=self.cfg.rank, file=sv.shard_path))

    def _finalize(self, sv: SaveJob) -> None:
        """Make the save durable on this rank, then commit (rank 0) and publish its record."""
        cfg = self.cfg
        self._open_files(sv)
        t_flush0 = sv.t_first_write or time.perf_counter()
        write_version_files(cfg, sv, self._cond, self._close_fd)
        if cfg.local_dir is not None:
            sv.t_local = time.perf_counter()
            self._migrate_q.put((sv, t_flush0))
            return
        self._publish(sv, t_flush0)

    def _migrate_loop(self) -> None:
        self._nice()
        while True:
            item = self._migrate_q.get()
            if item is _STOP:
                return
            sv, t_flush0 = item
            try:
                migrate_version_files(self.cfg, sv)
                self._publish(sv, t_flush0)
            except CheckpointError as e:
                self._fail(sv, e)
            except Exception as e:  # noqa: BLE001 - re-raised in the caller as CheckpointError
                self._fail(sv, CheckpointError(f"migration to the version directory failed: "
                                               f"{e!r}", rank=self.cfg.rank,
                                               file=sv.handle.directory))

    def _publish(self, sv: SaveJob, t_flush0: float) -> None:
        """The save is durable in its version directory: commit (rank 0), record, wake waiters."""
        cfg = self.cfg
        directory = sv.handle.directory
        t_end = time.perf_counter()
        committed = False
        if cfg.rank == 0 and cfg.commit_policy is CommitPolicy.RANK0:
            committed = layout.try_commit(directory, cfg.world_size)
            if not committed:
                with self._cond:
                    self._uncommitted.append(sv)
        durable_s = t_end - sv.t_start
        record = SaveRecord(
            step=sv.handle.step, directory=directory, rank=cfg.rank, bytes=sv.total_bytes,
            num_tensors=len(sv.entries), blocked_s=sv.blocked_s,
            copy_s=(sv.t_copied or t_end) - sv.t_start, flush_s=t_end - t_flush0,
            durable_s=durable_s, gbps=sv.total_bytes / max(durable_s, 1e-9) / 1e9,
            peak_cache_bytes=sv.peak_cache, committed=committed,
            local_durable_s=None if sv.t_local is None else sv.t_local - sv.t_start)
        append_record(cfg.telemetry_path, record)
        logger.info("DataStates: rank %d step %d durable: %.3f GB in %.3f s (%.2f GB/s), "
                    "caller blocked %.3f s%s", cfg.rank, sv.handle.step, sv.total_bytes / 1e9,
                    durable_s, record.gbps, sv.blocked_s, ", committed" if committed else "")
        with self._cond:
            sv.record = record
            sv.done = True
            sv.skeleton = None
            self._cond.notify_all()
        if cfg.on_durable is not None:
            try:
                cfg.on_durable(sv.handle)
            except Exception:  # noqa: BLE001 - the caller's own bookkeeping, reported here
                logger.exception("DataStates: the on_durable callback failed for %s",
                                 sv.handle.directory)
