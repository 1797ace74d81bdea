"""The training loop: set-up, train_step, evaluation, exit conditions, checkpoint hooks."""
from __future__ import annotations

import gc
import os
import signal
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.training.checkpointing.loading import timed_load_checkpoint
from megatron.training.checkpointing.contents import TrainState
from megatron.training.checkpointing.formats import format_name, make_checkpoint_manager, \
    save_converted
from megatron.training.checkpointing.manager import CheckpointManager
from megatron.training.config import RunConfig, SchedulerOnResume, TrainingConfig
from megatron.training.mcore_fixes import apply_torch_adam_patches, optimizer_config_overrides, \
    results_queue_dies_with_rank
from megatron.training.data import Datasets, MicroBatchIterator, build_datasets, get_batch
from megatron.training.flops import num_floating_point_operations, shape_of, \
    throughput_tflops_per_gpu
from megatron.training.initialize import backend_name, control_timeout, \
    initialize_distributed, set_random_seeds
from megatron.training.checkpointing.lazy import check_memory_level, size_host_cache, \
    size_peer_replica
from megatron.training.log import print_rank_0, print_rank_last, training_log_line, validation_lines
from megatron.training.metrics import Metrics
from megatron.training.model import (
    build_model_chunks,
    count_parameters,
    initialize_weights_layout_independent,
    params_dtype,
    params_gathered,
    transformer_config,
    wrap_model,
)


@dataclass
class Trainer:
    config: RunConfig
    state: TrainState
    datasets: Datasets
    checkpoints: CheckpointManager
    model_config: object
    device: torch.device
    metrics: Metrics
    """TensorBoard/wandb scalars of this rank (see `metrics` for who writes what)."""
    checkpoint_wait_s: float = 0.0
    """Time train_step spent in `before_optimizer_step` (a lazy snapshot not yet copied)."""
    started_at: float = 0.0
    """When this rank's job started (`time.time()`), for --exit-duration-in-mins."""


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def megatron_optimizer_config(config: RunConfig):
    """megatron-core's OptimizerConfig for this run (Adam, precision, loss scaling, sharding)."""
    from megatron.core.optimizer import OptimizerConfig

    o, m = config.optimizer, config.model
    return OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
        clip_grad=o.clip_grad, bf16=m.bf16, fp16=m.fp16, params_dtype=params_dtype(m),
        # megatron-core picks the grad scaler from these as Megatron-LM does: constant with
        # loss_scale, dynamic with fp16 otherwise, none for bf16 and fp32.
        loss_scale=o.loss_scale, initial_loss_scale=o.initial_loss_scale,
        min_loss_scale=o.min_loss_scale, loss_scale_window=o.loss_scale_window,
        hysteresis=o.hysteresis,
        use_distributed_optimizer=config.parallel.use_distributed_optimizer,
        # Megatron-LM's --decoupled-lr: the word embeddings' and the output layer's parameter
        # group has its own peak and final learning rate (megatron-core's standard overrides).
        decoupled_lr=o.decoupled_lr, decoupled_min_lr=o.decoupled_min_lr)


def schedule_steps(config: RunConfig) -> tuple:
    """(warm-up, decay, weight-decay increment) lengths of the learning-rate schedule in samples,
    as Megatron-LM counts them: from the iteration flags times the global batch, or the sample
    flags of sample-based training; --lr-warmup-fraction is a fraction of the decay length."""
    o, t = config.optimizer, config.training
    gbs = t.global_batch_size
    if t.train_samples is not None:
        decay_steps = max(1, o.lr_decay_samples or t.train_samples)
        warmup_steps, wd_steps = o.lr_warmup_samples, max(1, t.train_samples)
    else:
        decay_steps = max(1, (o.lr_decay_iters or t.train_iters) * gbs)
        warmup_steps, wd_steps = o.lr_warmup_iters * gbs, max(1, t.train_iters * gbs)
    if o.lr_warmup_fraction is not None:
        warmup_steps = o.lr_warmup_fraction * decay_steps
    return warmup_steps, decay_steps, wd_steps


def _build_optimizer(config: RunConfig, model):
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o = config.optimizer
    opt_config = megatron_optimizer_config(config)
    optimizer = get_megatron_optimizer(opt_config, model,
                                       config_overrides=optimizer_config_overrides(opt_config))
    warmup_steps, decay_steps, wd_steps = schedule_steps(config)
    # Megatron counts scheduler steps in samples: one optimizer step advances it by gbs.
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style=o.lr_decay_style.value, start_wd=o.weight_decay, end_wd=o.weight_decay,
        wd_incr_steps=wd_steps, wd_incr_style="constant",
        # Megatron-LM's defaults: neither, so a checkpoint with another schedule is refused
        # (checked with a clear message in checkpointing/contents.py before megatron's assert).
        use_checkpoint_opt_param_scheduler=o.scheduler_on_resume is SchedulerOnResume.CHECKPOINT,
        override_opt_param_scheduler=o.scheduler_on_resume is SchedulerOnResume.OVERRIDE)
    return optimizer, scheduler


def setup(config: RunConfig, started_at: Optional[float] = None) -> Trainer:
    """Every rank: init process groups, seeds, model, optimizer, data; load --load if given.
    `started_at`: when the process started (`time.time()`; default now), from which
    --exit-duration-in-mins counts."""
    started_at = time.time() if started_at is None else started_at
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core import parallel_state as ps

    initialize_distributed(config.parallel, control_timeout_s=control_timeout(
        config.checkpoint.ckpt_drain_timeout))
    apply_torch_adam_patches()
    if format_name(config) == "torch_dist" and (config.checkpoint.save or
                                                config.checkpoint.non_persistent_save_interval):
        results_queue_dies_with_rank()  # forked now, while the process is small
    t = config.training
    init_num_microbatches_calculator(
        dist.get_rank(), None if t.rampup_batch_size is None else list(t.rampup_batch_size),
        t.global_batch_size, t.micro_batch_size, config.parallel.data_parallel_size,
        t.decrease_batch_size_if_needed)
    if batch_size() != t.global_batch_size and t.rampup_batch_size is None:
        print_rank_0(f"decreasing the global batch size from {t.global_batch_size} to "
                     f"{batch_size()} to keep it divisible by --micro-batch-size "
                     f"{t.micro_batch_size} * data-parallel size "
                     f"{config.parallel.data_parallel_size} (--decrease-batch-size-if-needed): "
                     f"{t.global_batch_size - batch_size()} sample(s) per iteration are skipped")
    set_random_seeds(t.seed)
    model_config = transformer_config(config.model, config.parallel, backend_name())
    chunks = build_model_chunks(config.model, config.parallel, model_config)
    initialize_weights_layout_independent(chunks, config.model, t.seed)
    model = wrap_model(chunks, config.model, config.parallel, model_config)
    optimizer, scheduler = _build_optimizer(config, model)
    # Hooks the megatron-core schedules call: loss scaling, grad sync control, grad finalisation
    # (DP all-reduce, tied-embedding and sequence-parallel norm all-reduces).
    model_config.grad_scale_func = optimizer.scale_loss
    one = lambda funcs: funcs[0] if len(funcs) == 1 else funcs  # noqa: E731 (per model chunk)
    model_config.no_sync_func = one([m.no_sync for m in model])
    if config.parallel.overlap_grad_reduce:  # with a pipeline the schedule starts each chunk's
        model_config.grad_sync_func = one([m.start_grad_sync for m in model])
    if config.parallel.overlap_param_gather:  # ... and dispatches its first all-gather
        model_config.param_sync_func = one([m.start_param_sync for m in model])
    model_config.finalize_model_grads_func = finalize_model_grads
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler)
    metrics = Metrics.open(config, dist.get_rank(), dist.get_world_size())
    timed_load_checkpoint(state, config, metrics)
    params = count_parameters(model)
    print_rank_0(f"> GPT model: {params} parameters on rank 0 (TP {ps.get_tensor_model_parallel_world_size()}"
                 f", PP {ps.get_pipeline_model_parallel_world_size()}, DP "
                 f"{ps.get_data_parallel_world_size()}), backend {backend_name()}")
    datasets = build_datasets(config.data, config.model, t)
    config = size_host_cache(config, model)  # --async-lazy-save without --lazy-save-cache-mb
    config = size_peer_replica(config, model)  # --lazy-save-peer-replica
    check_memory_level(config, model)  # --non-persistent-ckpt-type in_memory
    return Trainer(config=config, state=state, datasets=datasets,
                   checkpoints=make_checkpoint_manager(config, metrics),
                   model_config=model_config, device=_device(), metrics=metrics,
                   started_at=started_at)


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of token losses, token count, and [sum, count] for reporting (Megatron's 3-tuple:
    the schedule divides by the count, so the loss is a per-token mean over the global batch)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def _forward_step(device, data_iterator, model):
    batch = get_batch(data_iterator, device)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def _data_iterators(trainer: Trainer, dataset, consumed: int):
    from megatron.core import parallel_state as ps

    make = lambda: MicroBatchIterator(  # noqa: E731
        dataset, consumed, trainer.config.training.micro_batch_size,
        ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    n = len(trainer.state.model)
    return make() if n == 1 else [make() for _ in range(n)]


def _reduce_loss(losses: List[dict]) -> Optional[float]:
    """Per-token mean over the global batch; None on ranks that hold no loss (not last stage)."""
    from megatron.core import parallel_state as ps

    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    total = torch.zeros(2)
    for item in losses:
        total += item["lm loss"].float().cpu()
    total = total.to(_device())
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    return (total[0] / total[1].clamp(min=1)).item()


def _run_schedule(trainer: Trainer, iterators, forward_only: bool, num_microbatches: int):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    t = trainer.config.training
    return get_forward_backward_func()(
        forward_step_func=partial(_forward_step, trainer.device), data_iterator=iterators,
        model=trainer.state.model, num_microbatches=num_microbatches,
        seq_length=trainer.config.model.seq_length, micro_batch_size=t.micro_batch_size,
        decoder_seq_length=trainer.config.model.seq_length, forward_only=forward_only)


def batch_size() -> int:
    """This iteration's global batch: megatron-core's calculator (--global-batch-size, or where
    the --rampup-batch-size ramp is at the samples consumed before the iteration), less what
    --decrease-batch-size-if-needed leaves out (the running batch: the samples it trains on)."""
    from megatron.core.num_microbatches_calculator import get_current_running_global_batch_size

    return get_current_running_global_batch_size()


def skipped_in_batch() -> int:
    """Samples of this iteration's global batch that --decrease-batch-size-if-needed leaves out
    (Megatron-LM counts them in skipped_train_samples)."""
    from megatron.core.num_microbatches_calculator import get_current_global_batch_size

    return get_current_global_batch_size() - batch_size()


def _batch_grows(consumed_samples: int) -> Optional[Tuple[int, int]]:
    """Every rank: megatron-core's calculator moved on to `consumed_samples` (the batch of the
    iteration that starts there); (old, new) global batch where that changed it, else None."""
    from megatron.core.num_microbatches_calculator import update_num_microbatches

    before = batch_size()
    update_num_microbatches(consumed_samples, consistency_check=True)
    return None if batch_size() == before else (before, batch_size())


def _skip_iteration(trainer: Trainer, iterators) -> None:
    """Megatron-LM's --iterations-to-skip: the next iteration's batch is read past (each model
    chunk's iterator), counted as consumed and skipped samples; no forward/backward, optimizer or
    scheduler step, FLOPs, log line, validation or save for it."""
    state = trainer.state
    samples = batch_size()
    for it in iterators if isinstance(iterators, list) else [iterators]:
        it.skip(samples)
    state.iteration += 1
    state.consumed_train_samples += samples
    state.skipped_train_samples += samples
    print_rank_0(f"skipping iteration {state.iteration} (--iterations-to-skip "
                 f"{state.iteration - 1}): its {samples} samples are counted as consumed and "
                 "skipped, the model and the schedule are left as they were")
    _batch_grows(state.consumed_train_samples)


def train_step(trainer: Trainer, iterators):
    """forward/backward of this iteration's global batch (`batch_size`: megatron-core's
    calculator, which --rampup-batch-size grows), then the checkpoint hook, then the optimizer
    step."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    state = trainer.state
    for chunk in state.model:
        chunk.train()
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    losses = _run_schedule(trainer, iterators, forward_only=False,
                           num_microbatches=get_num_microbatches())
    level = trainer.config.training.empty_unused_memory_level
    _empty_cache(level >= 1)
    t0 = time.perf_counter()
    trainer.checkpoints.before_optimizer_step()
    trainer.checkpoint_wait_s += time.perf_counter() - t0
    ok, grad_norm, _ = state.optimizer.step()
    if ok:
        state.scheduler.step(increment=batch_size())
    _empty_cache(level >= 2)
    return _reduce_loss(losses), grad_norm, ok


def _empty_cache(when: bool) -> None:
    """--empty-unused-memory-level: the CUDA caching allocator's unused blocks given back (memory
    a lazy snapshot's copies still read is in use, so it stays)."""
    if when and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@torch.no_grad()
def evaluate(trainer: Trainer, prefix: str = "validation", final: bool = False,
             time_up: Optional[Callable[[], bool]] = None) -> Optional[float]:
    """The validation loss (last rank), or None. `time_up` (every rank, agreed), asked after each
    batch: --exit-duration-in-mins reached, so validation stops there and reports nothing, as
    Megatron-LM's does, and the loop exits after this iteration's save."""
    state, t = trainer.state, trainer.config.training
    if trainer.datasets.valid is None or t.eval_iters == 0:
        return None
    # Announced, as it may take a while (Megatron-LM's default is 100 iterations).
    print_rank_0(f"{'final ' if final else ''}validation: running {t.eval_iters} iterations "
                 f"({t.eval_iters * t.global_batch_size} samples; --eval-iters {t.eval_iters})")
    t_start = time.time()
    for chunk in state.model:
        chunk.eval()
    iterators = _data_iterators(trainer, trainer.datasets.valid, state.consumed_valid_samples)
    losses = []
    with params_gathered(state.model, trainer.config.parallel):
        for done in range(1, t.eval_iters + 1):
            losses += _run_schedule(trainer, iterators, forward_only=True, num_microbatches=(
                t.num_microbatches(trainer.config.parallel.data_parallel_size)))
            _empty_cache(t.empty_unused_memory_level >= 1)
            state.consumed_valid_samples += t.global_batch_size
            if time_up is not None and done < t.eval_iters and time_up():
                print_rank_0(f"validation stopped after {done} of {t.eval_iters} iterations: "
                             f"--exit-duration-in-mins {t.exit_duration_in_mins:g} is reached")
                return None
    loss = _reduce_loss(losses)
    trainer.checkpoints.validation_done(state.iteration, t_start, time.time())
    if loss is not None:
        print_rank_last(validation_lines(state.iteration, loss, prefix))
        trainer.metrics.validation(state.iteration, state.consumed_train_samples, loss)
    return loss


class _Profiler:
    """--profile (Megatron-LM's): iterations profile_step_start..profile_step_end of the ranks in
    --profile-ranks (all by default) are profiled, the same points as Megatron-LM's loop. With
    --use-pytorch-profiler, torch's profiler on its schedule, one chrome trace per rank in
    <tensorboard-dir>/../torch_profile/rank-R.json.gz (a lazy save's copies and writes show on
    their threads). Otherwise cudaProfilerStart/Stop around them, for nsys with
    --capture-range=cudaProfilerApi; without CUDA there is nothing for nsys to capture (said
    once)."""

    def __init__(self, config: RunConfig):
        log = config.logging
        rank = dist.get_rank()
        self.log, self.on = log, log.profile and (not log.profile_ranks
                                                  or rank in log.profile_ranks)
        self.torch_prof = None
        if self.on and log.use_pytorch_profiler:
            where = os.path.normpath(os.path.join(log.tensorboard_dir, "..", "torch_profile"))

            def write(prof) -> None:
                os.makedirs(where, exist_ok=True)
                prof.export_chrome_trace(os.path.join(where, f"rank-{rank}.json.gz"))

            start, end = log.profile_step_start, log.profile_step_end
            self.torch_prof = torch.profiler.profile(
                schedule=torch.profiler.schedule(wait=max(start - 1, 0),
                                                 warmup=1 if start > 0 else 0,
                                                 active=end - start, repeat=1),
                on_trace_ready=write, record_shapes=log.pytorch_profiler_collect_shapes,
                with_stack=log.pytorch_profiler_collect_callstack)
            self.torch_prof.start()
        elif self.on and not torch.cuda.is_available():
            self.on = False
            print_rank_0("--profile: no CUDA device, so nothing for nsys to capture "
                         "(--use-pytorch-profiler profiles on CPU too)")
        self.running = self.torch_prof is not None

    def before_iteration(self, iteration: int) -> None:
        """Top of the loop, `iteration` iterations done."""
        if not self.on:
            return
        if self.torch_prof is not None:
            self.torch_prof.step()
        elif iteration == self.log.profile_step_start:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
            self.running = True

    def after_iteration(self, iteration: int) -> None:
        if self.on and iteration == self.log.profile_step_end:
            self.stop()

    def stop(self) -> None:
        if not self.running:
            return
        self.running = False
        if self.torch_prof is not None:
            self.torch_prof.stop()
        else:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())


class _ManualGC:
    """--manual-gc (Megatron-LM's): Python's automatic garbage collection is off while training,
    and collections run at the same points on every rank instead: every `manual_gc_interval`
    iterations, and around validation. A full collection of the trainer's objects took ~140 ms on
    our CPU machines; left to its thresholds it runs at a different iteration on each rank, and
    the others wait for that rank in the next collective."""

    def __init__(self, t: TrainingConfig):
        self.on, self.interval, self.around_validation = (t.manual_gc, t.manual_gc_interval,
                                                          t.manual_gc_eval)

    def start(self) -> None:
        if self.on:
            gc.disable()
            gc.collect()

    def stop(self) -> None:
        if self.on:
            gc.enable()

    def after_iteration(self, iteration: int) -> None:
        if self.on and self.interval and iteration % self.interval == 0:
            gc.collect()

    def validate(self, trainer: "Trainer", **kwargs) -> Optional[float]:
        """`evaluate(trainer, **kwargs)`: everything collected before it, what it made after."""
        if self.on and self.around_validation:
            gc.collect()
        try:
            return evaluate(trainer, **kwargs)
        finally:
            if self.on and self.around_validation:
                gc.collect(generation=0)


class _StopConditions:
    """The conditions that end training early, agreed on by every rank at the end of each
    iteration (one all-reduce, only where one is set) so they stop at the same one: SIGTERM (or
    --exit-signal) with --exit-signal-handler, and --exit-duration-in-mins counted from the earliest rank's start
    (`Trainer.started_at`), as Megatron-LM counts it."""

    def __init__(self, trainer: Trainer):
        t = trainer.config.training
        self.on_sigterm, self.received = t.exit_signal_handler, False
        self.signal_name = t.exit_signal
        self.limit_min = t.exit_duration_in_mins
        self.started_at = trainer.started_at
        if self.limit_min:
            first = torch.tensor([self.started_at], dtype=torch.float64, device=_device())
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
            self.started_at = float(first.item())
        if self.on_sigterm:
            signal.signal(signal.Signals[t.exit_signal], self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def minutes(self) -> float:
        return (time.time() - self.started_at) / 60.0

    def agreed(self) -> Tuple[bool, bool]:
        """(the exit signal received on some rank, time up on some rank)."""
        if not (self.on_sigterm or self.limit_min):
            return False, False
        flags = torch.tensor([int(self.received), int(self.time_up_here())], dtype=torch.int32,
                             device=_device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0].item()), bool(flags[1].item())

    def time_up_here(self) -> bool:
        return bool(self.limit_min) and self.minutes() > self.limit_min

    def time_up(self) -> bool:
        """Every rank, with --exit-duration-in-mins (else False, no collective): whether some
        rank is past it."""
        return bool(self.limit_min) and self.agreed()[1]


class _Summary:
    """What the end-of-training line reports: iterations, wall time, tokens/s, checkpoints
    started and how many of them became complete (a full disk: 1 started, 0 complete), and the
    time the loop spent blocked in checkpoint calls (save calls, the lazy snapshot wait, commit
    polls, the final drain)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.start_iteration = trainer.state.iteration
        self.start_samples = trainer.state.consumed_train_samples
        self.t0 = time.time()
        self.wait_at_start_s = trainer.checkpoint_wait_s
        self.blocked_s = 0.0  # in the loop's own checkpoint calls (train_step's waits apart)
        self.saves_at_start = trainer.checkpoints.saves_started
        self.committed_at_start = trainer.checkpoints.saves_committed

    def blocked(self, fn, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.blocked_s += time.perf_counter() - t0

    def saving(self, maybe_save, state, force: bool = False) -> bool:
        return self.blocked(maybe_save, state, force=force)

    def report(self) -> None:
        from datastates.megatron_adapter import paths

        config, state = self.trainer.config, self.trainer.state
        wall = time.time() - self.t0
        tokens = (state.consumed_train_samples - self.start_samples) * config.model.seq_length
        root = config.checkpoint.save
        newest = paths.tracked_iteration(root) if root else None
        newest_dir = "none" if newest is None else paths.checkpoint_dir(root, newest)
        blocked = self.blocked_s + self.trainer.checkpoint_wait_s - self.wait_at_start_s
        ckpts = self.trainer.checkpoints
        started = ckpts.saves_started - self.saves_at_start
        complete = ckpts.saves_committed - self.committed_at_start
        deferred, refused = ckpts.saves_deferred, ckpts.saves_refused
        replicas = ckpts.replica_counts()
        print_rank_0(f" training summary | iterations: {self.start_iteration} -> "
                     f"{state.iteration} | time (s): {wall:.1f} | tokens/s: "
                     f"{tokens / wall if wall > 0 else 0.0:.1f} | checkpoints: {started} "
                     f"(complete: {complete}" + (f"; persistent deferred: {deferred}"
                                                 if deferred else "")
                     + (f"; refused, replicas disagreed: {refused}" if refused else "")
                     + ("" if replicas is None else f"; in-memory versions sent to the next "
                        f"node: {replicas[0]}, skipped there: {replicas[1]}") + ") | "
                     f"blocked by checkpointing (s): {blocked:.3f} | newest complete "
                     f"checkpoint: {newest_dir}")


def _scalars(trainer: Trainer, loss: Optional[float], grad_norm) -> None:
    """The iteration's TensorBoard/wandb scalars (on the ranks and iterations that write them)."""
    state, metrics = trainer.state, trainer.metrics
    if metrics.writes_iteration(state.iteration):
        metrics.iteration(state.iteration, state.consumed_train_samples,
                          state.optimizer.param_groups[0]["lr"],
                          batch_size(), loss,
                          float(state.optimizer.get_loss_scale()), grad_norm,
                          skipped_samples=state.skipped_train_samples)


class LogWindow:
    """The iterations since the last log line, as Megatron-LM's training_log counts them: the
    `lm loss` printed is the mean over the iterations whose optimizer step was taken, and is
    left out of the line when every one was skipped (fp16 overflow)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.loss_sum, self.advanced, self.skipped = 0.0, 0, 0

    def add(self, loss: Optional[float], stepped: bool) -> None:
        if not stepped:
            self.skipped += 1
        elif loss is not None:
            self.loss_sum += loss
            self.advanced += 1

    def take(self) -> Tuple[Optional[float], int]:
        """(mean loss of the stepped iterations or None, skipped iterations); starts anew."""
        mean = self.loss_sum / self.advanced if self.advanced else None
        skipped = self.skipped
        self._reset()
        return mean, skipped


def _log_line(trainer: Trainer, elapsed_ms: float, loss: Optional[float], grad_norm,
              skipped: int) -> None:
    """Megatron's iteration line (last rank), with --log-throughput its TFLOP/s per rank."""
    state, t, config = trainer.state, trainer.config.training, trainer.config
    throughput = None
    if config.logging.log_throughput:
        flops = num_floating_point_operations(shape_of(config.model), batch_size())
        throughput = throughput_tflops_per_gpu(flops, elapsed_ms / 1000.0,
                                               config.parallel.world_size)
    print_rank_last(training_log_line(
        state.iteration, t.train_iters, state.consumed_train_samples, elapsed_ms,
        state.optimizer.param_groups[0]["lr"], batch_size(), loss, grad_norm, skipped, 0,
        loss_scale=float(state.optimizer.get_loss_scale()), throughput=throughput,
        decoupled_lr=next((g["lr"] for g in state.optimizer.param_groups
                           if g.get("is_decoupled_lr")), None),
        skipped_samples=state.skipped_train_samples))
    trainer.metrics.timing(state.iteration, elapsed_ms / 1000.0, throughput)


def train(trainer: Trainer) -> int:
    """Run to train_iters (or the exit interval, the time limit, SIGTERM); returns the last
    iteration. With --ckpt-convert-format, the loaded checkpoint is saved in that format
    instead. The scalar writers are closed (flushed) at the end, after the final checkpoint's
    record."""
    failed = True
    try:
        if trainer.config.checkpoint.ckpt_convert_format is not None:  # Megatron-LM's: no training
            save_converted(trainer.state, trainer.config, trainer.metrics)
            trainer.checkpoints.finalize()  # the run's own manager (e.g. lazy writers): unused
            iteration = trainer.state.iteration
        else:
            iteration = _train_loop(trainer)
        failed = False
        return iteration
    finally:
        trainer.metrics.close(failed=failed)


def _train_loop(trainer: Trainer) -> int:
    state, t = trainer.state, trainer.config.training
    stop = _StopConditions(trainer)
    iterators = _data_iterators(trainer, trainer.datasets.train, state.consumed_train_samples)
    log_interval = trainer.config.logging.log_interval
    shape = shape_of(trainer.config.model)
    _batch_grows(state.consumed_train_samples)  # the first iteration's (--rampup-batch-size)
    window_start, window = time.time(), LogWindow()
    saved_last = True  # nothing new to save unless an iteration runs
    print_rank_0(f"training from iteration {state.iteration} to {t.train_iters}")
    summary = _Summary(trainer)
    trainer.checkpoints.begin_training(state.iteration, loaded=state.loaded)
    trainer.checkpoints.progress.start_job(state.floating_point_operations_so_far)
    manual_gc = _ManualGC(t)
    manual_gc.start()
    profiler = _Profiler(trainer.config)
    try:
        while state.iteration < t.train_iters:
            if state.iteration in t.iterations_to_skip:
                _skip_iteration(trainer, iterators)
                saved_last = False  # the data position moved: the end saves it
                continue
            profiler.before_iteration(state.iteration)
            loss, grad_norm, ok = train_step(trainer, iterators)
            state.iteration += 1
            state.consumed_train_samples += batch_size()
            state.skipped_train_samples += skipped_in_batch()
            # Megatron-LM's count (saved as num_floating_point_operations_so_far, resumed).
            state.floating_point_operations_so_far += num_floating_point_operations(
                shape, batch_size())
            window.add(loss, ok)
            _scalars(trainer, loss, grad_norm)
            if state.iteration % log_interval == 0:
                elapsed = (time.time() - window_start) * 1000.0 / log_interval
                mean_loss, skipped = window.take()
                if loss is not None:
                    _log_line(trainer, elapsed, mean_loss, grad_norm, skipped)
                window_start = time.time()
            if t.eval_interval and state.iteration % t.eval_interval == 0:
                manual_gc.validate(trainer, time_up=stop.time_up)
            # After eval (as Megatron): the checkpoint then holds the consumed validation
            # samples too, so a resumed run validates on the same batches.
            saved_last = summary.saving(trainer.checkpoints.maybe_save, state)
            grows = _batch_grows(state.consumed_train_samples)  # the next iteration's batch
            if grows and trainer.config.checkpoint.save and state.iteration < t.train_iters:
                print_rank_0(f"saving a checkpoint at iteration {state.iteration}: the global "
                             f"batch size grows from {grows[0]} to {grows[1]} "
                             "(--rampup-batch-size, as Megatron-LM saves)")
                saved_last = summary.saving(trainer.checkpoints.maybe_save, state,
                                            force=True) or saved_last
            summary.blocked(trainer.checkpoints.after_iteration, state.iteration)
            manual_gc.after_iteration(state.iteration)  # the save's garbage too
            profiler.after_iteration(state.iteration)
            sigterm, time_up = stop.agreed()
            if sigterm:
                print_rank_0(f"exiting on {stop.signal_name} at iteration {state.iteration}")
                if not saved_last:
                    summary.saving(trainer.checkpoints.maybe_save, state, force=True)
                return state.iteration
            if time_up:
                # The job's time is up: the next one may start on other nodes, so a version
                # only in node-local memory is persisted too, as at the end of training.
                print_rank_0(f"exiting program after {stop.minutes():.2f} minutes at iteration "
                             f"{state.iteration} (--exit-duration-in-mins "
                             f"{t.exit_duration_in_mins:g})")
                if not (saved_last and trainer.checkpoints.last_save_persistent):
                    summary.saving(trainer.checkpoints.maybe_save, state, force=True)
                return state.iteration
            if t.exit_interval and state.iteration % t.exit_interval == 0:
                print_rank_0(f"exiting at iteration {state.iteration} (--exit-interval)")
                if not saved_last:
                    summary.saving(trainer.checkpoints.maybe_save, state, force=True)
                return state.iteration
        if state.iteration > summary.start_iteration and not (
                saved_last and trainer.checkpoints.last_save_persistent):
            # Megatron saves at the end too, also after a non-persistent save of this iteration
            # (the exit interval and SIGTERM above take any save of it, as Megatron-LM does).
            # Not when no iteration ran: the state is the loaded checkpoint's.
            summary.saving(trainer.checkpoints.maybe_save, state, force=True)
        if t.eval_iters and t.eval_interval and state.iteration % t.eval_interval and \
                state.iteration > summary.start_iteration:
            manual_gc.validate(trainer, final=True)  # as Megatron-LM: the end is validated too
        return state.iteration
    finally:
        manual_gc.stop()
        profiler.stop()  # a run that ended before --profile-step-end: what was recorded
        try:
            summary.blocked(trainer.checkpoints.finalize)
        finally:  # also when the final drain raises (a save that failed or was refused late)
            summary.report()
