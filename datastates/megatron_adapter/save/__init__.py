"""The save path: what a Megatron save hands DataStates, and how a version becomes committed.

  checkpointer.py   `LazyCheckpointer`: save / before_optimizer_step / poll / finish: the engine,
                    the save strategy, agreement across ranks, spare files, the commit marker, the
                    tracker move, fault points, telemetry; it drives the levels (`..levels`) and
                    the background merge (`..merge`)
  config.py         `LazySaveConfig` and `FailurePolicy`: what the checkpointer is configured with
  strategies.py     megatron-core dist_checkpointing strategies: our save/load strategy (backend
                    "datastates", registered when megatron-core is imported), torch_dist and
                    common.pt loads that never run code, common.pt written durably
  plan.py           cached save plans: megatron's validation and shard distribution reused while a
                    structural fingerprint is unchanged (--ckpt-assume-constant-structure)
  payload.py        what the engine is handed per save (this rank's main replicas), refilled from
                    the previous save's flattened form while every tensor matches it
  offload.py        the save worker: a steady save's work off the training thread,
                    during the next forward/backward, joined before the optimizer step
"""
