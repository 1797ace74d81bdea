"""`--async-lazy-save`: the trainer's side of DataStates lazy asynchronous checkpoints.

The trainer decides *what* is saved (megatron-core's sharded state dict, and with the distributed
optimizer its parameter state as this rank's own live slices) and *when* (the base class's
interval policy). Everything else (engine, strategy, agreement across ranks, commit marker,
tracker, telemetry, background merge) is `datastates.megatron_adapter.LazyCheckpointer`; the call
order is in its module docstring:

  maybe_save -> LazyCheckpointer.save          (right after optimizer step i, returns at once)
  before_optimizer_step -> before_optimizer_step   (before step i+1: waits only if not copied yet)
  after_iteration -> poll                       (agree, commit, tracker, retention, merge)
                     then universal retention     (after a merge committed: --keep-last-n-universal)
  finalize -> finish                            (drain and commit before exit, wait for merges)

Each committed checkpoint's record (bytes, stall, copy, durable time; what the checkpointer logs
and appends to SAVE/datastates_checkpoints.jsonl) reaches `metrics` on rank 0 through the
checkpointer's `on_record` callback.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Tuple

import torch.distributed as dist

import datastates
from datastates import Checksum, control_plane
from datastates.megatron_adapter import FailurePolicy, LazyCheckpointer, LazySaveConfig, \
    StructurePolicy, append_telemetry, check_memory_room, expand_local_dir, needed_saved_ranks, \
    drop_node_local_newer, \
    bring_needed, node_index, paths, release_memory, restore_before_load

from megatron.training.checkpointing import distopt_shards
from megatron.training.checkpointing.contents import (
    OPTIMIZER_METADATA,
    CheckpointError,
    SaveValues,
    TrainState,
    build_sharded_state_dict,
    save_values,
)
from megatron.training.checkpointing.manager import LEVEL_NAMES, CheckpointManager, newer_than, \
    non_persistent_root_of_this_rank
from megatron.training.arguments import host_cache_budget_mb
from megatron.training.config import RunConfig
from megatron.training.log import print_rank_0, say
from megatron.training.metrics import CheckpointRecord
from megatron.training.checkpointing.retention import apply_retention
from megatron.training.checkpointing.state_cache import SaveStateCache


def local_dir_of_this_rank(config: RunConfig) -> Optional[str]:
    """--lazy-save-local-dir with its placeholders filled in for this rank (None: not given)."""
    template = config.checkpoint.lazy_save_local_dir
    return None if template is None else expand_local_dir(template, dist.get_rank())


#: The default host cache is what this rank's checkpoint can hold: at least this many MiB, and at
#: most this fraction of the rank's share of the node's free memory (`host_cache_budget_mb`).
AUTO_CACHE_MIN_MB, AUTO_CACHE_MEMORY_FRACTION = 16, 0.5


def _optimizer_bytes(element_size: int) -> int:
    """Adam's two fp32 moments, plus the fp32 main copy of a bf16/fp16 parameter, per element."""
    return 8 + (4 if element_size < 4 else 0)


def checkpoint_bytes_bound(model, distributed_optimizer: bool = False) -> int:
    """Upper bound of the tensor bytes one checkpoint of this rank holds: its parameters (as if it
    wrote every data-parallel replica) and their optimizer state. That state is counted for every
    local parameter, or, with the distributed optimizer, for this rank's shard of each of
    megatron DDP's parameter buffers (padded size / data-parallel size): what it owns and saves,
    an fp32 main parameter and two Adam moments per element (`distopt_shards.STATE_KEYS`), even
    for an fp32 model."""
    total = 0
    for chunk in model:
        params = list(chunk.parameters())
        total += sum(p.numel() * p.element_size() for p in params)
        # megatron DDP's lists (on a plain module, `buffers` is nn.Module's method)
        buffers = [b for name in ("buffers", "expert_parallel_buffers")
                   if isinstance(getattr(chunk, name, None), list) for b in getattr(chunk, name)]
        if distributed_optimizer and buffers:
            total += sum(b.numel // b.data_parallel_world_size for b in buffers) \
                * 4 * len(distopt_shards.STATE_KEYS)
        else:
            total += sum(p.numel() * _optimizer_bytes(p.element_size()) for p in params)
    return total


def _checkpoint_bound_mb(config: RunConfig, model) -> int:
    """`checkpoint_bytes_bound` for this run's optimizer, in MiB rounded up: what the host cache
    and the peer replica are sized against."""
    return -(-checkpoint_bytes_bound(model, config.parallel.use_distributed_optimizer) // 2**20)


def size_host_cache(config: RunConfig, model) -> RunConfig:
    """`config` with the host cache sized, when --async-lazy-save is on and --lazy-save-cache-mb
    was not given: this rank's checkpoint bound (at least AUTO_CACHE_MIN_MB), so that the
    snapshot of a save never waits for the disk, unless that is more than
    AUTO_CACHE_MEMORY_FRACTION of this rank's share of the node's free memory. A smaller cache
    still works (the checkpoint streams through it), but then the snapshot of every save waits
    until the writers have drained what does not fit: the log warns."""
    ckpt = config.checkpoint
    if not ckpt.async_lazy_save or ckpt.lazy_save_cache_mb is not None:
        return config
    bound_mb = _checkpoint_bound_mb(config, model)
    budget_mb, _, _ = host_cache_budget_mb()
    limit_mb = max(1, int(budget_mb * AUTO_CACHE_MEMORY_FRACTION))
    mb = min(max(AUTO_CACHE_MIN_MB, bound_mb), limit_mb)
    print_rank_0(f"DataStates host cache: {mb} MiB per rank (a checkpoint of rank 0 holds at most "
                 f"{bound_mb} MiB; at least {AUTO_CACHE_MIN_MB} MiB, at most "
                 f"{AUTO_CACHE_MEMORY_FRACTION:g} of the {budget_mb} MiB of free memory per rank; "
                 "--lazy-save-cache-mb sets it)")
    if mb < bound_mb:
        print_rank_0(f"WARNING: the DataStates host cache ({mb} MiB) may not hold a whole "
                     f"checkpoint of rank 0 ({bound_mb} MiB at most): each save's snapshot then "
                     "waits before the next optimizer step until the writers have drained the "
                     "rest to storage. Free host memory or give --lazy-save-cache-mb")
    return dataclasses.replace(config, checkpoint=dataclasses.replace(ckpt, lazy_save_cache_mb=mb))


def check_memory_level(config: RunConfig, model) -> None:
    """--non-persistent-ckpt-type in_memory, every rank (collective), at start-up: each node's
    shared memory must hold the versions it keeps (`check_memory_room`), else every rank stops
    with one error naming the size needed and what is free; rank 0 says what the level holds."""
    ckpt = config.checkpoint
    if ckpt.non_persistent_ckpt_type != "in_memory" or ckpt.non_persistent_save_root() is None:
        return
    root = non_persistent_root_of_this_rank(config)
    bound = checkpoint_bytes_bound(model, config.parallel.use_distributed_optimizer)
    try:
        room = check_memory_room(root, dist.get_rank(), node_index(), bound,
                                 ckpt.keep_last_n_non_persistent,
                                 ckpt.async_lazy_save and ckpt.lazy_save_peer_replica)
    except datastates.CheckpointError as err:
        raise CheckpointError(err.reason, path=root, ranks=err.ranks) from err  # printed once
    held = f"{room.versions} versions of its {room.ranks} rank(s)' checkpoints" + (
        f" and {room.peer_versions} of the previous node's (peer replicas)"
        if room.peer_versions else "")
    every = ("at an interval set from their own measured cost (--save-interval auto)"
             if ckpt.non_persistent_save_interval_auto
             else f"every {ckpt.non_persistent_save_interval} iteration(s)")
    print_rank_0(f"in-memory checkpoints: {every} into {root}; node {room.node} holds up to "
                 f"{room.need_bytes / 2**20:.0f} MiB ({held}; "
                 f"{room.free_bytes / 2**20:.0f} MiB free); removed at a clean end "
                 "once --save holds the newest iteration")


def size_peer_replica(config: RunConfig, model) -> RunConfig:
    """`config` with --lazy-save-peer-replica-mb resolved (default: twice this rank's checkpoint
    bound: its own shards and the replica it receives). Every rank, collective: a budget below
    any rank's bound stops every rank with one error naming them."""
    ckpt = config.checkpoint
    if not (ckpt.async_lazy_save and ckpt.lazy_save_peer_replica):
        return config
    bound_mb = _checkpoint_bound_mb(config, model)
    mb = ckpt.lazy_save_peer_replica_mb or 2 * bound_mb
    short = [(r, b) for r, b in enumerate(control_plane.all_gather_ints(
        bound_mb if mb < bound_mb else 0)) if b]
    if short:
        raise CheckpointError(
            f"--lazy-save-peer-replica-mb {mb} is smaller than one rank's checkpoint: "
            + ", ".join(f"rank {r} holds up to {b} MiB" for r, b in short)
            + f"; give at least {2 * max(b for _, b in short)} MiB (its own shards and the replica "
            "it receives), or drop the flag for the default", path=ckpt.lazy_save_local_dir,
            ranks=[r for r, _ in short])  # every rank raises it: printed once
    if ckpt.non_persistent_ckpt_type == "in_memory":
        print_rank_0(f"DataStates peer replicas: the newest complete in-memory checkpoint, sent "
                     f"to the next node whenever the previous one has arrived (latest wins); up "
                     f"to {mb} MiB per rank (its own shards and the replica of the previous "
                     "node's)")
    else:
        print_rank_0(f"DataStates peer replicas: up to {mb} MiB per rank in "
                     f"{ckpt.lazy_save_local_dir} (its own shards of the newest committed "
                     "checkpoint and the replica of the previous node's)")
    return dataclasses.replace(config, checkpoint=dataclasses.replace(
        ckpt, lazy_save_peer_replica_mb=mb))


class PeerRestore:
    """--lazy-save-peer-replica at --load, every rank (collective): before the reader is built,
    intact copies of every saved rank's shards are put back on both of their holders' nodes
    from whichever still has one (`datastates.megatron_adapter.levels.peer_replica`); after the load,
    `report` says per rank what came from a peer, the node-local copy and --save, and rank 0
    appends it to the telemetry under --save (a `restore` event)."""

    def __init__(self, config: RunConfig, directory: str, world_size: int, sharded_state_dict,
                 assembled: bool = False):
        """`assembled`: `directory` is an in-memory version assembled for this run's layout
        (`assemble_memory_for_layout`): its nodes receive the shard files they lack into it."""
        self.config, self.directory, self.assembled = config, directory, assembled
        needed = needed_saved_ranks(directory, sharded_state_dict)
        if assembled:
            self.stats = bring_needed(directory, directory, world_size, needed)
        else:
            self.stats = restore_before_load(directory, local_dir_of_this_rank(config),
                                             world_size, needed)
        rank = dist.get_rank()
        for saved, (frm, nbytes, seconds) in sorted(self.stats.received.items()):
            say(f"[rank {rank}] received saved rank {saved}'s shards from peer rank {frm}: "
                f"{nbytes / 2**20:.2f} MiB in {seconds:.3f} s")

    def report(self, last_read: dict) -> None:
        rank = dist.get_rank()
        if self.stats.unavailable and rank == 0:
            say(f"no intact memory copy of saved rank(s) {self.stats.unavailable} on any node: "
                f"read from {self.directory}")
        src = last_read["sources"]
        if self.assembled:  # an in-memory version: every byte read came from this node's memory
            nbytes, seconds = (sum(v[i] for v in src.values()) for i in (0, 1))
            src = {"local": (nbytes, seconds)}
            say(f"[rank {rank}] restored shards from memory {self.directory}: "
                f"{nbytes / 2**20:.2f} MiB in {seconds:.3f} s")
        mine = [sum(n for _, n, _ in self.stats.received.values()),
                src.get("local", (0, 0.0))[0], src.get("shared", (0, 0.0))[0],
                int(1e6 * sum(s for _, s in src.values()))]
        rows = control_plane.all_gather_ints(mine)
        root = self.config.checkpoint.save
        if rank != 0 or root is None:
            return
        event = {"event": "restore", "iteration": paths.iteration_of(self.directory),
                 "time": time.time(), "ranks": {
                     str(r): {"peer_bytes": p, "local_bytes": loc, "shared_bytes": sh,
                              "read_s": us / 1e6} for r, (p, loc, sh, us) in enumerate(rows)}}
        append_telemetry(root, event)  # written off this thread, after the lines before it


def restore_peer_copies(config: RunConfig, directory: str, sharded_state_dict,
                        assembled: bool = False) -> Optional[PeerRestore]:
    """`PeerRestore` of what loading `sharded_state_dict` reads from a DataStates checkpoint
    when --lazy-save-peer-replica is on, or from an in-memory version `assembled` for this run's
    layout; else None."""
    ckpt = config.checkpoint
    commit = os.path.join(directory, paths.DATASTATES_COMMIT_FILENAME)
    if not assembled:
        if not (ckpt.async_lazy_save and ckpt.lazy_save_peer_replica and os.path.isfile(commit)):
            return None
        if ckpt.lazy_save_local_dir is None:  # with the in-memory level, its versions are
            return None                       # replicated, not --save's
    with open(commit) as f:
        world = int(json.load(f)["world_size"])
    return PeerRestore(config, directory, world, sharded_state_dict, assembled)


def lazy_save_config(config: RunConfig) -> LazySaveConfig:
    """The adapter's typed config from the run's flags."""
    ckpt = config.checkpoint
    return LazySaveConfig(
        local_dir=local_dir_of_this_rank(config), local_keep=ckpt.lazy_save_local_keep,
        fully_parallel_save=ckpt.ckpt_fully_parallel_save,
        structure_policy=(StructurePolicy.ASSUME_CONSTANT if ckpt.ckpt_assume_constant_structure
                          else StructurePolicy.CHECK),
        root=ckpt.save, non_persistent_root=non_persistent_root_of_this_rank(config),
        non_persistent_node_local=(ckpt.non_persistent_node_local
                                   and ckpt.non_persistent_save_root() is not None),
        non_persistent_in_memory=(ckpt.non_persistent_ckpt_type == "in_memory"
                                  and ckpt.non_persistent_save_root() is not None),
        non_persistent_keep=ckpt.keep_last_n_non_persistent,
        cache_bytes=ckpt.lazy_save_cache_mb << 20,
        peer_replica_bytes=(ckpt.lazy_save_peer_replica_mb << 20
                            if ckpt.lazy_save_peer_replica else None),
        checksum=Checksum(ckpt.lazy_save_checksum), drain_timeout_s=ckpt.ckpt_drain_timeout,
        failure_policy=FailurePolicy(ckpt.ckpt_failure_policy.value),
        verify_replicas_every=ckpt.ckpt_verify_replicas,
        offload_steady_saves=not ckpt.lazy_save_on_training_thread,
        checksum_threads=ckpt.lazy_save_checksum_threads,
        run_config_json=config.to_json(),
        universal_every_n=ckpt.universal_checkpoint_interval,
        universal_root=ckpt.universal_save, universal_workers=ckpt.universal_merge_workers)


class LazyCheckpointManager(CheckpointManager):
    """Saves through `LazyCheckpointer`; logs each checkpoint when it is committed."""

    log_save_calls = False

    def __init__(self, config: RunConfig):
        super().__init__(config)
        self._merges_retained = 0  # merges whose universal retention has run (rank 0)
        self.state_cache = SaveStateCache()  # what saves keep of each other (`_state_dict`)
        # Rank 0: checkpoints retention renamed away are deleted here, off the training thread
        # (~200 ms per commit for the 117M GPT); drained by `finalize`.
        self._trash = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retention")
        self.checkpointer = LazyCheckpointer(
            lazy_save_config(config), log=print_rank_0, after_commit=self._after_commit,
            on_call_times=self._report_save_times,
            on_record=lambda r: self._record(CheckpointRecord.from_telemetry(
                r, "persistent" if r.get("persistent", True)
                else self.ckpt.non_persistent_ckpt_type)), on_refused=self._refused,
            on_replica_skipped=self._replica_skipped)

    def start(self) -> None:
        # The checkpointer prepared and probed its roots when it was built.
        self.scan_existing()
        self.checkpointer.leftovers = {root: set(its)
                                       for root, its in self.leftovers_at_start.items()}

    def _refused(self, iteration: int, root: str) -> None:
        """Every rank: the replica check refused the version of `iteration` (counted in the
        summary; rank 0 writes it to TensorBoard)."""
        self.saves_refused += 1
        if dist.get_rank() == 0:
            self.metrics.checkpoint_refused(iteration, self.saves_refused)

    def _replica_skipped(self, iteration: int, skipped_total: int) -> None:
        """Every rank: the in-memory peer replicas skipped the version of `iteration` (latest
        wins); rank 0 writes the count to TensorBoard."""
        if dist.get_rank() == 0:
            self.metrics.checkpoint_replica_skipped(iteration, skipped_total)

    def replica_counts(self) -> Optional[Tuple[int, int]]:
        c = self.checkpointer
        return None if c.memory_replicator is None else (c.replicas_sent, c.replicas_skipped)

    def begin_training(self, start_iteration: int, loaded: Optional[str] = None) -> None:
        """Every rank (collective with a node-local level): node-local versions newer than the
        iteration this run starts from are removed by each node's leader (`drop_node_local_newer`:
        not every node held them intact (--ckpt-fallback-to-previous skipped a damaged one), or
        they were of another model or layout or of a --load made anew), then the roots are scanned again, so the run's own
        saves of those iterations never meet them. Every rank's --lazy-save-local-dir copies of
        newer iterations go too. Then the shared roots' newer checkpoints are set aside
        (`set_aside_newer`)."""
        node = self.checkpointer.node
        if node is not None:
            root = self.non_persistent_root
            removed = []
            if dist.get_rank() == node.leader:
                try:
                    removed = drop_node_local_newer(root, start_iteration)
                except OSError as err:
                    say(f"[rank {dist.get_rank()}] WARNING: could not remove the node-local "
                        f"versions newer than iteration {start_iteration} under {root}: {err}")
            if removed:
                level = LEVEL_NAMES[self.ckpt.non_persistent_ckpt_type]
                say(f"[rank {dist.get_rank()}] {level} checkpoints: removed iteration(s) "
                    f"{removed} from {root}: newer than iteration {start_iteration}, which "
                    "this run starts from (not every node held them intact, they were of "
                    "another model or layout or of a --load made anew, or --ckpt-step named an "
                    "older one); they are saved again")
            control_plane.barrier()
            self.start()
        try:
            copies = self.checkpointer.drop_local_copies_newer(start_iteration)
        except OSError as err:
            copies = []
            say(f"[rank {dist.get_rank()}] WARNING: could not remove the --lazy-save-local-dir "
                f"copies newer than iteration {start_iteration}: {err}")
        if copies:
            print_rank_0(f"--lazy-save-local-dir: removed the copies of iteration(s) {copies} "
                         f"under {self.checkpointer.config.local_dir}: newer than iteration "
                         f"{start_iteration}, which this run starts from (another run's; a "
                         "restart reads a copy only where it matches --save's checkpoint)")
        super().begin_training(start_iteration, loaded)

    def set_aside_newer(self, start_iteration: int, loaded: Optional[str] = None) -> None:
        """`CheckpointManager.set_aside_newer`, and with --universal-checkpoint-interval the
        universal root's newer merges too (they are of the other run's checkpoints; a later
        --load of that root would take them). Rank 0 lists and moves them; agreed on."""
        super().set_aside_newer(start_iteration, loaded)
        if not self.ckpt.universal_checkpoint_interval:
            return

        def universal() -> None:
            merger = self.checkpointer.universal  # rank 0's; None where it cannot merge
            if dist.get_rank() != 0 or merger is None:
                return
            root = merger.config.root
            complete = paths.complete_iterations(root)
            newer = newer_than(root, complete, start_iteration, loaded)
            if newer:
                self.supersede(root, complete, newer, start_iteration,
                               then="this run merges its own checkpoints there")

        self.agreed(universal, f"setting aside the universal checkpoints newer than iteration "
                               f"{start_iteration}", None, None)

    @property
    def disabled(self) -> bool:
        return self.checkpointer.disabled

    def _decided(self, iteration: int, root: str) -> Optional[bool]:
        if self.checkpointer.disabled:
            return False  # --ckpt-failure-policy continue after a failure: no more saves
        if self.checkpointer.in_flight(iteration, root):
            return True  # e.g. the end-of-training save right after an interval save
        return None

    def _persistent_busy(self) -> bool:
        """Latest wins for --save while a node-local level (in memory or on local storage)
        holds every newer version; without one each persistent save is the newest copy a crash
        can resume from, so none is deferred. The lane's state is agreed on every rank."""
        return (self.ckpt.non_persistent_node_local and self.non_persistent_root is not None
                and not self.ckpt.lazy_save_wait_persistent and self.checkpointer.busy())

    def _times_reported_at_commit(self, root: str) -> bool:
        # From the figures each version's agreement gathers: a collective right after the call
        # would wait for a steady save's work, which runs on the checkpointer's save worker.
        return True

    def _save(self, state: TrainState, root: str) -> None:
        called = time.perf_counter()
        # Taken now: the next forward/backward changes them; the rest of the dict may be built
        # on the checkpointer's save worker meanwhile (a steady save).
        values = save_values(state, self.config, self.ckpt.save_rng)
        self.checkpointer.save_built(state.iteration, lambda: self._state_dict(state, values),
                                     content_metadata=dict(OPTIMIZER_METADATA), root=root,
                                     called_at=called)

    def _state_dict(self, state: TrainState, values: SaveValues):
        """What torch_dist would save; with the distributed optimizer, its parameter state as
        this DP rank's own live slices (no gather at save time, see distopt_shards). The model's
        and the optimizer's parts come from `SaveStateCache` while they can only be what megatron
        would build again (each save gets its own copy): a level may save every iteration.
        `values`: taken in the save call (`save_values`): this may be built after it."""
        lazy_optim = (self.ckpt.save_optim and self.config.parallel.use_distributed_optimizer
                      and distopt_shards.supported(state.optimizer))
        sd = build_sharded_state_dict(state, self.config, is_loading=False,
                                      include_optim=self.ckpt.save_optim and not lazy_optim,
                                      include_rng=self.ckpt.save_rng,
                                      cache=self.state_cache, values=values)
        if not lazy_optim:
            return sd, ()
        boxes = self.state_cache.boxes.get(state.optimizer, sd)
        sd["optimizer"] = distopt_shards.optimizer_common_state(state.optimizer)
        sd["opt_param_scheduler"] = values.scheduler
        return sd, boxes

    def validation_done(self, iteration: int, t_start: float, t_end: float) -> None:
        self.checkpointer.record({"event": "validation", "iteration": iteration,
                                  "t_start": t_start, "time": t_end})

    def before_optimizer_step(self) -> None:
        self.checkpointer.before_optimizer_step()

    def _poll(self, iteration: int) -> None:
        self.checkpointer.poll(iteration)
        self._universal_retention()

    def finalize(self) -> None:
        try:
            self.checkpointer.finish()
            self._universal_retention()
            self._release_memory_level()
        finally:
            self._trash.shutdown(wait=True)

    def _release_memory_level(self) -> None:
        """--non-persistent-ckpt-type in_memory, after everything was committed: each node's
        leader gives its shared memory back when --save holds a version at least as new as the
        newest in memory (otherwise it stays, for a restart on these nodes to resume from)."""
        node = self.checkpointer.node
        if (self.ckpt.non_persistent_ckpt_type != "in_memory" or node is None
                or dist.get_rank() != node.leader or self.checkpointer.disabled):
            return
        root = self.non_persistent_root
        try:
            removed = release_memory(root, self.ckpt.save)
        except OSError as err:
            say(f"[rank {dist.get_rank()}] WARNING: could not remove the in-memory checkpoints "
                f"under {root}: {err}")
            return
        if removed:
            print_rank_0(f"in-memory checkpoints: removed iteration(s) {removed} from {root} "
                         f"(--save holds iteration {paths.tracked_iteration(self.ckpt.save)})")

    def _remove(self, trash: str) -> None:
        self._trash.submit(shutil.rmtree, trash, ignore_errors=True)

    def _in_use(self) -> List[int]:
        """The sources of the merge that runs and of the one that waits: a merge process holds
        its source (`fileio.hold_for_reading`) only once it has started, and a waiting one not
        at all, so rank 0 asks its merger too."""
        merger = self.checkpointer.universal
        return [] if merger is None else merger.iterations_in_use()

    def _universal_retention(self) -> None:
        """Rank 0, after each merge that committed: --keep-last-n-universal under the
        universal root (its tracker names the newest universal checkpoint)."""
        merger, keep = self.checkpointer.universal, self.ckpt.keep_last_n_universal
        if merger is None or not keep or len(merger.results) == self._merges_retained:
            return
        self._merges_retained = len(merger.results)
        latest = paths.tracked_iteration(merger.config.root)
        if latest is None:
            return
        done = apply_retention(merger.config.root, keep, latest)
        if done.kept_in_use:
            print_rank_0(f"retention: keeping universal iteration(s) {done.kept_in_use} under "
                         f"{merger.config.root} for now: a converter is reading them")
