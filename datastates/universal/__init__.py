"""Universal checkpoints: parallelism-agnostic safetensors + manifest (no megatron imports).

    from datastates.universal import open_source, write_universal, UniversalCheckpoint
    result = write_universal(open_source("ckpt/iter_0000100"), "ckpt/universal/iter_0000100")
    with UniversalCheckpoint(result.directory) as u:
        box = u.read("decoder.layers.mlp.linear_fc1.weight", (0, 0, 0), (1, 128, 64))
"""
from .format import (COMMIT_FILE, FORMAT_NAME, FORMAT_VERSION, INDEX_FILE, MANIFEST_FILE, Role,
                     UniversalCheckpoint, is_committed, is_universal, split_name, tensor_name)
from .objects import decode_object, decode_value, encode_object, upgrade_command
from .plan import OptimizerFlavor
from .sources import (DataStatesSource, Source, TorchDistSource, open_source,
                      resolve_checkpoint_dir)
from .background import BackgroundMerger, MergeQueue, MergerConfig
from .merge import TELEMETRY_FILE, run_merge
from .writer import MergeResult, remove_stale_temporaries, upgrade_universal, write_universal

__all__ = ["BackgroundMerger", "MergeQueue", "MergerConfig", "TELEMETRY_FILE", "run_merge",
           "COMMIT_FILE", "DataStatesSource", "FORMAT_NAME", "FORMAT_VERSION", "INDEX_FILE",
           "MANIFEST_FILE", "MergeResult", "OptimizerFlavor", "Role", "Source", "TorchDistSource",
           "UniversalCheckpoint", "decode_object", "decode_value", "encode_object", "is_committed", "is_universal", "open_source",
           "remove_stale_temporaries", "resolve_checkpoint_dir", "split_name", "tensor_name", "upgrade_command", "upgrade_universal", "write_universal"]
