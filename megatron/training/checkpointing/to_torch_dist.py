"""A DataStates (`--async-lazy-save`) checkpoint -> a Megatron `torch_dist` one, directly.

For users whose other tools (upstream Megatron-LM, converters) read torch_dist and should not
need our package: every tensor is read whole from the DataStates shards (checksums verified),
every small object (RNG states, optimizer common state) and common.pt are carried over, and
megatron-core's own torch_dist strategy writes the result (one process; PyTorch DCP reshards it
on load at any TP/PP/DP, as it does any torch_dist checkpoint). The iteration, run config,
content metadata (e.g. the distributed optimizer's sharding type) stay what they were.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import datastates
from datastates import CheckpointReader
from datastates.megatron_adapter import paths

from megatron.training.checkpointing.from_universal import single_process_group, whole_object, \
    write_torch_dist

__all__ = ["datastates_to_torch_dist"]

_CONTENT_METADATA = "content_metadata"  # megatron-core keeps it in common.pt under this key


def datastates_to_torch_dist(src: str, out_dir: str,
                             progress: Optional[Callable[[int, int, str], None]] = None,
                             allow_unsafe_pickle: bool = False) -> int:
    """Write the committed DataStates checkpoint `src` (an iter_XXXXXXX directory) as torch_dist
    into `out_dir`. Returns the iteration."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if paths.detect_format(src) is not paths.Format.DATASTATES:
        raise datastates.CheckpointError(
            f"expected a DataStates checkpoint (metadata.json naming backend 'datastates'), "
            f"found {paths.detect_format(src).value}", file=src)
    if os.path.abspath(src) == os.path.abspath(out_dir):
        raise datastates.CheckpointError("the output must be another directory than the "
                                         "checkpoint it is converted from", file=out_dir)
    iteration = paths.iteration_of(src)
    single_process_group()
    sd: dict = dict(paths.saved_common(src, allow_unsafe_pickle))
    content_metadata = sd.pop(_CONTENT_METADATA, None)
    with CheckpointReader(src, verify=True, allow_pickle=allow_unsafe_pickle) as reader:
        keys = reader.tensor_keys(shards_only=True)
        steps = len(keys) + 1
        for i, key in enumerate(keys):
            sd[key] = ShardedTensor.from_rank_offsets(key, reader.read(key), replica_id=0)
            if progress is not None:
                progress(i + 1, steps, key)
        for rank in reader.ranks():
            # the DataStates strategy saves {"tensors": ..., "objects": {unique key: value}}
            for unique_key, value in reader.load_objects(rank)["objects"].items():
                sd[unique_key] = whole_object(unique_key, value)
    write_torch_dist(sd, out_dir, content_metadata, progress, steps)
    return iteration
