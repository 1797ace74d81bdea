"""`LazyCheckpointer`: everything DataStates does inside a Megatron training run, behind four calls.

It owns the engine, the dist_checkpointing save strategy, the agreement across ranks, the space set
aside for small files, the commit marker, the tracker move, the fault points, the telemetry and
the background universal merge. The trainer hands it megatron-core sharded state dicts.

Call order, every rank (a collective call on all ranks unless said otherwise):
  0) `LazyCheckpointer(config, log=...)` after the process group exists; rank 0 prepares the root.
  1) `save(iteration, sharded_state_dict, extra_shards, content_metadata, root)` right after
     optimizer step i (`root`: the config's root, or its `non_persistent_root`): megatron-core's
     `dist_checkpointing.save` with our strategy. It returns without copying a tensor (small
     objects are serialized at once; rank 0's common.pt is written and fsync'd by a background
     thread); megatron's validation runs only when the sharded structure changed
     (`plan.py`), and while it has not, megatron's call is replaced by what it would do, from
     one walk of the dict (`preprocess.py`); not collective beyond megatron's own and one flag
     while checking. `save_built(iteration, build, ...)` is the same with the dict built by
     `build()`: in the call, or, for a steady save, on the save worker (below).
  2) forward/backward of iteration i+1 run while the engine copies the snapshot to its host cache
     and its writers drain the cache to storage.
  3) `before_optimizer_step()` before step i+1 waits for the snapshot only if it is not done.
  4) `poll(iteration)` at the end of every iteration: a non-blocking local poll plus one
     all-gather (each rank's "durable here": shards, index, marker and, on rank 0, common.pt;
     with the figures the commit reports) while a save is pending. Once every rank is durable:
     rank 0's commit thread, off the training loop (its unlink and fsyncs cost ~30 ms per save
     on our VMs), writes metadata.json (what megatron's finalize would write there; its barrier
     is replaced by the agreements), fsyncs it, writes the commit marker (`try_commit`) and
     moves the tracker of the save's root (`paths.write_tracker`); an in-memory version's
     commit thread then runs its retention too. At a later poll, once every rank agrees that
     this is done (one all-reduce; one commit in flight at a time), rank 0 calls
     `after_commit(iteration, root)` (e.g. retention; done already in memory), logs, and starts
     the background merge (of the config's root only); on several nodes the first rank of every
     other node then joins that merge with its own workers (merge/nodes.py).
  5) `finish()` before the process exits: drain and commit everything, close the engine, wait for
     the merge. A version is reported and loadable only after step 4; a crash before leaves the
     previous one as "latest".
A failure on any rank is agreed on at the next step 4 and raised as the same `CheckpointError` on
every rank (`FailurePolicy.STOP`), or switches saving off for the rest of the run (`CONTINUE`).

Levels at their own pace: saves go through one lane per level (`_Lane`): --save's (with a global
non-persistent root's), and, with node-local versions (Megatron-LM's `local` and `in_memory`
types), theirs. Each lane has its own engine (host cache, copy and writer threads), common.pt
writer and commit thread, and commits its saves in order; step 4 runs the lanes one after the
other, in the same order on every rank, so a version in memory commits while a persistent save
still drains to a slow file system. `busy(root)` says whether a lane holds a save not yet committed
(the trainer defers a persistent save then: latest wins). In-memory versions (the `in_memory` type)
are durable once copied: each is agreed on in `before_optimizer_step`, right after its copy, and
its commit thread writes during the optimizer step, then removes the older version at once
(retention); in the next save each node's leader waits for its own commit thread, and the plan
check's all-reduce both settles the commit (every rank's commit thread succeeded) and orders those
removals before any rank takes a slot, so memory holds two versions and the engine's two reusable
shard files (`WriteMode.MAPPED` slots, registered for DMA with CUDA) take turns.

A steady save, of any level (its lane's structure unchanged in the previous save, as every rank
agreed), runs on the save worker (`offload.SaveWorker`): the trainer's `save_built` call captures
what the next forward/backward changes (RNG states, counters) and returns; the worker builds the
dict and makes the save (plan check, payload, engine call, common.pt, the version's files) during
that forward/backward; `before_optimizer_step` joins it and waits for the copies; an in-memory
version's agreement and commit are then handed to the worker, which makes them during the
optimizer step (the next save call joins them). While a job is in flight the training thread
issues no checkpoint collective (the poll after it runs on the worker too; Megatron's timer
report of a save call is printed at its commit, from the figures its agreement gathers), and
what a job says is said on the training thread at the join. A structure change found by a
job's plan check (agreed) is handed back: the training thread makes that save at the join
(megatron's call and its collectives). An in-memory version every
iteration then costs the training thread no control-plane collective: the agreement (an
all-gather that carries the commit's figures too, the save call's time among them, which
Megatron's timer report then prints: `on_call_times`) and the plan check (which carries the
settle) are the worker's.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import sys
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Deque, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ... import control_plane, telemetry
from ...checksum import threads_for_device_copies
from ...config import Checksum, CommitPolicy, EngineConfig, WriteMode
from ...devices import creator_device
from ...engine import CheckpointEngine
from ...errors import CheckpointError
from ...faults import fail_point, fault_point
from ...storage_errors import advice, explain, kind, root_os_error
from ...fileio import atomic_write, fsync_file, make_spare, naming, release_spare
from ...flatten import TensorShard
from ...layout import COMMIT_FILE, is_committed, try_commit
from ...mapped import cuda_dma_probe
from ..levels import local_tier
from .offload import SaveWorker
from .payload import PayloadPlan
from .replica_check import ReplicaCheck, ReplicaMismatch
from .config import FailurePolicy, LazySaveConfig
from .plan import PreparedSave, SavePlanCache, StructurePolicy
from ..paths import METADATA_FILENAME, TRACKER_FILENAME, checkpoint_dir, prepare_root, \
    probe_writable, set_aside, tracked_iteration, write_tracker, complete_iterations

__all__ = ["COMMIT_RESERVE_BYTES", "LazyCheckpointer", "TELEMETRY_FILENAME", "append_telemetry",
           "prepare_and_probe_root"]

TELEMETRY_FILENAME = "datastates_checkpoints.jsonl"
_ITER_IN_PATH = re.compile(r"iter_(\d{7,})(?:/|$)")
#: The host cache of an engine in WriteMode.MAPPED: the smallest the engine takes (unused).
MAPPED_CACHE_BYTES = 64 * 1024
#: Space set aside per version, at its save call, for each of metadata.json and COMMIT.json.
COMMIT_RESERVE_BYTES = 64 * 1024


@dataclass
class _Pending:
    iteration: int
    root: str  # whose tracker names it once committed
    node_local: bool  # a node-local version (`node_local`): each node's leader commits its node
    directory: str
    request: object  # megatron AsyncRequest: its finalize functions write metadata.json
    handle: object  # datastates SaveHandle
    stall_s: float  # time the training loop was blocked by this save
    t_start: float  # wall clock at the save call (for the timeline)
    t_returned: float  # wall clock when the save call returned
    files: List[Future] = field(default_factory=list)  # rank 0: directory (if deferred), common.pt
    errors: List[BaseException] = field(default_factory=list)  # this save's own, on this rank
    replica_check: Optional[ReplicaCheck] = None  # --ckpt-verify-replicas, this save's
    retain_errors: List[BaseException] = field(default_factory=list)  # retention's failures,
    # on the commit thread (`_publish`), until the training thread takes them
    call_s: float = 0.0  # the save call, from the caller's `called_at` (Megatron's timer)
    copy_start_s: float = 0.0  # from the caller's `called_at` until the engine had this version
    # and its copies could start: for a steady save, the save worker's build and preparation


@dataclass
class _Lane:
    """The saves of one level, committed in order at that level's own pace: --save's (and a
    global non-persistent root's), and the node-local versions' (`node_local`: each node's own
    storage or shared memory). Each lane has its own engine (host cache, copy and writer
    threads) and commit thread, so a version in memory is copied, written and committed while
    a persistent save still drains to a slow file system. Every rank holds the same lanes in the
    same state: a save enters one on every rank, and leaves it only after an agreement."""

    name: str
    engine: CheckpointEngine
    publisher: ThreadPoolExecutor  # its commit thread: metadata.json, commit marker, tracker
    files: ThreadPoolExecutor  # its common.pt writer (temp, fsync, rename)
    pending: Deque[_Pending] = field(default_factory=deque)
    publishing: Optional["_Publishing"] = None

    def uncommitted(self) -> List[_Pending]:
        """Saves not yet committed: the one being published, then those in flight."""
        head = list(self.publishing.items) if self.publishing is not None else []
        return head + list(self.pending)


@dataclass
class _Publishing:
    """Saves every rank agreed are durable (one, or each that was waiting when a lane had fallen
    behind), whose commit markers and trackers the publishing rank's commit thread is writing,
    in order (`future`; None on the other ranks). `published`: the iterations it has committed,
    appended by that thread; it stops at the first failure."""

    items: List[_Pending]
    stats: List[Dict[str, float]]
    future: Optional[Future] = None
    published: List[int] = field(default_factory=list)

    @property
    def pending(self) -> _Pending:
        """The newest of them (the in-memory level's only one: it commits one at a time)."""
        return self.items[-1]


class _Call(NamedTuple):
    """The training thread's part of a save call whose work ran on the save worker."""

    stall_s: float  # the call, and the commit made before it (`_commit_ahead`)
    t_start: float  # wall clock at the call
    t_returned: float  # wall clock when it returned
    call_s: float  # from the caller's `called_at` (Megatron's timer)


class _Agreed(NamedTuple):
    """What every rank said of a save agreed durable everywhere (`_agree`)."""

    rows: List[List[int]]  # each rank's `_figures`
    next_durable: bool  # every rank also has the save after it durable


class _Settling(NamedTuple):
    """This rank's side of settling the in-memory level's commit in flight (`_settle_here`): its
    commit thread's failure, and the values the next plan check reduces for it (failed here,
    peer replica busy here)."""

    err: Optional[BaseException]
    codes: Tuple[int, int]


class LazyCheckpointer:
    """Keeps a deque of saves in flight, oldest first; commits them in order (see module doc)."""

    def __init__(self, config: LazySaveConfig, log: Callable[[str], None] = print,
                 after_commit: Optional[Callable[[int, str], None]] = None,
                 on_record: Optional[Callable[[Dict[str, Any]], None]] = None,
                 on_refused: Optional[Callable[[int, str], None]] = None,
                 on_call_times: Optional[Callable[[int, str, float, float], None]] = None,
                 on_replica_skipped: Optional[Callable[[int, int], None]] = None):
        self.config = config
        # Steady saves run on it (`save_built`); what they say (log lines, records)
        # is said on the training thread when it joins them.
        self._worker = SaveWorker(device=creator_device())
        spoken = self._worker.spoken
        self.log = spoken(log)
        self.after_commit = after_commit
        #: Every rank, when a version commits: (iteration, root, fastest and slowest rank's save
        #: call in seconds), gathered in its agreement (no collective of its own: one after the
        #: save call would wait for a save made on the worker).
        self.on_call_times = None if on_call_times is None else spoken(on_call_times)
        #: Rank 0: each committed checkpoint's record (as logged).
        self.on_record = None if on_record is None else spoken(on_record)
        #: Every rank: (iteration, root) of a version refused.
        self.on_refused = None if on_refused is None else spoken(on_refused)
        #: Every rank: (iteration, skipped so far) of an in-memory version its peer replicas
        #: skipped (a newer one committed before the previous transfer was done: latest wins).
        self.on_replica_skipped = (None if on_replica_skipped is None
                                   else spoken(on_replica_skipped))
        #: Per lane (its name): its last plan check found the structure unchanged on every rank,
        #: so its next save runs on the worker (`_offloads`). Set from agreed values only.
        self._steady: Dict[str, bool] = {}
        self._offloaded: List[_Lane] = []  # lanes whose save ran on the worker, since the step
        #: A save the worker handed back: its plan check found the structure changed, so it is
        #: made by the training thread (megatron's collectives), at the join (`_join`).
        self._redo: Optional[Callable[[], None]] = None
        # Another collective of the control group on this (the training) thread, e.g. the
        # trainer's --save-interval auto agreement right after a save call, waits for the
        # worker's jobs first: one thread at a time issues the group's collectives.
        self._unhook = control_plane.before_use(
            functools.partial(_join_on, weakref.ref(self), threading.get_ident()))
        self._saves = 0  # save calls, for --ckpt-verify-replicas EVERY
        self._verifier = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="datastates-verify")
                          if config.verify_replicas_every else None)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        control_plane.control_group()  # collective when it creates the group: every rank, here
        if config.local_dir is not None:
            self._agree_local_dir_usable(config.local_dir)
        self.engine = self._new_engine(config.local_dir)
        self.replicator = None  # --save's node-local copies (local_dir)
        self.memory_replicator = None  # the in-memory level's versions
        #: The newest committed in-memory version not yet handed to the replicator (every
        #: rank's was busy when it settled), and the last iteration the level saved: see `_poll`.
        self._owed_replica: Optional[int] = None
        self._memory_saved_at: Optional[int] = None
        #: In-memory versions handed to the peer replicas and skipped by them (latest wins); the
        #: newest handed over. Agreed values: the same on every rank.
        self.replicas_sent, self.replicas_skipped = 0, 0
        self._replica_newest: Optional[int] = None
        self._last_committed: Optional[int] = None
        if config.peer_replica_bytes is not None and not config.non_persistent_in_memory:
            from ..levels.peer_replica import PeerReplicator, Ring

            ring = Ring.for_replicas(log)
            if ring is not None:
                self.replicator = PeerReplicator(config.local_dir, ring, self.rank,
                                                 config.peer_replica_bytes, log=self._warn)
        # Version directory -> this rank's SaveRecord (one iteration may be saved into two
        # roots: e.g. the end-of-training save right after a non-persistent one).
        self.durable: Dict[str, object] = {}
        self._wrapper = None
        self._dp_group = None
        self.plans = SavePlanCache(config.structure_policy)
        #: megatron's save call did nothing but what a steady save does (`_megatron_save`): its
        #: request held only its metadata.json finalize function, the last time it was called.
        self._megatron_call_known = False
        self.payloads = PayloadPlan()  # the engine's flattened payload, refilled while it matches
        self.node = None  # this rank's node, for node-local versions
        self.node_plans = SavePlanCache(config.structure_policy)  # node-local versions' plans
        self.node_payloads = PayloadPlan()
        if config.non_persistent_node_local:
            from ..levels.node_local import discover

            self.node = discover(config.non_persistent_root, self.rank)
            if config.non_persistent_in_memory and config.peer_replica_bytes is not None:
                from ..levels.in_memory_peers import PEER_DIR
                from ..levels.peer_replica import PeerReplicator, Ring

                ring = Ring.for_replicas(log)
                if ring is not None:
                    self.memory_replicator = PeerReplicator(
                        config.non_persistent_root, ring, self.rank,
                        config.peer_replica_bytes, log=self._warn,
                        peer_dir=os.path.join(config.non_persistent_root, PEER_DIR),
                        leader=self.rank == self.node.leader)
        self._prepare_roots()
        #: Per root, iterations whose directory held an unfinished save when the run started
        #: (set by the caller, e.g. the trainer's manager, which lists them once): their next
        #: save is agreed on before any rank writes, so the leftovers are set aside first.
        self.leftovers: Dict[str, set] = {}
        # Per lane: common.pt is serialized in the save call and written (temp, fsync, rename)
        # by its files thread, off the training thread (a version commits only once its write is
        # done, `_files_durable`); rank 0 (and node leaders for node-local versions) write
        # metadata.json's fsync, the commit marker and the tracker on its commit thread, at most
        # one commit in flight per lane.
        self.persistent = _Lane("--save", self.engine, *self._lane_threads(""))
        self.lanes: List[_Lane] = [self.persistent]
        self.node_lane: Optional[_Lane] = None
        if self.node is not None:  # node-local versions: their own engine and threads
            from ..levels.in_memory import SLOT_DIR

            slot_dir = os.path.join(config.non_persistent_root, SLOT_DIR)
            mapped = config.non_persistent_in_memory and self._copies_once_into(slot_dir)
            self.node_lane = _Lane("node-local", self._new_engine(
                None, mapped, slot_dir if mapped else None, self.memory_replicator is not None,
                self._checksum_threads() if config.non_persistent_in_memory else None),
                *self._lane_threads("-node"))
            self.lanes.append(self.node_lane)
        # Errors this rank hit since the last agreement, in order (a full disk can fail both
        # common.pt of the next save and the flush of the previous one: all are reported).
        self._local_errors: List[BaseException] = []
        self._failed: Optional[BaseException] = None  # an agreed failure already raised (STOP)
        self._ahead_s = 0.0  # in-memory commit time carried to the level's next save
        self._last_published: Optional[_Pending] = None  # the newest committed save, any lane
        self.disabled = False  # FailurePolicy.CONTINUE after a failure: no more saves
        self.universal = None  # rank 0: the background universal merges, when asked for
        self._merge_follower = None  # the first rank of each other node: its share of them
        if self.rank == 0:  # the timeline splits runs here, and shows what the run starts from
            complete = complete_iterations(config.root)
            self._event({"event": "start", "time": time.time(),
                         "committed": tracked_iteration(config.root),
                         "newest_complete": complete[-1] if complete else None})
        if config.universal_every_n:
            self._start_mergers(self.log)

    def _copies_once_into(self, slot_dir: str) -> bool:
        """In-memory versions: whether this rank's engine copies each tensor straight into the
        shard files' pages (`WriteMode.MAPPED`). With CUDA, only where a device-to-host copy can
        land in them by DMA (`cuda_dma_probe`); otherwise it copies through the pinned host cache
        and says why in one line."""
        if not torch.cuda.is_available():
            return True
        why = cuda_dma_probe(slot_dir)
        if why is None:
            return True
        self._warn(f"[rank {self.rank}] WARNING: in-memory versions go through the pinned host "
                   f"cache (two copies): a device-to-host copy cannot land in pages under "
                   f"{slot_dir} ({why})")
        return False

    def _checksum_threads(self) -> int:
        """The in-memory level's engine's writer threads (`LazySaveConfig.checksum_threads`); with
        CUDA, rank 0 says how many checksum each rank's versions."""
        c = self.config
        dma = torch.cuda.is_available() and c.checksum is not Checksum.NONE
        threads = c.checksum_threads
        if threads is None:
            threads = threads_for_device_copies(len(os.sched_getaffinity(0)),
                                                len(self.node.ranks)) if dma else 1
        if dma:
            self.log(f"in-memory checkpoints: {threads} thread(s) per rank checksum each "
                     "version as its device-to-host copies land (--lazy-save-checksum-threads)")
        return threads

    def _new_engine(self, local_dir: Optional[str], mapped: bool = False,
                    slot_dir: Optional[str] = None, replicated: bool = False,
                    checksum_threads: Optional[int] = None) -> CheckpointEngine:
        """`checksum_threads`: the in-memory level's engine, with that many writer threads, at
        the training threads' priority: its versions commit once checksummed, and the level's
        next save waits for that commit, as the optimizer step waits for the copy threads."""
        from ..levels.in_memory import versions_held

        c = self.config
        in_memory = checksum_threads is not None
        return CheckpointEngine(EngineConfig(
            mapped_slot_dir=slot_dir,
            mapped_slots=versions_held(c.non_persistent_keep, replicated),
            rank=self.rank, world_size=self.world,
            # A mapped engine copies into the shard files, not through its cache.
            host_cache_bytes=MAPPED_CACHE_BYTES if mapped else c.cache_bytes,
            write_mode=WriteMode.MAPPED if mapped else WriteMode.DIRECT,
            commit_policy=CommitPolicy.MANUAL,  # committed in poll(), after every rank agrees
            writer_threads=checksum_threads if in_memory else 1,
            checksum=c.checksum, background_nice=0 if in_memory else c.background_nice,
            local_dir=local_dir))

    @staticmethod
    def _lane_threads(suffix: str):
        return (ThreadPoolExecutor(max_workers=1, thread_name_prefix="datastates-commit" + suffix),
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="datastates-common" + suffix))

    def _lane_of(self, root: Optional[str]) -> _Lane:
        if self.node_lane is not None and root == self.config.non_persistent_root:
            return self.node_lane
        return self.persistent

    @property
    def publishing(self) -> Optional[_Publishing]:
        """The commit in flight of --save's lane (None: none)."""
        return self.persistent.publishing

    def drop_local_copies_newer(self, iteration: int) -> List[int]:
        """Every rank, before the first save of a run that starts from `iteration`: its files of
        the --lazy-save-local-dir copies of newer iterations, which are another run's (the one
        rolled back from; its checkpoints under --save are set aside or torn). Never read again
        (a copy is used only where it matches --save's version), they would count as the newest
        in `local_keep` until this run's saves replaced them. Returns the iterations removed."""
        local_dir = self.config.local_dir
        if local_dir is None:
            return []
        newer = [it for it in local_tier.local_iterations(local_dir) if it > iteration]
        for it in newer:
            local_tier.remove_rank_files(checkpoint_dir(local_dir, it), self.rank)
        return newer

    def busy(self, root: Optional[str] = None) -> bool:
        """Whether `root`'s lane (None: --save's) holds a save not yet committed. The same on
        every rank: saves leave a lane only after an agreement."""
        self._join()
        return bool(self._lane_of(root or self.config.root).uncommitted())

    def _start_mergers(self, log: Callable[[str], None]) -> None:
        """Collective: the first rank of every node runs a merger and its workers; rank 0's
        decides and commits (merge/nodes.py). Nodes as the peer replicas know them (torchrun's
        GROUP_RANK, else SLURM_NODEID), rank 0's node first; the run id is rank 0's draw. A
        node whose first rank does not see rank 0's universal root takes no part: then only
        rank 0's node merges, as the warning says."""
        from ..merge import nodes as merge_nodes
        from ..merge.background import BackgroundMerger, MergerConfig
        from ..levels.peer_replica import node_index

        c = self.config
        root = c.universal_root or os.path.join(c.root, "universal")
        run = int.from_bytes(os.urandom(4), "little") if self.rank == 0 else 0
        unmarked = None  # rank 0 cannot write there: said in the warning, after the collectives
        if self.rank == 0:
            try:
                merge_nodes.mark_start(root, f"{run:08x}")
            except OSError as err:
                unmarked = err
        gathered = control_plane.all_gather_ints([node_index(), run])
        run_id = f"{gathered[0][1]:08x}"
        of_rank = [n for n, _ in gathered]
        first = of_rank.index(of_rank[self.rank]) == self.rank  # the first rank of its node
        sees = control_plane.all_gather_ints(
            int(self.rank == 0 or not first
                or os.path.exists(merge_nodes.start_marker(root, run_id))))
        blind = sorted({of_rank[r] for r, ok in enumerate(sees) if not ok})
        nodes = [of_rank[0]] + sorted(set(of_rank) - {of_rank[0]} - set(blind))
        if blind and self.rank == 0:
            log(f"WARNING: universal merges run on node {of_rank[0]} only: the first rank of "
                f"node(s) {blind} does not see {merge_nodes.start_marker(root, run_id)} "
                f"(put --universal-save on a file system every node shares)"
                + (f"; writing it failed: {unmarked}" if unmarked else ""))
        if not first or of_rank[self.rank] in blind:
            return
        merger = BackgroundMerger(MergerConfig(
            root=root, every_n=c.universal_every_n, workers=c.universal_workers,
            nodes=len(nodes), node=nodes.index(of_rank[self.rank]), run_id=run_id,
            remote_timeout_s=c.drain_timeout_s), log=log if self.rank == 0 else self._warn)
        if self.rank == 0:
            self.universal = merger
        else:
            self._merge_follower = merger

    def in_flight(self, iteration: int, root: Optional[str] = None) -> bool:
        """True when the newest save in flight is of `iteration` into `root` (None: the
        config's), e.g. the end-of-training save right after an interval save."""
        self._join()
        root = root or self.config.root
        lane = self._lane_of(root)
        newest = lane.uncommitted()[-1] if lane.uncommitted() else None
        return newest is not None and newest.iteration == iteration and newest.root == root

    # -- 1) after optimizer step i ------------------------------------------------------------
    def save(self, iteration: int, sharded_state_dict: Any,
             extra_shards: Sequence[TensorShard] = (),
             content_metadata: Optional[dict] = None, root: Optional[str] = None,
             called_at: Optional[float] = None) -> None:
        """`called_at`: `time.perf_counter()` when the caller's save call began (e.g. before it
        built `sharded_state_dict`), for the call's time reported at commit (`on_call_times`)."""
        self._join()
        self._save(iteration, sharded_state_dict, extra_shards, content_metadata, root, called_at)

    def save_built(self, iteration: int, build: Callable[[], Tuple[Any, Sequence[TensorShard]]],
                   content_metadata: Optional[dict] = None, root: Optional[str] = None,
                   called_at: Optional[float] = None) -> None:
        """`save` of what `build()` returns (the sharded state dict and the extra shards), built
        in this call or, for a steady save (`_offloads`), on the save worker during the
        next forward/backward, which this call then returns without waiting for. `build` may
        then read the model and the optimizer (unchanged until the next optimizer step, which
        `before_optimizer_step` holds until the worker is done) but nothing the forward/backward
        changes: the caller captures the RNG states (and counters) before this call."""
        t0, wall0 = time.perf_counter(), time.time()
        called = t0 if called_at is None else called_at
        self._join()
        root = root or self.config.root
        if not self._offloads(root):
            sd, extra = build()
            self._save(iteration, sd, extra, content_metadata, root, called)
            return
        lane = self._lane_of(root)
        lane.engine.mark_ready()  # the point in the CUDA stream that the copies wait for
        self._offloaded.append(lane)
        # What the training thread spent: the commit before this step (`_commit_ahead`) and this.
        ahead, self._ahead_s = self._ahead_s, 0.0
        call = _Call(time.perf_counter() - t0 + ahead, wall0, time.time(),
                     time.perf_counter() - called)

        def job() -> None:
            sd, extra = build()
            self._save(iteration, sd, extra, content_metadata, root, called, offloaded=call)

        self._worker.submit(job)

    def _offloads(self, root: str) -> bool:
        """Whether a save into `root` runs on the worker: while its lane's last plan check found
        the structure unchanged on every rank and megatron's call is known to do nothing a steady
        save does not (the job then issues no collective but the control plane's, and the
        fully-parallel wrapper keeps its distribution). The same answer on every rank: agreed
        values only."""
        steady = self._steady.get(self._lane_of(root).name, False)
        return (self.config.offload_steady_saves and steady and self._megatron_call_known
                and not self.disabled and self._failed is None)

    def _join(self) -> float:
        """Training thread, before anything that reads the lanes or issues a collective: waits for
        the worker's jobs (saying what they said, raising what one raised), then makes the save it
        handed back, if any (`_redo`). Returns the seconds waited for the jobs."""
        if not self._worker.in_flight or self._worker.on_worker():
            return 0.0
        t0 = time.perf_counter()
        try:
            self._worker.join()
        except BaseException:
            self._redo = None
            raise
        waited = time.perf_counter() - t0
        redo, self._redo = self._redo, None
        if redo is not None:
            redo()
        return waited

    def _save(self, iteration: int, sharded_state_dict: Any,
              extra_shards: Sequence[TensorShard], content_metadata: Optional[dict],
              root: Optional[str], called_at: Optional[float],
              offloaded: Optional[_Call] = None) -> None:
        """`save`'s work, in its call or (`offloaded`: the training thread's part of the call) on
        the worker."""
        from megatron.core import parallel_state

        from .preprocess import split

        t0, wall0 = time.perf_counter(), time.time()
        called = t0 if called_at is None else called_at
        root = root or self.config.root
        # The in-memory level's previous version, committed before this step (`_commit_ahead`):
        # training waited for that too, counted in this save's stall as when it ran here.
        if root == self.config.non_persistent_root and offloaded is None:
            t0, self._ahead_s = t0 - self._ahead_s, 0.0

        def call_times() -> _Call:
            if offloaded is not None:
                return offloaded
            return _Call(time.perf_counter() - t0, wall0, time.time(),
                         time.perf_counter() - called)
        if root not in (self.config.root, self.config.non_persistent_root):
            raise ValueError(f"save root {root} is neither the root {self.config.root} nor the "
                             f"non-persistent root {self.config.non_persistent_root}")
        lane = self._lane_of(root)
        if lane is self.node_lane:
            self._memory_saved_at = iteration
        settling = self._before_save(lane, root, iteration)
        if self.disabled:
            return
        directory = checkpoint_dir(root, iteration)
        node_local = root == self.config.non_persistent_root and self.node is not None
        check = self._start_replica_check(iteration, sharded_state_dict)
        # megatron's preprocessing, in one walk (a node-local version claims every replica).
        parts = split(sharded_state_dict, content_metadata, claim=node_local)
        if self._dp_group is None:
            self._dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        writer = self.rank == (self.node.leader if node_local else 0)  # common.pt, spares
        errors: List[BaseException] = []  # this save's (agreed on when its turn comes)
        # Rank 0's version directory on the shared file system, in a steady save: made by its
        # files thread, before common.pt (a slow metadata server holds no rank); see
        # `_defers_prepare`.
        deferred = writer and not node_local and self._defers_prepare(root, iteration)
        if writer and not deferred:
            errors += self._prepare_directory(directory, iteration)
        prepare_failed = bool(errors)
        payloads = self.node_payloads if node_local else self.payloads
        if node_local:
            planned = self._plan_node_local(
                lane, parts.items, extra_shards, prepare_failed, settling, iteration, root,
                prepared=directory if writer and not prepare_failed else None)
            if planned is None:
                return
        else:
            planned = self._plan_shared(lane, parts.items, extra_shards, errors, iteration, root,
                                        directory, deferred)
            deferred = deferred and planned[0].reuse_distribution
        plan, strategy, base, validate = planned
        plans = self.node_plans if node_local else self.plans
        if offloaded is not None and not plan.failed and \
                not (plan.reuse_distribution and self._megatron_call_known):
            # Some rank's structure changed (agreed): megatron's call, with its collectives on
            # the training thread's groups, is made there, at the join, from this dict.
            plans.forget()
            payloads.forget()
            if writer and not prepare_failed:
                shutil.rmtree(directory, ignore_errors=True)
            self._saves -= 1  # (--ckpt-verify-replicas counts the save made there)
            self._redo = lambda: self._save(iteration, sharded_state_dict, extra_shards,
                                            content_metadata, root, called_at)
            return
        request = None
        serialized: List[tuple] = []  # (path, bytes) of common.pt, written once the call is done

        if plan.failed or prepare_failed:
            # Rank 0's directory could not be prepared: no rank enters megatron's collectives
            # for this save; its failure is agreed on at the next poll.
            plans.forget()
            payloads.forget()
            stall, start, returned, call_s = call_times()
            lane.pending.append(_Pending(iteration, root, node_local, directory, None, None,
                                         stall, start, returned, [], errors, check,
                                         call_s=call_s))
            return
        try:
            # After megatron's collectives, rank 0 hands common.pt to its writer thread and every
            # rank opens its shard: a full disk fails here (or in that write) on some ranks only,
            # so the failure is recorded and agreed on in poll() instead of raised (the others
            # would wait for us). common.pt is fsync'd (a full disk is an ENOSPC OSError);
            # megatron's overwrite warning is replaced by the check above.
            steady = plan.reuse_distribution and self._megatron_call_known
            request = _megatron_save(sharded_state_dict, parts, directory, strategy, validate,
                                     steady, lambda path, data: serialized.append((path, data)),
                                     writer)
            if not steady:
                self._megatron_call_known = _only_metadata_finalize(request)
            plans.confirm()
        except (OSError, RuntimeError, CheckpointError) as err:
            # The engine raises an earlier save's background failure at its next call: that
            # save's, agreed on at its turn (else it would wait for a durability that never
            # comes, and a final drain would end with it neither committed nor failed).
            owner = self._owner(err, besides=directory)
            (errors if owner is None else owner.errors).append(err)
            plans.forget()
            payloads.forget()
        except BaseException:
            plans.forget()
            payloads.forget()
            raise
        # Started last: background threads' wake-ups would take the GIL from the rest of this
        # call (the tensors are not mutated before `before_optimizer_step` either way).
        files = [lane.files.submit(self._prepare_later, directory, iteration)] if deferred else []
        files += [lane.files.submit(self._write_file, iteration, path, data)
                  for path, data in serialized]
        lane.engine.start_copies()
        copy_start = time.perf_counter() - called
        stall, start, returned, call_s = call_times()
        lane.pending.append(_Pending(iteration, root, node_local, directory, request, base.handle,
                                     stall, start, returned, files, errors, check, call_s=call_s,
                                     copy_start_s=copy_start))

    def _before_save(self, lane: _Lane, root: str, iteration: int) -> Optional[_Settling]:
        """Every rank, before a save into `lane`: what must be committed first. Returns this
        rank's side of the in-memory level's commit to settle in the save's plan check, if any;
        `disabled` is set if a commit that had to come first failed under
        --ckpt-failure-policy continue (the save is then not made)."""
        if lane is self.node_lane and self.config.non_persistent_in_memory and \
                lane.uncommitted():
            # Memory holds two versions: the newest complete one and this one. The previous one
            # was agreed on and its commit started before this iteration's optimizer step
            # (`_commit_ahead`): its commit is settled in the plan check's all-reduce
            # (`_plan_node_local`). Otherwise (it could not be, e.g. the first save after a
            # failure) it is committed now, which costs the agreements, not a wait for bytes.
            if self._settles_in_plan_check(lane, root, iteration):
                return self._settle_here(lane)
            self._apply_policy(lambda: self._commit_lane(lane, blocking=True))
            if self.disabled:
                return None
        if any(q.iteration == iteration for q in lane.uncommitted()):
            # The same iteration into the other root of this lane (e.g. the end-of-training save
            # right after a global non-persistent one): both would name the same node-local
            # copy (`layout.local_version_dir`), so the first is committed before the second.
            self._apply_policy(lambda: self._commit_lane(lane, blocking=True))
        return None

    def _plan_node_local(self, lane: _Lane, items: List[Any],
                         extra_shards: Sequence[TensorShard], prepare_failed: bool,
                         settling: Optional[_Settling], iteration: int, root: str,
                         prepared: Optional[str]) -> Optional[tuple]:
        """Every rank, a node-local save (every rank writes all it holds: `items`, the save's
        sharded items, each claimed; its node's leader the small files): (plan, strategy, base
        strategy, validate), or None if the commit settled here failed (raised under STOP;
        `disabled` under CONTINUE): this save is then not made, nor the directory this rank
        `prepared` for it left behind."""
        from .strategies import save_strategy

        # In memory, the plan check's all-reduce also orders every leader's retention of the
        # older version (on its commit thread, `_publish`, which `_settle_here` waited for)
        # before any rank takes a slot of it (the engine's save, below); without it, a slot
        # still linked would be passed over. It also settles the previous version's commit
        # (`settling`).
        plan = self.node_plans.prepare(items, extra_shards, prepare_failed,
                                       agree=iteration in self.leftovers.get(root, ())
                                       or self.config.non_persistent_in_memory,
                                       along=() if settling is None else settling.codes)
        if settling is not None:
            failed_any, busy_any = plan.along
            try:
                self._apply_policy(lambda: self._settled(
                    lane, -1 if failed_any else 1, not busy_any, settling.err))
            finally:
                if self._failed is not None or self.disabled:
                    self.node_plans.forget()
                    self.node_payloads.forget()
                    if prepared is not None:
                        shutil.rmtree(prepared, ignore_errors=True)
            if self.disabled:
                return None
        if not plan.reuse_distribution:
            self.node_payloads.forget()
        self._steady[lane.name] = plan.reuse_distribution and not plan.failed  # (agreed)
        strategy, base = save_strategy(lane.engine, iteration, None, None,
                                       extra_shards=extra_shards, payload_plan=self.node_payloads,
                                       defer_copies=True, checked=_checked(self.node_plans, plan))
        return plan, strategy, base, False  # replicas are written on purpose, once per node

    def _plan_shared(self, lane: _Lane, items: List[Any],
                     extra_shards: Sequence[TensorShard], errors: List[BaseException],
                     iteration: int, root: str, directory: str, deferred: bool) -> tuple:
        """Every rank, a save to shared storage: (plan, strategy, base strategy, validate).
        After rank 0's spares unless it `deferred` them: when the plan is reused, the plan
        check's all-reduce is what orders them before any rank's shard bytes (ASSUME_CONSTANT has
        none). If rank 0 deferred its directory for a save it took to be steady and some rank's
        structure changed, megatron's call (which lists the directory on rank 0) follows: rank 0
        makes it now and every rank learns whether that failed before megatron's collectives
        (one more all-reduce, only then). `errors`: this rank's, appended to."""
        from .strategies import save_strategy

        check = self.plans.policy is StructurePolicy.CHECK
        plan = self.plans.prepare(items, extra_shards, bool(errors),
                                  agree=iteration in self.leftovers.get(root, ()),
                                  along=(int(deferred),) if check else ())
        if check and plan.along[0] and not plan.reuse_distribution:
            if deferred:
                errors += self._prepare_directory(directory, iteration)
            failed, = control_plane.all_reduce([int(bool(errors))], op=dist.ReduceOp.MAX)
            plan = replace(plan, failed=plan.failed or bool(failed))
        if not plan.reuse_distribution:
            self._wrapper = None  # its cached distribution belongs to the previous structure
            self.payloads.forget()
        self._steady[lane.name] = plan.reuse_distribution and not plan.failed  # (agreed)
        strategy, base = save_strategy(
            lane.engine, iteration,
            self._dp_group if self.config.fully_parallel_save else None, self._wrapper,
            extra_shards=extra_shards, payload_plan=self.payloads, defer_copies=True,
            checked=_checked(self.plans, plan))
        if strategy is not base:
            self._wrapper = strategy
        return plan, strategy, base, plan.validate

    def _start_replica_check(self, iteration: int, sharded_state_dict: Any
                             ) -> Optional[ReplicaCheck]:
        """--ckpt-verify-replicas, at every EVERY-th save call: this rank's fingerprints of its
        plain shards, started now (`replica_check`); the DATASTATES_FAULT_FLIP_BIT test fault
        corrupts one replica first."""
        self._saves += 1
        every = self.config.verify_replicas_every
        if not every or (self._saves - 1) % every:
            return None
        from .replica_check import collect, flip_point

        boxes = collect(sharded_state_dict)
        flip_point(boxes, iteration, self.rank)
        return ReplicaCheck(boxes, self._verifier)

    def _write_file(self, iteration: int, path: str, data: bytes) -> None:
        """The common.pt writer thread: durable and atomic."""
        fail_point("common", iteration, self.rank, path)
        atomic_write(path, data)

    def _defers_prepare(self, root: str, iteration: int) -> bool:
        """Rank 0, a save to shared storage: whether its version directory and spares can be
        made by its files thread (`_prepare_later`) instead of in the save call. Where the save
        is steady (the plan reused and megatron's call skipped: nothing in the call lists the
        directory; every other rank's writer makes it too) and there are no leftovers to set
        aside first (their next save is agreed on before any rank writes). The spares are then
        taken before this save's common.pt and its commit, and (a persistent save that falls due
        while one is in flight waits for its commit) before a later save's shard bytes; another
        rank's shard bytes of this save may come first, as under ASSUME_CONSTANT."""
        return (self._megatron_call_known and self.plans.has_plan
                and iteration not in self.leftovers.get(root, ()))

    def _prepare_later(self, directory: str, iteration: int) -> None:
        """The files thread of rank 0, a deferred save (`_defers_prepare`): its version directory
        and spares; a failure fails the save, agreed on at its turn like common.pt's. Never sets
        a directory aside: other ranks may be writing into it already."""
        for err in self._prepare_directory(directory, iteration, set_aside_first=False):
            raise err

    def _prepare_directory(self, directory: str, iteration: int,
                           set_aside_first: bool = True) -> List[BaseException]:
        """Rank 0 (a node's leader for a node-local version), at a save call or, deferred, on
        its files thread (`_prepare_later`, without `set_aside_first`): an earlier unfinished
        save's leftovers set aside (`paths.set_aside`; removed in the background), the version
        directory, and the room set aside for COMMIT.json and metadata.json. Returns the
        failure, if any: at a save call every rank learns of it before megatron's collectives
        (see `save`); it is agreed on at a later poll."""
        try:
            fail_point("prepare", iteration, self.rank, directory)
            aside = set_aside(directory) if set_aside_first else None
            if aside is not None:
                self.log(f"moved the leftovers of an earlier, unfinished save of iteration "
                         f"{iteration} aside ({aside}); removing them in the background")
                threading.Thread(target=shutil.rmtree, args=(aside, True), daemon=True,
                                 name="datastates-leftovers").start()
            os.makedirs(directory, exist_ok=True)  # megatron's save lists it on rank 0
            # Room for COMMIT.json (written into it) and metadata.json (megatron writes it:
            # released right before), taken before any shard byte of this save or a later
            # one, so a disk that the next save fills up rarely keeps this save, once
            # durable, from committing.
            make_spare(os.path.join(directory, COMMIT_FILE), COMMIT_RESERVE_BYTES)
            make_spare(os.path.join(directory, METADATA_FILENAME), COMMIT_RESERVE_BYTES)
        except (OSError, RuntimeError, CheckpointError) as err:
            return [err]
        return []

    # -- 3) before optimizer step i+1 --------------------------------------------------------
    def before_optimizer_step(self) -> None:
        joined_s = self._join()  # a save made on the worker: the training thread waited for it
        offloaded, self._offloaded = self._offloaded, []
        for lane in self.lanes:
            if not lane.pending:
                continue
            t0 = time.perf_counter()
            self._guard(lambda: lane.engine.wait_for_snapshot(
                timeout=self.config.drain_timeout_s))
            check = lane.pending[-1].replica_check
            if check is not None:  # it reads the live tensors: done before they change
                self._guard(check.wait)
            lane.pending[-1].stall_s += time.perf_counter() - t0 + (
                joined_s if any(o is lane for o in offloaded) else 0.0)
            if self._commits_ahead(lane) and self._failed is None and not self.disabled:
                if self._offloads(self.config.non_persistent_root):
                    # Its agreement (a collective) and commit run on the worker during the
                    # optimizer step; the next save call (or step) joins them.
                    self._worker.submit(lambda: self._apply_policy(
                        lambda: self._commit_ahead(self.node_lane)))
                    continue
                t1 = time.perf_counter()
                self._apply_policy(lambda: self._commit_ahead(lane))
                self._ahead_s += time.perf_counter() - t1

    def record(self, event: Dict[str, Any]) -> None:
        """Rank 0: one more event (a JSON object with "event" and "time") in the telemetry the
        timeline tool reads, e.g. the trainer's validation; other ranks ignore it."""
        self._join()  # after the lines of the saves before it
        if self.rank == 0:
            self._event(dict(event))

    # -- 4) every iteration ------------------------------------------------------------------
    def poll(self, iteration: int) -> None:
        if self._worker.in_flight:
            # This iteration's save runs on the worker: the poll's collectives go after it, on
            # the same thread (every rank submitted the same jobs), joined before the next step.
            now = time.time()
            self._worker.submit(lambda: self._poll(iteration, now))
            return
        self._poll(iteration, time.time())

    def _poll(self, iteration: int, now: float) -> None:
        """`poll`'s work; `now`: the wall clock when the iteration ended (its poll call)."""
        if self.rank == 0:
            self._event({"event": "iteration", "iteration": iteration, "time": now})
        if self._uncommitted():
            self._apply_policy(lambda: self._commit_ready(blocking=False, iteration=iteration))
        if self._owed_replica is not None and self._memory_saved_at != iteration and \
                self.node_lane.publishing is None and not self.disabled and self._failed is None:
            self._hand_off_owed()
        for merger in (self.universal, self._merge_follower):
            if merger is not None:
                merger.poll()

    # -- 5) at exit --------------------------------------------------------------------------
    def finish(self) -> None:
        try:
            self._join()
            if self._failed is None:
                self._apply_policy(lambda: self._commit_ready(blocking=True))
                if self._failed is None and not self.disabled:
                    self._apply_policy(self._agree_after_last_commit)
        finally:
            try:
                if self.memory_replicator is not None:
                    self.memory_replicator.close(timeout=self.config.drain_timeout_s)
                if self.replicator is not None:  # every rank: its thread agrees with the others'
                    self.replicator.close(timeout=self.config.drain_timeout_s)
                    if self._last_committed is not None:  # what the thread held back, if any
                        self._prune_local(self._last_committed)
                self._close_engine()
            finally:
                if not telemetry.flush_all(self.config.drain_timeout_s):
                    self._warn(f"[rank {self.rank}] WARNING: telemetry lines were still waiting "
                               f"for the file system after {self.config.drain_timeout_s:g} s "
                               "(not answering?); they are dropped at exit")
                self._worker.close()
                self._unhook()
                if self._verifier is not None:
                    self._verifier.shutdown(wait=False, cancel_futures=True)
                for lane in self.lanes:
                    lane.files.shutdown(wait=False, cancel_futures=True)
                    lane.publisher.shutdown(wait=False, cancel_futures=True)
                for merger in (self.universal, self._merge_follower):
                    if merger is not None:
                        merger.wait()  # no merge process outlives the run

    # -- internals -----------------------------------------------------------------------------
    def _prepare_roots(self) -> None:
        """Every rank (collective): rank 0 creates the roots and the trackers' spares (each node's
        leader its node-local root), every rank checks it can write there; one agreement per
        root, so a read-only, full or missing --save stops every rank with one error."""
        c = self.config
        roots = [("--save", c.root, self.rank == 0)]
        if c.non_persistent_root is not None:
            leader = self.node.leader if self.node is not None else 0
            roots.append(("the non-persistent checkpoint directory", c.non_persistent_root,
                          self.rank == leader))
        for flag, root, prepares in roots:
            prepare_and_probe_root(root, flag, prepares)

    def _agree_local_dir_usable(self, local_dir: str) -> None:
        """Every rank probes its node-local directory; one that cannot write there stops every
        rank with the same error, printed once, naming the ranks (no rank waits in a collective
        the others skipped)."""
        def check() -> None:
            problem = local_tier.check_usable(local_dir, self.rank)
            if problem is not None:
                raise CheckpointError(problem, rank=self.rank, file=local_dir)

        try:
            control_plane.agree(check, f"checking that every rank can write its "
                                       f"{local_tier.FLAG}",
                                describe=control_plane.reason_of)
        except CheckpointError as err:
            raise CheckpointError(err.reason + ". Nothing was saved or removed", rank=self.rank,
                                  file=local_dir, ranks=err.ranks) from err.__cause__

    def _prune_local(self, committed: int) -> None:
        """After a commit, every rank: its files of local copies beyond the newest `local_keep`
        (never one still migrating, nor the one just committed). A failure only warns: the
        shared copies are what --load trusts."""
        local_dir = self.config.local_dir
        protected = [committed] + [q.iteration for q in self.persistent.uncommitted()] + (
            self.replicator.unfinished() if self.replicator is not None else [])
        try:
            local_tier.prune(local_dir, self.rank, self.config.local_keep, protected)
        except OSError as err:
            self._warn(f"[rank {self.rank}] WARNING: could not remove old local checkpoint "
                       f"copies under {local_dir}: {err}")

    @staticmethod
    def _warn(message: str) -> None:
        """Every rank's own warning (the log callback is rank 0's), in one write: ranks on a
        node share a stdout, and `print`'s separate newline lets another rank's line in."""
        sys.stdout.write(message + "\n")
        sys.stdout.flush()

    def _apply_policy(self, fn) -> None:
        """Run `fn`; an agreed save failure either propagates (STOP) or switches checkpointing
        off for the rest of the run (CONTINUE). Every rank decides the same way because the
        failure was agreed on collectively."""
        try:
            fn()
        except ReplicaMismatch as err:  # only that version is refused
            if self.config.failure_policy is not FailurePolicy.CONTINUE:
                self._failed = err
                raise
            self.log(f"WARNING: {err}. Continuing (--ckpt-failure-policy continue) without this "
                     "checkpoint; the next save is verified again and committed only if its "
                     "replicas agree")
        except CheckpointError as err:
            if self.config.failure_policy is not FailurePolicy.CONTINUE:
                self._failed = err
                raise
            self.disabled = True
            self._local_errors.clear()
            for lane in self.lanes:  # never committed: they stay partial and unloadable
                lane.pending.clear()
                lane.publishing = None
            self.log(f"WARNING: {err}. Continuing WITHOUT checkpointing for the rest of this "
                     "run (--ckpt-failure-policy continue): no further saves, no retry.")

    def _close_engine(self) -> None:
        first = None
        for lane in self.lanes:  # every engine is closed, whatever the first one raised
            try:
                lane.engine.close(timeout=self.config.drain_timeout_s)
            except CheckpointError as err:
                if self._failed is None and not self.disabled:
                    first = first or err
                    continue
                # A failure was already reported (or tolerated by policy); the saves still in
                # flight then fail the same way. Say so, do not hide the first error behind them.
                self.log(f"WARNING: while closing the checkpoint engine after an earlier "
                         f"failure: {err}")
        if first is not None:
            raise first

    def _guard(self, fn):
        """Run an engine call; a failure on any rank becomes a CheckpointError on every rank at
        the next agreement, so no rank hangs in a collective the others skipped."""
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - recorded and re-raised below
            self._record(err)
            return None

    def _record(self, err: BaseException) -> None:
        """An engine error goes with the save not yet agreed durable whose version directory it
        names (so an earlier save that is durable everywhere still commits, and this one fails
        on its turn); any other (one that names no such save, or a late one of a save already
        agreed on, e.g. its node-local copy) fails the oldest save in flight."""
        owner = self._owner(err)
        (self._local_errors if owner is None else owner.errors).append(err)

    def _owner(self, err: BaseException, besides: Optional[str] = None) -> Optional[_Pending]:
        """The save in flight (not yet agreed durable) whose iteration the file `err` names is
        of, under its version directory if two are of that iteration; None if none is, or if
        that file is under `besides` (the version directory of the save being made)."""
        path = str(getattr(err, "file", None) or "")
        if besides is not None and (path == besides or path.startswith(besides + os.sep)):
            return None
        match = _ITER_IN_PATH.search(path)
        if not match:
            return None
        candidates = [p for lane in self.lanes for p in lane.pending
                      if p.iteration == int(match.group(1))]
        # The same iteration may be in flight into two roots: the one the file is under.
        within = [p for p in candidates if path.startswith(p.directory + os.sep)
                  or path == p.directory]
        return (within or candidates or [None])[0]

    def _files_durable(self, p: _Pending, blocking: bool) -> bool:
        """Whether `p`'s common.pt write is done (waiting for it if `blocking`); its failure is
        recorded for the next agreement, like the engine's."""
        while p.files:
            if not blocking and not p.files[0].done():
                return False
            try:
                err = p.files[0].exception(timeout=self.config.drain_timeout_s)
            except FutureTimeout:
                err = CheckpointError(f"writing common.pt took longer than "
                                      f"{self.config.drain_timeout_s:g} s (storage not "
                                      "responding?)", rank=self.rank, file=p.directory)
            p.files.pop(0)
            if err is not None:
                p.errors.append(err)
        return True

    def _agree(self, p: _Pending, local_done: bool, record=None,
               next_durable: bool = False) -> Optional[_Agreed]:
        """All ranks: every rank's figures of `p` (`_figures`: what this rank's `record` says,
        zeros without one) when every rank has `p` durable (or committed), and whether every
        rank has the save after it (`next_durable` here) durable too; None while some rank has
        not `p`; raises the same CheckpointError on every rank if any rank recorded an error.
        One all-gather: the in-memory level agrees every iteration, and at scale each collective
        is a round over every rank that the training loop waits for."""
        errors = self._local_errors + p.errors  # a later save's own errors wait for its turn
        err = errors[0] if errors else None
        code = -1 if err is not None else int(local_done)
        rows = control_plane.all_gather_ints([code, int(next_durable)] + _figures(p, record))
        agreed = min(row[0] for row in rows)
        if agreed >= 0:
            return _Agreed([row[2:] for row in rows], bool(min(row[1] for row in rows))) \
                if agreed else None
        root = p.root
        where = "--save" if root == self.config.root else f"non-persistent root {root}"
        failure = control_plane.agreed_failure(
            err, f"DataStates save of iteration {p.iteration}",
            describe=lambda _: self._describe_errors(errors, root, where))
        if failure is None or failure.ranks is None:  # a rank died, or stopped answering
            raise (failure or CheckpointError("the save failed", rank=self.rank)) from err
        msg = (failure.reason + f"; {_state_of(p, root, self._last_published)}; "
               "--ckpt-failure-policy continue keeps training without checkpoints")
        raise CheckpointError(msg, rank=self.rank, file=p.directory, ranks=failure.ranks) from err

    def _describe_errors(self, errors: List[BaseException], root: str, where: str) -> str:
        """This rank's errors, in order, each with what it means and what to do (a full disk:
        the free space of --save and of the node-local directory)."""
        local = self.config.local_dir
        parts = []
        for e in errors:
            os_err = root_os_error(e)
            path = (os_err.filename if os_err is not None else None) or getattr(e, "file", None)
            in_local = bool(local and isinstance(path, str) and os.path.abspath(path).startswith(
                os.path.abspath(local) + os.sep))
            flag, base = ("--lazy-save-local-dir", local) if in_local else (where, root)
            text = str(e)
            if kind(os_err or e) == "full":
                free = _free_space(root, local, where)  # ' (free space under ...)' or ''
                text += f" (the file system is full{'; ' + free[2:] if free else ')'}"
            else:
                text += advice(e, flag, base)
            parts.append(text)
        return "; then: ".join(dict.fromkeys(parts))

    def _uncommitted(self) -> List[_Pending]:
        """Saves not yet committed: the one being published, then those in flight."""
        return [p for lane in self.lanes for p in lane.uncommitted()]

    def _commit_ready(self, blocking: bool, iteration: Optional[int] = None) -> None:
        """Every rank: each lane's saves, in the same lane order everywhere (their agreements are
        collectives); a lane whose head is not durable yet never holds back the next one. At the
        end of `iteration` (a poll), the in-memory level's lane is left alone while it holds
        only that iteration's save: its copies run in the next forward/backward, and it is
        committed right after them (`before_optimizer_step`), so agreeing now would only learn
        "not yet"."""
        for lane in self.lanes:
            if iteration is not None and self._commits_ahead(lane) and \
                    lane.publishing is None and all(p.iteration == iteration
                                                    for p in lane.pending):
                continue
            self._commit_lane(lane, blocking)

    def _commits_ahead(self, lane: _Lane) -> bool:
        """The in-memory level's lane: its version is durable once copied (`WriteMode.MAPPED`
        into shared memory), and committed before the next optimizer step."""
        return lane is self.node_lane and self.config.non_persistent_in_memory

    def _commit_lane(self, lane: _Lane, blocking: bool) -> None:
        """Every rank: the lane's commit in flight settled, then its oldest saves committed, in
        order (waiting for each if `blocking`; else the commit started is agreed on at the next
        poll). One commit covers every save that every rank holds durable (`_agree_heads`), so
        a lane that has fallen behind (a slow fsync, a loaded machine) catches up at once, and
        no save is agreed on while a commit is still running: a failure is agreed on after the
        versions before it settled everywhere."""
        self._poll_engine(lane)
        while True:
            if lane.publishing is not None and not self._settle(lane, blocking):
                return
            if not lane.pending:
                return
            batch = self._agree_heads(lane, blocking)
            if not batch:
                return
            self._commit(lane, batch)
            if not blocking:
                return

    def _commit_ahead(self, lane: _Lane) -> None:
        """Every rank, in `before_optimizer_step` once the snapshot is copied: the in-memory
        level's oldest version is agreed on and its commit thread started, to run during the
        optimizer step; the next save only settles it (the commit marker is written by then)
        and takes the older version's slots."""
        self._poll_engine(lane)
        if lane.publishing is None and lane.pending:
            batch = self._agree_heads(lane, blocking=True)
            if batch:
                self._commit(lane, batch)

    def _poll_engine(self, lane: _Lane) -> None:
        for record in self._guard(lane.engine.poll) or []:
            self.durable[os.path.normpath(record.directory)] = record

    def _agree_heads(self, lane: _Lane, blocking: bool) -> List[Tuple[_Pending, List[List[int]]]]:
        """Every rank: the lane's oldest saves that every rank has durable, each with every
        rank's figures, taken off the lane in order (each verified against its replicas first):
        the oldest (waiting for it here if `blocking`; [] while some rank has not got it), then
        each next one while every rank had it durable already when the one before was agreed
        on. The in-memory level takes one: its slots hold two versions. If a later one fails
        (agreed on every rank), those before it are committed and settled first."""
        batch: List[Tuple[_Pending, List[List[int]]]] = []
        more = True
        try:
            while lane.pending and more:
                head = lane.pending[0]
                if batch and head.node_local != batch[0][0].node_local:
                    break  # another publisher
                key = os.path.normpath(head.directory)
                if blocking and not batch and head.handle is not None:
                    self._wait_durable(lane, head, key)
                after = lane.pending[1] if len(lane.pending) > 1 and \
                    not self._commits_ahead(lane) else None
                agreed = self._agree(head, key in self.durable and
                                     self._files_durable(head, blocking),
                                     self.durable.get(key),
                                     next_durable=after is not None and self._durable_here(after))
                if agreed is None:
                    break
                lane.pending.popleft()
                self.durable.pop(key)
                if head.replica_check is not None:
                    self._verify_replicas(head)  # raises ReplicaMismatch: never committed
                batch.append((head, agreed.rows))
                more = agreed.next_durable
        except CheckpointError as err:
            if batch and err.ranks is not None:  # agreed on every rank (no rank lost)
                self._commit(lane, batch)
                self._settle(lane, blocking=True)
            raise
        return batch

    def _durable_here(self, p: _Pending) -> bool:
        """Without waiting or taking anything: whether `p` is durable on this rank, its
        common.pt written and no failure on record."""
        return (os.path.normpath(p.directory) in self.durable and not p.errors
                and not self._local_errors and all(f.done() for f in p.files))

    def _wait_durable(self, lane: _Lane, head: _Pending, key: str) -> None:
        """Blocking: until `head` is durable on this rank or a failure is on record for it (or
        for this rank). The engine's wait raises any save's pending failure first: each goes
        with its own save (`_record`) and the wait goes on, once per save in flight. A save the
        engine is done with that is neither gets a failure of its own: a blocking commit ends
        with every save committed or failed, never with one still awaited."""
        for _ in range(1 + sum(len(other.pending) for other in self.lanes)):
            if key in self.durable or self._local_errors or head.errors:
                return
            records = self._guard(lambda: lane.engine.wait_for_durable(
                head.handle, timeout=self.config.drain_timeout_s))
            for record in records or []:
                self.durable[os.path.normpath(record.directory)] = record
            if records is not None:  # the engine is done with it
                break
        else:
            return
        if key not in self.durable and not self._local_errors and not head.errors:
            head.errors.append(CheckpointError(
                f"the save of iteration {head.iteration} ended on this rank without becoming "
                "durable, and its failure was not reported with it (see the errors above)",
                rank=self.rank, file=head.directory))

    def _verify_replicas(self, p: _Pending) -> None:
        """Every rank, once `p` is durable everywhere and before it commits (collective: its
        data-parallel group compares fingerprints, then every rank agrees): raises the same
        ReplicaMismatch on every rank when any group found replicas that disagree."""
        from megatron.core import parallel_state

        from .replica_check import gather_and_compare

        problems: List[str] = []
        err: Optional[BaseException] = None
        try:
            p.replica_check.wait()
            group = parallel_state.get_data_parallel_group_gloo(with_context_parallel=True)
            problems = gather_and_compare(p.replica_check, group)
        except Exception as e:  # noqa: BLE001 - agreed on below like a mismatch
            err = e
        if problems:
            err = ReplicaMismatch("; ".join(problems), rank=self.rank, file=p.directory)
        failure = control_plane.agreed_failure(
            err, f"the replica check of iteration {p.iteration}",
            describe=control_plane.reason_of)
        if failure is None:
            return
        if self.on_refused is not None:
            self.on_refused(p.iteration, p.root)
        raise ReplicaMismatch(f"{failure.reason}; {_state_of(p, p.root, self._last_published)}",
                              rank=self.rank,
                              file=p.directory, ranks=failure.ranks) from err

    def _commit(self, lane: _Lane, batch: List[Tuple[_Pending, List[List[int]]]]) -> None:
        """Every rank, saves agreed durable everywhere (`_agree_heads`): their commit started
        on the publishing rank's commit thread, one after the other."""
        pub = _Publishing([p for p, _ in batch], [])
        writes = []  # per save: whether the commit thread writes metadata.json
        for p, rows in batch:
            # megatron's only finalize function writes metadata.json on rank 0, then meets the
            # others in a barrier. The commit thread writes the same file instead, off the
            # training loop (releasing its spare waits for the journal behind the writers'
            # fsyncs: 6-20 ms here), and the agreement that follows orders the ranks. Any other
            # finalize function (a future megatron's) still runs here, as megatron would run it.
            own_metadata = _only_metadata_finalize(p.request)
            if not own_metadata:
                self._finalize(p)
            writes.append(own_metadata or self.rank != 0)
            pub.stats.append(self._stats(p, rows))
            if self.on_call_times is not None:
                calls = [r[5] / 1e9 for r in rows]
                self.on_call_times(p.iteration, p.root, min(calls), max(calls))
        if self._publishes(pub.items[0]) and not self._local_errors:
            pub.future = lane.publisher.submit(self._publish_all, pub, writes)
        lane.publishing = pub

    def _publishes(self, p: _Pending) -> bool:
        """Whether this rank commits `p`: rank 0, and for a node-local version each node's
        leader (its node's)."""
        return self.rank == 0 or (p.node_local and self.rank == self.node.leader)

    def _finalize(self, p: _Pending) -> None:
        """megatron's finalize functions of `p`, on the training thread, as megatron runs them."""
        if self._publishes(p):
            release_spare(os.path.join(p.directory, METADATA_FILENAME))
        try:
            for fn in p.request.finalize_fns:
                fn()
        except OSError as err:  # failed before megatron's barrier: meet the others there
            # megatron's json.dump into metadata.json names no file
            self._local_errors.append(naming(err, os.path.join(p.directory, METADATA_FILENAME)))
            dist.barrier()  # the one megatron's finalize would have reached (its group)

    def _settle(self, lane: _Lane, blocking: bool) -> bool:
        """All ranks: whether the commit in flight is done everywhere (waiting for it if
        `blocking`); then what follows a commit. A failed commit raises the agreed error on every
        rank, like a failed flush."""
        done, err = self._commit_done(lane.publishing, blocking)
        # Only this commit's own failure is agreed on here: an error a later save hit meanwhile
        # is that save's, agreed on (and named) when its turn comes. The same all-reduce says
        # whether every rank's in-memory peer replica is idle (then this version is handed over).
        agreed, idle = control_plane.all_reduce(
            [-1 if err is not None else int(done), int(self._replica_idle(lane))],
            op=dist.ReduceOp.MIN)
        return self._settled(lane, agreed, bool(idle), err)

    def _settles_in_plan_check(self, lane: _Lane, root: str, iteration: int) -> bool:
        """Every rank, the same answer: whether the in-memory level's save of `iteration` into
        `root` settles its lane's commit in flight in its node-local plan check: the usual case,
        one commit started ahead (`_commit_ahead`) of another iteration, no save waiting."""
        return (lane.publishing is not None and not lane.pending and self.node is not None
                and lane.publishing.pending.iteration != iteration
                and root == self.config.non_persistent_root)

    def _settle_here(self, lane: _Lane) -> _Settling:
        """Every rank, in the in-memory level's next save: this rank's side of `_settle`, waiting
        for its own commit thread; the agreement rides on that save's plan check. A publishing
        rank's commit thread has removed the older version (retention) right after its own
        commit marker and tracker (`_publish`): the plan check then orders every node's
        retention before any rank takes a slot of that version. Removed before every node's
        commit is known to have succeeded: a restart counts the newer version, committed on this
        node, as held on every node whose files are intact (`in_memory_peers`)."""
        pub = lane.publishing
        _, err = self._commit_done(pub, blocking=True)
        return _Settling(err, (int(err is not None), int(not self._replica_idle(lane))))

    def _replica_idle(self, lane: _Lane) -> bool:
        """Whether this rank's in-memory peer replica (if `lane` has one) can take a version."""
        replicator = self.memory_replicator if lane is self.node_lane else None
        return replicator is None or replicator.idle

    def _commit_done(self, pub: _Publishing, blocking: bool
                     ) -> Tuple[bool, Optional[BaseException]]:
        """Whether this rank's commit thread of `pub` is done (waiting for it if `blocking`), and
        its failure."""
        done, err = True, None
        if pub.future is not None:
            try:
                if blocking:
                    pub.future.exception(timeout=self.config.drain_timeout_s)  # waits for it
                # Read once: a commit that ends between two looks must not pass as done without
                # its failure being seen.
                done = pub.future.done()
                err = pub.future.exception() if done else None
            except FutureTimeout:
                err = CheckpointError(f"writing the commit marker and tracker took longer than "
                                      f"{self.config.drain_timeout_s:g} s (storage not "
                                      "responding?)", rank=self.rank,
                                      file=pub.items[min(len(pub.published),
                                                         len(pub.items) - 1)].directory)
        return done, err

    def _settled(self, lane: _Lane, agreed: int, idle: bool,
                 err: Optional[BaseException]) -> bool:
        """All ranks, with what every rank said about the commit in flight (`agreed`: the
        minimum of -1 failed, 0 not done, 1 done; `idle`: every in-memory peer replica idle):
        raises the agreed failure, or False while not done, or what follows the commit."""
        pub = lane.publishing
        if agreed < 0:
            self._commit_failed(lane, pub, err)
        if agreed == 0:
            return False
        self._after_publish_first(lane, pub, len(pub.items))
        if lane is self.node_lane and self.memory_replicator is not None and \
                pub.pending.node_local:  # after retention: the newest one is held
            if self._owed_replica is not None:
                self._replica_skipped(self._owed_replica, pub.pending.iteration)
            self._owed_replica = pub.pending.iteration
            if idle:
                self._hand_off_owed(idle=True)
        return True

    def _replica_skipped(self, iteration: int, newer: int) -> None:
        """All ranks: in-memory version `iteration` will never be sent (the previous transfer
        still ran when it committed, and `newer` has committed since): counted, said once per
        run, reported."""
        self.replicas_skipped += 1
        if self.replicas_skipped == 1:
            running = ("the previous transfer" if self._replica_newest is None
                       else f"the transfer of iteration {self._replica_newest}")
            self.log(f"in-memory peer replicas: iteration {iteration} is skipped (not sent to "
                     f"the next node): {running} was still running when it committed, and "
                     f"iteration {newer} has committed since (latest wins: the newest complete "
                     "version goes whenever the previous transfer is done; the versions skipped "
                     "are counted in the training summary)")
        if self.on_replica_skipped is not None:
            self.on_replica_skipped(iteration, self.replicas_skipped)

    def _hand_off_owed(self, idle: Optional[bool] = None) -> None:
        """All ranks: the newest committed in-memory version goes to the peer replicas if every
        rank's replica thread is `idle` (agreed here when not given). Besides the commit that
        made it (which says whether they are idle), a poll where the level did not save tries
        again: with --non-persistent-save-interval N > 1 a version that committed while the
        network was busy is sent when it frees up, not N iterations later with the next one
        (latest wins either way). Not while a newer version's commit is in flight (its
        retention may have removed this one), nor where the level saved at that iteration (its
        commit comes first: where it saves every iteration, no collective is added to polls)."""
        if idle is None:
            idle = bool(control_plane.all_reduce([int(self.memory_replicator.idle)],
                                                 op=dist.ReduceOp.MIN)[0])
        if idle:
            self.memory_replicator.hand_off(self._owed_replica)
            self.replicas_sent += 1
            self._replica_newest, self._owed_replica = self._owed_replica, None

    def _retain(self, p: _Pending) -> None:
        """The commit thread of a publishing rank, once `p` is committed: retention
        (`after_commit`). Its failure is agreed on at the next poll (`_after_publish` takes it
        from `p.retain_errors`)."""
        try:
            if self.after_commit is not None:
                self.after_commit(p.iteration, p.root)
        except (OSError, RuntimeError, CheckpointError) as err:
            p.retain_errors.append(err)

    def _after_publish_first(self, lane: _Lane, pub: _Publishing, count: int) -> None:
        """All ranks: `_after_publish` of `pub`'s first `count` saves, in order, each with the
        saves after it still on the lane as uncommitted (so pruning keeps their local copies:
        a crash between two of them leaves the tracker naming one whose copy is there)."""
        for k in range(count):
            rest = _Publishing(pub.items[k + 1:], pub.stats[k + 1:], pub.future)
            lane.publishing = rest if rest.items else None
            self._after_publish(pub.items[k], pub.stats[k], pub.future is not None)

    def _commit_failed(self, lane: _Lane, pub: _Publishing,
                       err: Optional[BaseException]) -> None:
        """All ranks, once some rank's commit of `pub` failed (`err`: this rank's, if any): raises
        the agreed failure, naming the ranks whose commit failed. Of several saves, the first
        that failed on any rank is named, once every rank's commit thread has stopped, and those
        before it (committed everywhere) are settled first."""
        first = 0
        if len(pub.items) > 1:
            _, err = self._commit_done(pub, blocking=True)
            mine = len(pub.published) if err is not None else len(pub.items)
            first = control_plane.all_reduce([mine], op=dist.ReduceOp.MIN)[0]
            self._after_publish_first(lane, pub, first)
            if mine != first:
                err = None  # a later save's: never committed, and the run stops at this one
        if err is not None:
            self._local_errors.insert(0, err)
        self._agree(pub.items[first], True)  # raises

    def _after_publish(self, p: _Pending, stats: Dict[str, float], published_here: bool) -> None:
        """All ranks, once `p` is committed (`published_here`: by this rank's commit thread):
        retention and the log line (publishing rank), the universal merge, local copies and
        replicas. Their failures are agreed on at the next poll."""
        self._last_published = p
        if published_here:  # retention ran on the commit thread (`_publish`)
            self._local_errors.extend(p.retain_errors)
            p.retain_errors.clear()
            try:
                if self.rank == 0:
                    self._log(p, stats)
                    if self.universal is not None and p.root == self.config.root:
                        fail_point("merge", p.iteration, self.rank, p.directory)
                        self.universal.on_commit(p.iteration, p.directory)
            except (OSError, RuntimeError, CheckpointError) as err:
                self._local_errors.append(err)
        # The in-memory level's leaders have removed its older version (retention, done at once
        # for this level, on the commit thread right after the tracker: `_publish`), so every
        # rank's shard-file slots are free for the next save once every leader is past this
        # point: the next save's plan check, its first collective, is that point (`save` asks for
        # it under ASSUME_CONSTANT too).
        if p.node_local:
            return  # the shared versions' local copies and replicas are not touched
        self._last_committed = p.iteration
        if self._merge_follower is not None and p.root == self.config.root:  # as rank 0's
            self._merge_follower.on_commit(p.iteration, p.directory)
        if self.replicator is not None:  # before pruning: the thread reads this version's files
            self.replicator.on_commit(p.iteration)
        if self.config.local_dir is not None:
            self._prune_local(p.iteration)

    def _agree_after_last_commit(self) -> None:
        """finish(), every rank: an error recorded after the last agreement (what follows the
        final commit: retention, the merge hand-off) has no later save to be agreed on with, so it
        is agreed on here, once, naming the last committed version, instead of being lost."""
        if self._last_published is not None:
            self._agree(self._last_published, True)

    def _publish_all(self, pub: _Publishing, writes: List[bool]) -> None:
        """The commit thread: each of `pub`'s saves committed in order (`_publish`), stopping
        at the first failure (raised: the tracker names the save before it)."""
        for p, write_metadata_json in zip(pub.items, writes):
            self._publish(p, write_metadata_json)
            pub.published.append(p.iteration)

    def _publish(self, p: _Pending, write_metadata_json: bool) -> None:
        """The commit thread of rank 0 (and, for a node-local version, of every node's leader for
        its node): metadata.json (unless megatron's finalize wrote it) made durable, commit
        marker, then tracker."""
        metadata = os.path.join(p.directory, METADATA_FILENAME)
        if write_metadata_json:  # what megatron's finalize writes, on rank 0 only
            from .strategies import write_metadata

            release_spare(metadata)
            try:
                write_metadata(p.directory)
            except OSError as err:  # json.dump into metadata.json names no file
                raise naming(err, metadata)
        fault_point("commit", p.iteration, self.rank)
        fail_point("commit", p.iteration, self.rank, os.path.join(p.directory, COMMIT_FILE))
        # metadata.json is written without fsync (common.pt is written durably by
        # `durable_common_save`); the commit marker must not reach the disk before it.
        if os.path.exists(metadata):
            fsync_file(metadata)
        if not try_commit(p.directory, self.world, self.node.ranks if p.node_local else None):
            raise CheckpointError("every rank reported its shards durable but the rank markers "
                                  "are not all valid", rank=self.rank, file=p.directory)
        fault_point("tracker", p.iteration, self.rank)
        fail_point("tracker", p.iteration, self.rank, os.path.join(p.root, TRACKER_FILENAME))
        write_tracker(p.root, p.iteration, self.config.run_config_json)
        # Older versions go now, off the training loop: on a shared file system listing the root
        # and renaming each one out are metadata round trips (the files are deleted by a
        # background remover). The in-memory level's slots must be free before its next save
        # takes one: that save waits for this thread first.
        self._retain(p)

    def _stats(self, p: _Pending, rows: List[List[int]]) -> Dict[str, float]:
        """The record of a commit from every rank's `_figures` (gathered by `_agree`): bytes
        summed, times the slowest rank's."""
        total = sum(r[0] for r in rows)
        stall, copy, durable, local = (max(r[k] for r in rows) / 1e9 for k in range(1, 5))
        copy_start = max(r[6] for r in rows) / 1e9
        stats = {"event": "checkpoint", "iteration": p.iteration, "bytes": int(total),
                 "stall_ms": stall * 1e3, "copy_start_ms": copy_start * 1e3,
                 "copy_ms": copy * 1e3, "durable_s": durable,
                 "gbps": total / durable / 1e9 if durable > 0 else 0.0, "ranks": self.world,
                 "t_start": p.t_start, "t_returned": p.t_returned, "time": time.time(),
                 "persistent": p.root == self.config.root}
        if self.config.local_dir is not None:  # durable_s is then the shared (ROOT) time
            stats["local_durable_s"] = local
        return stats

    def _log(self, p: _Pending, s: Dict[str, float]) -> None:
        self.log(f" checkpoint iteration {s['iteration']:8d} | bytes: {s['bytes']} | "
                 f"stall (ms): {s['stall_ms']:.1f} | copy (ms): {s['copy_ms']:.1f} | "
                 f"durable (s): {s['durable_s']:.3f} | throughput (GB/s): {s['gbps']:.3f} | "
                 f"copy start (ms): {s['copy_start_ms']:.1f} | "
                 + (f"local durable (s): {s['local_durable_s']:.3f} | "
                    if "local_durable_s" in s else "")
                 + f"committed: {p.directory}")
        self._event(s)
        if self.on_record is not None:
            self.on_record(dict(s))

    def _event(self, record: Dict[str, float]) -> None:
        """Rank 0: one JSON line per iteration end and per committed checkpoint (the timeline
        tool draws both), written off the training loop (`append_telemetry`)."""
        append_telemetry(self.config.root, record, warn=self.log)


def _join_on(checkpointer: "weakref.ref[LazyCheckpointer]", thread: int) -> None:
    """Before a use of the control group: on the training thread (`thread`), the checkpointer's
    save worker is joined first (a checkpointer no longer referenced joins nothing)."""
    ckpt = checkpointer()
    if ckpt is not None and threading.get_ident() == thread:
        ckpt._join()


def _checked(plans: SavePlanCache, plan: PreparedSave) -> bool:
    """Whether the plan check proved this save's structure the previous one's, on every rank
    (CHECK's fingerprints): the payload plan, made from that structure and forgotten whenever
    it changed, is then refilled without comparing each tensor (`PayloadPlan.flatten`)."""
    return plans.policy is StructurePolicy.CHECK and plan.reuse_distribution


def _only_metadata_finalize(request) -> bool:
    """Whether megatron's save request holds no finalize function but megatron-core 0.16's
    metadata.json writer (`serialization.save`'s `metadata_finalize_fn`)."""
    return all(getattr(fn, "__name__", None) == "metadata_finalize_fn"
               for fn in request.finalize_fns)


def _megatron_save(sharded_state_dict: Any, parts, directory: str, strategy, validate: bool,
                   steady: bool, defer: Callable[[str, bytes], None], writer: bool):
    """megatron-core's `dist_checkpointing.save` of one lazy save, asynchronous; common.pt is
    serialized with `DurableCommonSaveStrategy` and handed to `defer` on the rank that
    `writer`s it. `steady` (the save plan is reused: no validation, and the shard distribution
    is cached; and megatron's last call returned no finalize function but metadata.json's): what
    megatron's call would do is done here with `parts` (`preprocess.split`: its preprocessing in
    one walk), without its four walks of the dict; metadata.json is the commit thread's
    (`_commit`) either way. A megatron-core whose save adds finalize functions is called for
    every save."""
    from megatron.core import dist_checkpointing

    from .strategies import DurableCommonSaveStrategy, durable_common_save, \
        quiet_overwrite_warning

    if steady:
        DurableCommonSaveStrategy("torch", 1, defer, writer).save_common(parts.common, directory)
        return strategy.async_save(parts.items, directory)
    with durable_common_save(defer, writes=writer), quiet_overwrite_warning():
        return dist_checkpointing.save(sharded_state_dict, directory, sharded_strategy=strategy,
                                       async_sharded_save=True,
                                       validate_access_integrity=validate)


def prepare_and_probe_root(root: str, flag: str, prepares: bool) -> None:
    """Every rank (collective), at start-up: the rank that `prepares` creates `root` and the
    tracker's spare, every rank checks it can write there (`paths.probe_writable`); a failure on
    any rank stops every rank with the same error naming the ranks and the cause (read-only,
    full, missing, permission denied), before anything is saved. `flag` names the setting that
    chose `root` in that error."""
    rank = dist.get_rank()

    def check() -> None:
        if prepares:
            prepare_root(root)
        probe_writable(root, rank)

    control_plane.agree(check, f"checking that {flag} {root} can be written",
                        describe=lambda err: explain(err, flag, root))


def append_telemetry(root: str, record: Dict[str, Any],
                     warn: Callable[[str], None] = print) -> None:
    """Append one event (a JSON line) to ROOT's telemetry file, which the timeline tool and the
    benchmarks read. Returns at once: a background thread writes it, after every line appended
    before it (`telemetry.JsonlAppender`: a slow or hung file system never holds the caller; a
    failure is said once through `warn` and turns that file's telemetry off). `finish` and the
    process's exit write what is queued."""
    telemetry.appender(os.path.join(root, TELEMETRY_FILENAME), warn).append(record)


def _figures(p: _Pending, record) -> List[int]:
    """What this rank reports of `p` when agreeing on it: its bytes and its times in ns (stall,
    copy, durable, node-local durable, save call, copy start); zeros while it has no durable
    `record`."""
    if record is None:
        return [0] * 7
    return [int(record.bytes)] + [int(round(s * 1e9)) for s in (
        p.stall_s, record.copy_s, record.durable_s, record.local_durable_s or 0.0, p.call_s,
        p.copy_start_s)]


def _state_of(p: _Pending, root: str, newest: Optional[_Pending] = None) -> str:
    """What a failed save left behind, for the agreed error message; `newest`: the newest
    version committed in this run, named when it is of another level and newer than `root`'s
    (e.g. in memory: a restart on these nodes resumes from it)."""
    latest = tracked_iteration(root)
    if newest is not None and newest.root != root and newest.iteration > (latest or -1):
        return (f"{_state_of(p, root)}; iteration {newest.iteration} is complete on another "
                f"level, in {newest.directory}, which a restart"
                + (" on these nodes" if newest.node_local else "") + " takes")
    committed = is_committed(p.directory)
    if committed and latest == p.iteration:  # failed after the tracker moved
        return f"this one is complete and {TRACKER_FILENAME} names it"
    if committed:  # the marker was written, then the tracker failed
        return (f"this one is complete ({p.directory} has its commit marker) but "
                f"{TRACKER_FILENAME} could not be moved to it: it still names "
                f"{'no iteration' if latest is None else f'iteration {latest}'}, which --load "
                "will use")
    intact = ("no earlier checkpoint was completed" if latest is None else
              f"earlier checkpoints are intact (newest complete: iteration {latest})")
    return (f"{intact}, and this one is not marked complete: {p.directory} is never loaded, and "
            "a later save of that iteration moves it aside (it can also be deleted by hand)")


def _free_space(root: Optional[str], local_dir: Optional[str] = None,
                root_label: str = "--save") -> str:
    """' (free space under --save: N MiB[; under --lazy-save-local-dir D: M MiB])' for error
    messages (`root_label` names `root`, e.g. a non-persistent root); parts that cannot be
    measured are left out."""
    parts = []
    for label, path in ((root_label, root), (f"--lazy-save-local-dir {local_dir}", local_dir)):
        try:
            parts.append(f"under {label}: {shutil.disk_usage(path).free / 2**20:.1f} MiB")
        except (OSError, TypeError):
            pass
    return f" (free space {'; '.join(parts)})" if parts else ""
