"""The Megatron side of DataStates: the only part of `datastates` that knows Megatron.

The trainer (`megatron.training`) and the tools import this package's names and `datastates`'
public API, nothing else. What lives here:

  checkpointer.py      `LazyCheckpointer`: save / before_optimizer_step / poll / finish: the engine,
                       the save strategy, agreement across ranks, spare files, the commit marker,
                       the tracker move, fault points, telemetry, the background merge
  strategies.py        megatron-core dist_checkpointing strategies: our save/load strategy (backend
                       "datastates", registered when megatron-core is imported), torch_dist and
                       common.pt loads that never run code, common.pt written durably
  save_plan.py         cached save plans: megatron's validation and shard distribution reused
                       while a structural fingerprint is unchanged (--ckpt-assume-constant-structure)
  payload.py           what the engine is handed per save (this rank's main replicas), refilled
                       from the previous save's flattened form while every tensor matches it
  local_tier.py        --lazy-save-local-dir: placeholders, usability probe, pruning of old copies
  node_local.py        node-local versions (Megatron-LM's `local` non-persistent checkpoints):
                       nodes and their leaders, every replica written per node, which version
                       every node holds
  paths.py             Megatron checkpoint paths: iter_XXXXXXX naming, tracker, format detection,
                       run_config.json, complete iterations (no megatron import)
  merge_sources.py, merge_plan.py, merge.py, background_merge.py
                       Megatron checkpoints -> universal checkpoints (`datastates.universal`),
                       by hand or in a low-priority background process
  inspect.py           what a checkpoint holds
  hf_export.py, hf_import.py, hf_common.py, hf_llama.py, hf_gpt2.py
                       universal <-> Hugging Face GPT-2 or Llama (safetensors + config.json):
                       the exporter, the importer, and the one mapping both read
  resolve.py           what a path given to a converter names (what --load takes), and what is
                       missing when it names nothing usable

Names are resolved lazily (PEP 562), so `paths`, the merge process and the tools do not pay for
importing megatron-core unless they use a strategy.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    # checkpointer
    "COMMIT_RESERVE_BYTES": "checkpointer", "FailurePolicy": "checkpointer",
    "LazyCheckpointer": "checkpointer", "LazySaveConfig": "checkpointer",
    "TELEMETRY_FILENAME": "checkpointer", "append_telemetry": "checkpointer",
    "prepare_and_probe_root": "checkpointer",
    # strategies
    "BACKEND": "strategies", "DataStatesLoadStrategy": "strategies",
    "DataStatesSaveStrategy": "strategies", "DurableCommonSaveStrategy": "strategies",
    "SafeCommonLoadStrategy": "strategies", "SafeTorchDistLoadStrategy": "strategies",
    "durable_common_save": "strategies", "engine_payload": "payload",
    "load_strategies": "strategies", "read_sharded_tensor": "strategies",
    "save_strategy": "strategies",
    # save_plan
    "SavePlanCache": "save_plan", "StructurePolicy": "save_plan",
    # merge
    "DataStatesSource": "merge_sources", "Source": "merge_sources",
    "TorchDistSource": "merge_sources", "open_source": "merge_sources",
    "OptimizerFlavor": "merge_plan", "advance_tracker": "merge", "run_merge": "merge",
    "UNIVERSAL_TELEMETRY_FILE": "merge",
    "BackgroundMerger": "background_merge", "MergeQueue": "background_merge",
    "MergerConfig": "background_merge", "die_with_parent": "background_merge",
    "merge_with_workers": "merge_parallel",
    "describe": "inspect", "render": "inspect", "export_hf": "hf_export",
    "Located": "resolve", "locate": "resolve", "locate_universal": "resolve",
    "UNIVERSAL_KIND": "resolve",
    "expand_local_dir": "local_tier", "newest_on_every_node": "node_local",
    "PeerReplicator": "peer_replica", "RestoreStats": "peer_replica", "Ring": "peer_replica",
    "restore_before_load": "peer_replica", "needed_saved_ranks": "peer_replica",
}
_RENAMED = {"UNIVERSAL_TELEMETRY_FILE": "TELEMETRY_FILE", "expand_local_dir": "expand"}

__all__ = sorted(_EXPORTS) + ["paths"]


def __getattr__(name: str) -> Any:
    if name == "paths":
        return importlib.import_module(f"{__name__}.paths")
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
    value = getattr(module, _RENAMED.get(name, name))
    globals()[name] = value
    return value
