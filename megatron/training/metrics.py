"""Scalars for TensorBoard (`--tensorboard-dir`) and Weights & Biases (`--wandb-project`).

Tags are Megatron-LM's where it has the scalar (`lm loss`, `learning-rate`, `batch-size`,
`loss-scale`, `grad-norm`, `skipped-train-samples`, `iteration-time` in seconds, `throughput`,
`lm loss validation`, `lm loss validation ppl`, `mem-*`, `<timer>-time`), each also against
consumed samples (`<tag> vs samples`) in TensorBoard as Megatron writes them. Ours:
`checkpoint/*` per committed checkpoint (bytes, stall-ms, copy-ms, durable-s, GB-per-s,
local-durable-s), the running counts `checkpoint/persistent-deferred`,
`checkpoint/replica-skipped` and `checkpoint/replica-mismatches`, and `load-checkpoint/*` per
resume (seconds, bytes, GB-per-s).

Who writes what (every rank holds a `Metrics`; ranks without a role get none of its sinks):
  - the last rank, as in Megatron-LM: it prints the training line and holds the loss under
    pipeline parallelism: training, validation, timers and the load report;
  - rank 0: the committed-checkpoint scalars, which only rank 0 knows (it commits and keeps the
    checkpoint telemetry), opened only when the run saves.
With one rank both are one writer. Otherwise each writes its own event file into
--tensorboard-dir; TensorBoard shows the files of a directory as one run, and their tags differ,
so neither hides the other's points. In wandb the last rank's run is --wandb-exp-name and rank 0's
is `<name>-checkpoints`, both in the group `<name>`.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from megatron.training.config import RunConfig
from megatron.training.log import say

__all__ = ["CheckpointRecord", "Metrics"]


@dataclass(frozen=True)
class CheckpointRecord:
    """One complete checkpoint, as its format measured it (rank 0)."""

    iteration: int
    bytes: int
    """Bytes of the checkpoint (every rank's files)."""
    stall_ms: float
    """Time the training loop was blocked by this save (the save call; for the lazy format also
    the snapshot wait before the next optimizer step), slowest rank."""
    durable_s: float
    """From the save call until every rank's files were durable."""
    copy_ms: Optional[float] = None
    """Lazy format: the background copy of the snapshot into the host cache, slowest rank."""
    copy_start_ms: Optional[float] = None
    """Lazy format: from the save call until the copy could start (for a save built on the save
    worker during the next forward/backward, the worker's part), slowest rank."""
    local_durable_s: Optional[float] = None
    """Lazy format with --lazy-save-local-dir: until durable on the node-local tier."""
    level: str = "persistent"
    """Where it is: "persistent" (--save) or a non-persistent type ("global", "local",
    "in_memory"); its scalars are `checkpoint/...` or `checkpoint-<level>/...`."""

    @property
    def gbps(self) -> float:
        return self.bytes / self.durable_s / 1e9 if self.durable_s > 0 else 0.0

    @classmethod
    def from_telemetry(cls, record: dict, level: str = "persistent") -> "CheckpointRecord":
        """From a `checkpoint` line of datastates_checkpoints.jsonl (the lazy format)."""
        return cls(iteration=int(record["iteration"]), bytes=int(record["bytes"]),
                   stall_ms=float(record["stall_ms"]), durable_s=float(record["durable_s"]),
                   copy_ms=float(record["copy_ms"]), copy_start_ms=record.get("copy_start_ms"),
                   local_durable_s=record.get("local_durable_s"), level=level)

    def scalars(self) -> Dict[str, float]:
        tag = "checkpoint" if self.level == "persistent" else f"checkpoint-{self.level}"
        out = {f"{tag}/iteration": self.iteration, f"{tag}/bytes": self.bytes,
               f"{tag}/stall-ms": self.stall_ms, f"{tag}/durable-s": self.durable_s,
               f"{tag}/GB-per-s": self.gbps}
        if self.copy_ms is not None:
            out[f"{tag}/copy-ms"] = self.copy_ms
        if self.copy_start_ms is not None:
            out[f"{tag}/copy-start-ms"] = self.copy_start_ms
        if self.local_durable_s is not None:
            out[f"{tag}/local-durable-s"] = self.local_durable_s
        return out


class _TensorBoard:
    def __init__(self, directory: str, queue_size: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=directory, max_queue=queue_size)

    def write(self, values: Dict[str, float], step: int, samples: Optional[int]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
            if samples is not None:
                self.writer.add_scalar(f"{tag} vs samples", value, samples)

    def text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, step)

    def close(self, failed: bool) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, config: RunConfig, name: str):
        import wandb

        log = config.logging
        os.makedirs(log.wandb_save_dir, exist_ok=True)
        self.run = wandb.init(project=log.wandb_project, name=name, group=log.wandb_exp_name,
                              dir=log.wandb_save_dir, config=json.loads(config.to_json()))
        # A checkpoint commits after later iterations were logged; wandb drops a step older than
        # its newest, so those points are logged at the newest step and plotted against their own
        # iteration.
        self.run.define_metric("checkpoint/*", step_metric="checkpoint/iteration")
        self.step = 0

    def write(self, values: Dict[str, float], step: int, samples: Optional[int]) -> None:
        self.step = max(self.step, step)
        self.run.log(dict(values), step=self.step)

    def text(self, tag: str, text: str, step: int) -> None:
        pass  # the run config is wandb's `config` already

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class Metrics:
    """The run's scalar writers on this rank (see module doc); every method may be called on every
    rank and writes only where this rank holds the role."""

    def __init__(self, config: RunConfig, training: List, checkpoints: List):
        self.config = config
        self.log = config.logging
        self._training = training
        self._checkpoints = checkpoints

    @classmethod
    def off(cls, config: RunConfig) -> "Metrics":
        return cls(config, [], [])

    @classmethod
    def open(cls, config: RunConfig, rank: int, world_size: int) -> "Metrics":
        """Every rank, once, after the process group exists."""
        log = config.logging
        last, first = rank == world_size - 1, rank == 0
        if not (last or first and config.checkpoint.save):
            return cls.off(config)
        sinks: List = []
        if log.tensorboard_dir is not None:
            sinks.append(_TensorBoard(log.tensorboard_dir, log.tensorboard_queue_size))
        if log.wandb_project is not None:
            sinks.append(_Wandb(config, log.wandb_exp_name if last
                                else f"{log.wandb_exp_name}-checkpoints"))
        if last:
            for sink in sinks:  # Megatron-LM writes its arguments as text too
                sink.text("run_config", "```\n" + config.to_json() + "\n```", 0)
            if log.log_memory_to_tensorboard and not torch.cuda.is_available():
                say("WARNING: --log-memory-to-tensorboard writes CUDA allocator counters; this "
                    "run has no GPU, so none are written")
        return cls(config, sinks if last else [], sinks if first else [])

    # -- the last rank ---------------------------------------------------------------------------
    def writes_iteration(self, iteration: int) -> bool:
        """Whether `iteration` writes the training scalars here (ask before gathering them)."""
        return bool(self._training) and iteration % self.log.tensorboard_log_interval == 0

    def iteration(self, iteration: int, consumed_samples: int, lr: float, batch_size: int,
                  lm_loss: Optional[float], loss_scale: float, grad_norm: Optional[float],
                  skipped_samples: int = 0) -> None:
        """After each iteration; writes every --tensorboard-log-interval iterations."""
        if not self.writes_iteration(iteration):
            return
        values = {"learning-rate": lr, "batch-size": batch_size}
        if skipped_samples > 0:  # --decrease-batch-size-if-needed (Megatron-LM's name)
            values["skipped-train-samples"] = skipped_samples
        if lm_loss is not None:
            values["lm loss"] = lm_loss
        if self.log.log_loss_scale_to_tensorboard:
            values["loss-scale"] = loss_scale
        if grad_norm is not None:
            values["grad-norm"] = grad_norm
        self._write(self._training, values, iteration, consumed_samples)
        if self.log.log_memory_to_tensorboard and torch.cuda.is_available():
            stats = torch.cuda.memory_stats()
            self._write(self._training, {
                "mem-reserved-bytes": stats.get("reserved_bytes.all.current", 0),
                "mem-allocated-bytes": stats.get("allocated_bytes.all.current", 0),
                "mem-max-allocated-bytes": stats.get("allocated_bytes.all.peak", 0),
                "mem-allocated-count": stats.get("allocation.all.current", 0)}, iteration, None)

    def timing(self, iteration: int, seconds_per_iteration: float,
               throughput: Optional[float]) -> None:
        """At each log interval, with --log-timers-to-tensorboard (as Megatron-LM)."""
        if not self._training or not self.log.log_timers_to_tensorboard:
            return
        values = {"iteration-time": seconds_per_iteration}
        if throughput is not None:
            values["throughput"] = throughput
        self._write(self._training, values, iteration, None)

    def validation(self, iteration: int, consumed_samples: int, lm_loss: float) -> None:
        if not self._training:
            return
        values = {"lm loss validation": lm_loss}
        if self.log.log_validation_ppl_to_tensorboard:
            values["lm loss validation ppl"] = math.exp(min(20.0, lm_loss))
        self._write(self._training, values, iteration, consumed_samples)

    def timer(self, name: str, max_seconds: float, iteration: int) -> None:
        """A checkpoint timer (`save-checkpoint`, `load-checkpoint`): slowest rank, seconds."""
        if self._training and self.log.log_timers_to_tensorboard:
            self._write(self._training, {f"{name}-time": max_seconds}, iteration, None)

    def load(self, iteration: int, seconds: float, nbytes: int) -> None:
        if self._training:
            self._write(self._training, {
                "load-checkpoint/seconds": seconds, "load-checkpoint/bytes": nbytes,
                "load-checkpoint/GB-per-s": nbytes / seconds / 1e9 if seconds > 0 else 0.0},
                iteration, None)

    # -- rank 0 ----------------------------------------------------------------------------------
    def checkpoint(self, record: CheckpointRecord) -> None:
        if self._checkpoints:
            self._write(self._checkpoints, record.scalars(), record.iteration, None)

    def checkpoint_interval(self, iteration: int, interval: int, cost_s: Optional[float],
                            level: str = "persistent") -> None:
        """--save-interval auto chose `interval` at `iteration` (from a checkpoint cost) for
        `level` (scalars `checkpoint/...`, or `checkpoint-<level>/...` as `CheckpointRecord`)."""
        if self._checkpoints:
            tag = "checkpoint" if level == "persistent" else f"checkpoint-{level}"
            values = {f"{tag}/interval-iterations": interval}
            if cost_s is not None:
                values[f"{tag}/cost-s"] = cost_s
            self._write(self._checkpoints, values, iteration, None)

    def checkpoint_deferred(self, iteration: int, deferred_total: int) -> None:
        """A persistent save due at `iteration` was not started there (its level still busy:
        latest wins); `deferred_total`: how many so far in this run."""
        if self._checkpoints:
            self._write(self._checkpoints, {"checkpoint/persistent-deferred": deferred_total},
                        iteration, None)

    def checkpoint_replica_skipped(self, iteration: int, skipped_total: int) -> None:
        """The in-memory version of `iteration` was not sent to the peer replicas (a newer one
        committed while the previous transfer ran: latest wins); `skipped_total`: so far."""
        if self._checkpoints:
            self._write(self._checkpoints, {"checkpoint/replica-skipped": skipped_total},
                        iteration, None)

    def checkpoint_refused(self, iteration: int, refused_total: int) -> None:
        """--ckpt-verify-replicas refused the version of `iteration` (its data-parallel replicas
        disagreed); `refused_total`: how many so far in this run."""
        if self._checkpoints:
            self._write(self._checkpoints, {"checkpoint/replica-mismatches": refused_total},
                        iteration, None)

    # -- every rank ------------------------------------------------------------------------------
    def close(self, failed: bool = False) -> None:
        """Flush and close this rank's writers (once, at the end of training)."""
        for sink in {id(s): s for s in self._training + self._checkpoints}.values():
            sink.close(failed)
        self._training, self._checkpoints = [], []

    @staticmethod
    def _write(sinks: List, values: Dict[str, float], step: int, samples: Optional[int]) -> None:
        for sink in sinks:
            sink.write(values, step, samples)
