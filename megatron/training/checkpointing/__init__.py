"""The trainer's checkpointing: what a checkpoint holds, when one is saved and kept, how each
format is written, and how a run resumes from any of them.

  contents.py         what is saved: `build_sharded_state_dict`, `common_state`,
                      `apply_loaded_state_dict`, the saved run config, RNG state, `TrainState`
  errors.py           the trainer's `CheckpointError`
  manager.py          when: `CheckpointManager` (interval, start-up probe, skipping a complete
                      iteration, tracker + retention after a commit)
  save_interval.py    `--save-interval auto`: the interval from measured save costs
  retention.py        which checkpoints are kept (--keep-last-n-checkpoints and friends)
  formats.py          the registry of formats (torch_dist, torch, datastates)
  stock.py            how the stock formats are written (torch_dist sync/--async-save, torch)
  lazy.py             the lazy format (--async-lazy-save) over `LazyCheckpointer`
  distopt_shards.py   the distributed optimizer's state as live per-rank boxes
  loading.py          resume from --load in any format
  verify.py           verification before a load and fallback to an older checkpoint
  from_universal.py   universal -> this run's layout; each rank's share verified
  to_torch_dist.py    universal -> Megatron torch_dist
  upstream_compat.py  NVIDIA Megatron-LM's checkpoints: its `args` to and from our config
"""
