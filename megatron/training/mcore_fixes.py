"""megatron-core 0.16.1 bugs we work around on any machine (not about the CPU; see cpu_compat.py
for that). Each function says which call is wrong, how it shows, and when the fix applies.

- `batch_p2p_comm_for`: the interleaved pipeline schedule with 2 stages and batched p2p on gloo
  trains with silently wrong gradients;
- `apply_torch_adam_patches`: megatron-core's torch.optim.Adam fallback (no apex/TE fused Adam, on
  CPU or GPU) fails to load a `fully_reshardable` distributed-optimizer checkpoint
  (`KeyError: 'step'`) and, after loading one, shares a single `step` tensor between all
  parameters (wrong bias correction: a resumed run silently diverges), and cannot build a fresh
  distributed optimizer's sharded state dict for loading (`assert len(steps) == 1`);
- `optimizer_config_overrides`: with `decoupled_lr` (Megatron-LM's --decoupled-lr), a resume
  gives the default parameter group the embedding group's learning rates (the run silently
  diverges after the load) with the distributed optimizer, and fails to load with the other
  (`loaded state dict contains a parameter group that doesn't match the size`);
- `results_queue_dies_with_rank`: torch_dist's writers report through a multiprocessing
  Manager process that outlives a rank stopped by a signal (e.g. torchrun's SIGTERM after another
  rank failed), holding the job's output open: the job never ends for whoever waits on it.
"""
from __future__ import annotations

from typing import Optional

import torch


def batch_p2p_comm_for(pipeline_parallel_size: int, virtual_pipeline_size: Optional[int],
                       backend: str) -> bool:
    """Whether the pipeline schedule may batch its send/recv pairs (`batch_isend_irecv`).

    Trap found on gloo: the interleaved schedule (VPP) with exactly 2 pipeline stages and batched
    p2p trains with silently wrong gradients (grad norm ~800 instead of ~1, flat loss), because
    each rank posts a send and a receive to the same peer inside one batch. Unbatched p2p is
    correct, so use it there; every other layout keeps megatron-core's default.
    """
    if virtual_pipeline_size is not None and pipeline_parallel_size == 2 and backend == "gloo":
        return False
    return True


def optimizer_config_overrides(config) -> dict:
    """megatron-core's standard parameter-group overrides for `config` (its OptimizerConfig),
    with the --decoupled-lr group marked `is_decoupled_lr`.

    On load, `MegatronOptimizer._filter_and_reorder_param_groups` matches the checkpoint's
    groups to this run's by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr). Its own
    `get_standard_config_overrides` gives the decoupled group only max_lr and min_lr, so that key
    is the default group's too: one of the two is taken for both (found on CPU: after a resume
    the default group stepped with --decoupled-lr's rates; without the distributed optimizer the
    load failed). Marking the group tells them apart, as the older API did."""
    from megatron.core.optimizer import get_standard_config_overrides

    overrides = get_standard_config_overrides(config)
    for override in overrides.values():
        if "max_lr" in override or "min_lr" in override:  # the --decoupled-lr group
            override["is_decoupled_lr"] = True
    return overrides


def apply_torch_adam_patches() -> bool:
    """Needed whenever megatron-core falls back to torch.optim.Adam(W) (no apex/TE FusedAdam,
    so always on CPU). Returns True when applied.

    `DistributedOptimizer._set_main_param_and_optimizer_states` (fully_reshardable load) copies
    every key of the torch optimizer's per-param state from the checkpoint; torch Adam keeps a
    per-param `step` there that the checkpoint stores in `param_groups` instead, so the copy hits
    `KeyError: 'step'`. `step` is restored from `param_groups` by `load_state_dict`; skip it here.
    """
    from megatron.core import optimizer as mcore_optimizer
    from megatron.core.optimizer import distrib_optimizer

    if not getattr(mcore_optimizer, "USING_PYTORCH_OPTIMIZER", False):
        return False
    cls = distrib_optimizer.DistributedOptimizer
    if getattr(cls._set_main_param_and_optimizer_states, "__torch_adam_patch__", False):
        return True
    original = cls._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        main_param.detach().copy_(tensors["param"])
        for key, value in self.optimizer.state[main_param].items():
            if key != "step":
                value.copy_(tensors[key])

    set_states.__torch_adam_patch__ = True
    cls._set_main_param_and_optimizer_states = set_states

    # `DistributedOptimizer.load_state_dict` gives every param's state the *same* `step` tensor;
    # torch Adam's foreach path increments each param's `step` in place, so after one step the
    # shared counter has advanced once per parameter and bias correction is wrong from then on
    # (a resumed run silently diverges from the uninterrupted one). Give each param its own copy.
    original_load = cls.load_state_dict

    def load_state_dict(self, state_dict):
        original_load(self, state_dict)
        for param_state in self.optimizer.state.values():
            step = param_state.get("step")
            if isinstance(step, torch.Tensor):
                param_state["step"] = step.detach().clone()

    cls.load_state_dict = load_state_dict

    # `DistributedOptimizer.state_dict` (called by `sharded_state_dict`, also when loading) asserts
    # one `step` over torch Adam's per-param states, which a fresh optimizer does not have yet:
    # loading a distributed-optimizer checkpoint before the first step fails with a bare
    # `assert len(steps) == 1` (Megatron-LM's own load_checkpoint does exactly that). Create the
    # states first, as the fsdp_dtensor path of the same method does; loading overwrites them.
    original_sharded = cls.sharded_state_dict

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        if is_loading and not self.optimizer.state:
            self._init_optimizer_states_with_dummy_values()
        return original_sharded(self, model_sharded_state_dict, is_loading=is_loading, **kwargs)

    cls.sharded_state_dict = sharded_state_dict
    return True


def _serve_until_the_rank_dies() -> None:
    """In the results-queue Manager process: ignore SIGTERM and SIGINT (a launcher signals the
    whole process tree, and the rank may still save on SIGTERM, --exit-signal-handler) and die
    with the rank instead (PR_SET_PDEATHSIG)."""
    import signal

    from datastates.megatron_adapter import die_with_parent

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()


_MANAGERS: list = []  # the Manager of the results queue, alive as long as this process


def results_queue_dies_with_rank() -> None:
    """Start the Manager process behind megatron-core's torch_dist write-results queue
    (`filesystem_async._get_write_results_queue`) ourselves: one that dies with the rank, and
    that answers at once. Call it before the model is built (`training.setup` does; the first
    torch_dist save calls it too, then it does nothing).

    megatron-core spawns a `multiprocessing.Manager()` at the first save and shuts it down only
    at a normal interpreter exit. Two problems follow:
    - a rank ended by a signal (torchrun sends SIGTERM to the others once one rank failed) leaves
      it running, re-parented to init: it keeps the job's stdout open, so a launcher or a test
      that reads the job's output never sees it end (seen in the fault matrix). Ours ignores
      SIGTERM/SIGINT and gets SIGKILL when the rank dies (PR_SET_PDEATHSIG);
    - a spawned server imports torch to unpickle the first results the writers put (DCP's
      WriteResult): the rank's first save call waited 1.6 s for it, in every run. Ours is
      forked (megatron-core forks its writer processes the same way), so torch is already
      there; forked before the model exists, it shares little memory with the rank."""
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    if getattr(fa, "_results_queue", None) is not None or not hasattr(fa, "_results_queue"):
        return
    manager = SyncManager(ctx=mp.get_context("fork"))
    manager.start(initializer=_serve_until_the_rank_dies)
    _MANAGERS.append(manager)
    fa._results_queue = manager.Queue()
