"""The Megatron side of DataStates: the only part of `datastates` that knows Megatron.

The trainer (`megatron.training`) and the tools import this package's names and `datastates`'
public API, nothing else. One sub-package per concern:

  save/        the save path: `LazyCheckpointer` (engine, agreement across ranks, commit marker,
               tracker), megatron-core dist_checkpointing strategies, cached save plans,
               megatron's save preprocessing in one walk, payload
  levels/      the levels beyond the shared file system, each at its own pace: node-local
               storage (--lazy-save-local-dir), node-local versions, the in-memory level's room
               in shared memory, a peer node's copy (--lazy-save-peer-replica) and the restore
               from it
  merge/       Megatron checkpoints -> universal checkpoints, by hand or in a low-priority
               background process (``python -m datastates.megatron_adapter.merge``)
  hf/          universal <-> Hugging Face GPT-2 or Llama (safetensors + config.json)

and three modules every part uses:

  paths.py     Megatron checkpoint paths: iter_XXXXXXX naming, tracker, format detection,
               run_config.json, complete iterations (no megatron import)
  resolve.py   what a path given to a converter names (what --load takes), and what is missing
               when it names nothing usable
  inspect.py   what a checkpoint holds

Names are resolved lazily (PEP 562), so `paths`, the merge process and the tools do not pay for
importing megatron-core unless they use a strategy.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    # save/
    "COMMIT_RESERVE_BYTES": "save.checkpointer", "FailurePolicy": "save.config",
    "LazyCheckpointer": "save.checkpointer", "LazySaveConfig": "save.config",
    "TELEMETRY_FILENAME": "save.checkpointer", "append_telemetry": "save.checkpointer",
    "prepare_and_probe_root": "save.checkpointer",
    "BACKEND": "save.strategies", "DataStatesLoadStrategy": "save.strategies",
    "DataStatesSaveStrategy": "save.strategies", "DurableCommonSaveStrategy": "save.strategies",
    "SafeCommonLoadStrategy": "save.strategies", "SafeTorchDistLoadStrategy": "save.strategies",
    "durable_common_save": "save.strategies", "engine_payload": "save.payload",
    "load_strategies": "save.strategies", "read_sharded_tensor": "save.strategies",
    "AgreedLoadStrategy": "save.strategies", "save_strategy": "save.strategies",
    # save plan
    "SavePlanCache": "save.plan", "StructurePolicy": "save.plan",
    # merge
    "DataStatesSource": "merge.sources", "Source": "merge.sources",
    "TorchDistSource": "merge.sources", "open_source": "merge.sources",
    "OptimizerFlavor": "merge.plan", "advance_tracker": "merge.run", "run_merge": "merge.run",
    "UNIVERSAL_TELEMETRY_FILE": "merge.run",
    "BackgroundMerger": "merge.background", "MergeQueue": "merge.background",
    "MergerConfig": "merge.background", "die_with_parent": "merge.background",
    "merge_with_workers": "merge.parallel",
    "describe": "inspect", "render": "inspect", "export_hf": "hf.exporter",
    "Located": "resolve", "locate": "resolve", "locate_universal": "resolve",
    "UNIVERSAL_KIND": "resolve",
    "expand_local_dir": "levels.local_tier", "newest_on_every_node": "levels.node_local",
    "drop_node_local_newer": "levels.node_local",
    "PeerReplicator": "levels.peer_replica", "RestoreStats": "levels.peer_replica",
    "Ring": "levels.peer_replica", "node_index": "levels.peer_replica",
    "check_memory_room": "levels.in_memory", "release_memory": "levels.in_memory",
    "memory_node_needs": "levels.in_memory", "adopt_left_memory": "levels.in_memory",
    "held_versions": "levels.in_memory", "processes_using": "levels.in_memory",
    "held_bytes": "levels.in_memory",
    "restore_memory_from_peers": "levels.in_memory_peers",
    "restore_before_load": "levels.peer_replica", "needed_saved_ranks": "levels.peer_replica",
    "bring_needed": "levels.peer_replica",
    "assemble_memory_for_layout": "levels.in_memory_relayout",
    "is_assembled_memory": "levels.in_memory_relayout",
    "memory_holds_other_ranks": "levels.in_memory_relayout",
}
_RENAMED = {"UNIVERSAL_TELEMETRY_FILE": "TELEMETRY_FILE", "expand_local_dir": "expand",
            "check_memory_room": "check_room", "release_memory": "release",
            "memory_node_needs": "node_needs", "drop_node_local_newer": "drop_newer",
            "assemble_memory_for_layout": "assemble", "is_assembled_memory": "is_assembled",
            "memory_holds_other_ranks": "holds_other_ranks"}

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
