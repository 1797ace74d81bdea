"""Universal checkpoints: parallelism-agnostic safetensors + manifest (framework-agnostic).

This package is the format: what is on disk (`format`), how small objects are stored without
pickles (`objects`), how tensor files are read and verified per chunk (`tensor_files`), and how
any `MergeSource` is written atomically (`writer`). Reading a
Megatron checkpoint into it (sources, merge CLI, background merge, inspect, Hugging Face export)
is on the Megatron side: `datastates.megatron_adapter`.

    from datastates.universal import UniversalCheckpoint
    with UniversalCheckpoint("ckpt/universal/iter_0000100") as u:
        box = u.read("decoder.layers.mlp.linear_fc1.weight", (0, 0, 0), (1, 128, 64))
"""
from .format import (COMMIT_FILE, FORMAT_NAME, FORMAT_VERSION, INDEX_FILE, MANIFEST_FILE, Entry,
                     Role, TensorInfo, UniversalCheckpoint, is_committed, is_universal, read_commit,
                     split_name, tensor_name, unchecked_warning)
from .objects import DTYPE_NAMES, decode_object, decode_value, encode_object, encode_value, \
    upgrade_command
from .tensor_files import CHUNK_BYTES
from .writer import (MergeResult, MergeSource, add_checksums, remove_stale_temporaries,
                     upgrade_universal, write_json, write_universal)

__all__ = ["CHUNK_BYTES", "COMMIT_FILE", "DTYPE_NAMES", "Entry", "FORMAT_NAME", "FORMAT_VERSION",
           "INDEX_FILE", "MANIFEST_FILE", "MergeResult", "MergeSource", "Role", "TensorInfo",
           "UniversalCheckpoint", "add_checksums", "decode_object", "decode_value",
           "encode_object", "encode_value", "is_committed", "is_universal", "read_commit",
           "remove_stale_temporaries", "split_name", "tensor_name", "unchecked_warning",
           "upgrade_command", "upgrade_universal", "write_json", "write_universal"]
