"""Predict checkpoint stalls, checkpoint throughput and end-to-end time at scale.

The model follows one rank that holds the most checkpoint bytes (the slowest rank sets the stall,
since every variant ends a save with a collective) through a run, iteration by iteration:
compute phases (forward, backward, update), the blocking part of each checkpoint, and the
background copy/flush work whose completion later iterations may have to wait for.

Bandwidths a rank sees:
- pinned device-to-host copies: ``d2h_gbps`` per GPU (DataStates' lazy copy);
- staging into freshly allocated pageable host memory (what ``torch.save`` of GPU tensors and a
  copy-then-flush snapshot pay, page faults included): ``staging_gbps`` per rank;
- writing: ``streams * write_stream_gbps``, capped by the node's share of ``node_write_gbps`` and
  the job's share of ``fs_aggregate_gbps`` when every rank writes at once.
Plus ``coordination_s`` (+ ``coordination_s_per_mp_rank`` per model-parallel rank) of blocking
bookkeeping per checkpoint (barriers, metadata, file creation), the same for every variant.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Variant(str, enum.Enum):
    """How a checkpoint is taken."""

    TORCH_SAVE = "torch"
    """Synchronous torch.save per rank: stage to pageable memory, one write stream, then resume."""
    TORCH_DIST = "torch_dist"
    """Synchronous torch_dist: stage to host, ``dist_streams`` write threads per rank, then resume."""
    TORCH_DIST_ASYNC = "torch_dist_async"
    """Copy-then-flush: block while staging to host, flush in the background; the next save waits
    for the previous flush (one save in flight, as Megatron's async queue does)."""
    DATASTATES_LAZY = "datastates_lazy"
    """Lazy: pinned D2H copy overlaps the next forward/backward and blocks only before the next
    update; a bounded host cache drains to storage in the background (back-pressure when full)."""
    DATASTATES_MEMORY = "datastates_memory"
    """Beyond the paper: lazy saves into each node's shared memory (the in-memory level, copied
    once, at ``d2h_gbps``) at every checkpoint interval, and a lazy save to storage (as
    ``datastates_lazy``) every ``persistent_every`` of them; one that falls due while the previous
    is still flushing is taken at the first iteration after it is durable (latest wins), and the
    end of training saves to storage once more unless its last iteration is there already."""


PAPER_VARIANTS = (Variant.TORCH_SAVE, Variant.TORCH_DIST, Variant.TORCH_DIST_ASYNC,
                  Variant.DATASTATES_LAZY)
"""The variants the paper compares (examples/slurm runs these unless told otherwise)."""


@dataclass(frozen=True)
class Platform:
    """Machine figures (per GPU, per rank, per node or per job as named).

    Defaults are the paper's Polaris platform as calibrated in ``tools/scale/paper_polaris.json``.
    """

    gpus_per_node: int = 4
    """Ranks per node (one per GPU)."""
    d2h_gbps: float = 25.0
    """Pinned device-to-host bandwidth per GPU, GB/s."""
    staging_gbps: float = 2.27
    """Copy into newly allocated pageable host memory per rank, GB/s (page faults included)."""
    write_stream_gbps: float = 1.89
    """One writer thread's bandwidth to the file system, GB/s."""
    node_write_gbps: float = 50.0
    """A node's injection bandwidth to storage, GB/s."""
    fs_aggregate_gbps: float = 650.0
    """File-system aggregate write bandwidth available to the job, GB/s."""
    host_cache_gb_per_node: float = 256.0
    """Host memory per node for DataStates' cache, GB."""
    dist_streams: int = 2
    """Writer threads per rank for torch_dist (megatron-core's default ``thread_count``)."""
    coordination_s: float = 0.26
    """Blocking bookkeeping per checkpoint, seconds."""
    coordination_s_per_mp_rank: float = 0.0176
    """Extra blocking bookkeeping per model-parallel rank (TP * PP), seconds."""


@dataclass(frozen=True)
class Phases:
    """One training iteration without checkpoints, seconds."""

    forward: float
    backward: float
    update: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.update


@dataclass(frozen=True)
class ScaleCase:
    """One run to predict."""

    name: str
    bytes_per_rank: tuple[int, ...]
    """Checkpoint bytes each rank writes; the maximum sets the stall."""
    mp_ranks: int
    """Model-parallel ranks (TP * PP)."""
    phases: Phases
    iterations: int
    checkpoint_interval: int

    @property
    def ranks(self) -> int:
        return len(self.bytes_per_rank)

    @property
    def checkpoint_bytes(self) -> int:
        return sum(self.bytes_per_rank)


@dataclass(frozen=True)
class Prediction:
    """What the model predicts for one variant of one case."""

    variant: Variant
    stall_per_checkpoint_s: float
    """Training time lost per checkpoint (blocking + waits), excluding the end-of-run drain."""
    checkpoint_throughput_gbps: float
    """Checkpoint bytes (all ranks) / stall per checkpoint."""
    end_to_end_s: float
    """Run time including the wait for the last checkpoint to be durable."""
    end_to_end_no_checkpoint_s: float
    final_drain_s: float
    breakdown: dict = field(default_factory=dict)
    """Seconds per checkpoint by cause (coordination, staging, write, d2h_wait, back_pressure)."""
    storage_saves: int = 0
    """Checkpoints written to storage (datastates_memory: the others went to memory only)."""


def _write_gbps(platform: Platform, streams: int, ranks: int) -> float:
    ranks_per_node = min(platform.gpus_per_node, ranks)
    return min(streams * platform.write_stream_gbps, platform.node_write_gbps / ranks_per_node,
               platform.fs_aggregate_gbps / ranks)


def predict(case: ScaleCase, platform: Platform, variant: Variant,
            persistent_every: int = 10) -> Prediction:
    """Simulate ``case`` with checkpoints taken by ``variant`` (``persistent_every``: for
    ``datastates_memory``, the in-memory versions per save to storage)."""
    if case.iterations < 1 or case.checkpoint_interval < 1 or persistent_every < 1:
        raise ValueError(f"iterations, checkpoint interval and persistent_every must be >= 1, got "
                         f"{case.iterations}, {case.checkpoint_interval} and {persistent_every}")
    size_gb = max(case.bytes_per_rank) / 1e9
    coordination = platform.coordination_s + platform.coordination_s_per_mp_rank * case.mp_ranks
    sim = _Simulation(case, platform, variant, size_gb, coordination)
    for iteration in range(1, case.iterations + 1):
        due = iteration % case.checkpoint_interval == 0
        if variant is Variant.DATASTATES_MEMORY:
            sim.memory_iteration(due, due and (iteration // case.checkpoint_interval)
                                 % persistent_every == 0, last=iteration == case.iterations)
        else:
            sim.iteration(take_checkpoint=due)
    base = case.iterations * case.phases.total
    checkpoints = case.iterations // case.checkpoint_interval
    stall = (sim.clock - base) / checkpoints if checkpoints else 0.0
    drain = max(0.0, sim.flush_end - sim.clock, sim.copy_end - sim.clock)
    throughput = case.checkpoint_bytes / 1e9 / stall if stall > 0 else float("inf")
    breakdown = {k: v / checkpoints for k, v in sim.causes.items()} if checkpoints else {}
    return Prediction(variant, stall, throughput, sim.clock + drain, base, drain, breakdown,
                      sim.storage_saves)


class _Simulation:
    """Clock of the slowest rank; background work is tracked by completion times."""

    def __init__(self, case, platform, variant, size_gb, coordination):
        self.case, self.platform, self.variant = case, platform, variant
        self.size_gb, self.coordination = size_gb, coordination
        self.clock = 0.0
        self.copy_end = 0.0  # lazy D2H copy of the latest snapshot
        self.flush_end = 0.0  # background flush of the latest snapshot
        self.flush_ends: list[float] = []  # per snapshot, for the host-cache capacity
        self.causes = {"coordination": 0.0, "staging": 0.0, "write": 0.0, "back_pressure": 0.0,
                       "d2h_wait": 0.0}
        self.persistent_owed = False  # datastates_memory: a save to storage deferred (latest wins)
        self.storage_saves = 0

    def _block(self, cause: str, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self.causes[cause] += seconds
        self.clock += seconds

    def iteration(self, take_checkpoint: bool) -> None:
        self._compute()
        if take_checkpoint:
            self._checkpoint()

    def _compute(self) -> None:
        phases = self.case.phases
        self.clock += phases.forward + phases.backward
        # Only the update mutates the state: a lazy copy must be finished before it.
        self._block("d2h_wait", self.copy_end - self.clock)
        self.clock += phases.update

    def memory_iteration(self, due: bool, persistent_due: bool, last: bool) -> None:
        """datastates_memory: one iteration, then the save it takes: to storage when one is due
        (or owed) and the previous one is durable, else into memory when the interval says so;
        the last iteration ends on storage."""
        self._compute()
        self.persistent_owed = self.persistent_owed or persistent_due
        if self.persistent_owed and self.flush_end <= self.clock:
            self.persistent_owed = False
            self._checkpoint()
            return
        if due:  # into memory: two slots, the older one committed by the end of its copy
            self._block("coordination", self.coordination)
            self.copy_end = self.clock + self.size_gb / self.platform.d2h_gbps  # (the last one
            # was copied before this update)
        if last:  # not saved to storage at this iteration: the end of training does
            self._block("back_pressure", self.flush_end - self.clock)  # after the one in flight
            self._checkpoint()

    def _checkpoint(self) -> None:
        p, size, ranks = self.platform, self.size_gb, self.case.ranks
        self.storage_saves += 1
        self._block("coordination", self.coordination)
        if self.variant is Variant.TORCH_SAVE:
            self._block("staging", size / p.staging_gbps)
            self._block("write", size / _write_gbps(p, 1, ranks))
        elif self.variant is Variant.TORCH_DIST:
            self._block("staging", size / p.staging_gbps)
            self._block("write", size / _write_gbps(p, p.dist_streams, ranks))
        elif self.variant is Variant.TORCH_DIST_ASYNC:
            self._block("back_pressure", self.flush_end - self.clock)  # one save in flight
            self._block("staging", size / p.staging_gbps)
            self.flush_end = self.clock + size / _write_gbps(p, p.dist_streams, ranks)
        elif self.variant in (Variant.DATASTATES_LAZY, Variant.DATASTATES_MEMORY):
            self._lazy_checkpoint()  # (datastates_memory: its saves to storage)
        else:
            raise ValueError(f"no model for variant {self.variant!r}")

    def _lazy_checkpoint(self) -> None:
        p, size = self.platform, self.size_gb
        write = _write_gbps(p, 1, self.case.ranks)
        cache_gb = p.host_cache_gb_per_node / min(p.gpus_per_node, self.case.ranks)
        fits = int(cache_gb // size)
        if fits >= 1:
            # The copy needs a free slot: the snapshot `fits` places back must be flushed.
            wait_for = self.flush_ends[-fits] if len(self.flush_ends) >= fits else 0.0
            copy_rate = p.d2h_gbps
        else:
            # Smaller cache than a snapshot: it streams through, at the slower of copy and flush.
            wait_for = self.flush_end
            copy_rate = min(p.d2h_gbps, write)
        # The copy starts when a slot is free; training only notices if that pushes the copy's
        # end past the next update (charged there as d2h_wait), the point of being lazy.
        copy_start = max(self.clock, wait_for)
        self.copy_end = copy_start + size / copy_rate
        # Flushing streams chunks as they land in the cache, one snapshot after another.
        flush_start = max(copy_start, self.flush_end)
        self.flush_end = max(flush_start + size / write, self.copy_end)
        self.flush_ends.append(self.flush_end)
