"""Is a checkpoint intact? Full verification before loading, and the fallback to older ones.

`--ckpt-fallback-to-previous` (every rank, in `load_checkpoint`):
  1) candidates: the iteration the tracker names, then every older complete one, newest first;
  2) every rank verifies its share of a candidate (for DataStates checkpoints: every tensor of the
     saved ranks r with r % world == rank, all checksums; plus metadata.json, common.pt and the
     model shape; for universal ones: the manifest and index against the commit marker, the model
     shape, and every chunk of the tensors i with i % world == rank);
  3) one all-reduce: the first candidate intact on every rank is loaded. Verifying first (instead
     of catching a failed load) keeps the ranks in step: a load that fails on one rank only would
     leave the others waiting in megatron's collectives.
"""
from __future__ import annotations

import torch.distributed as dist

from datastates import CheckpointReader
from datastates import control_plane
from datastates.megatron_adapter import paths
from datastates.universal import is_universal

from megatron.training.checkpointing.contents import CheckpointError, check_model_shape, \
    saved_run_config
from megatron.training.checkpointing.from_universal import verify_universal_share
from megatron.training.log import print_rank_0, say


def damage_hint(root: str, iteration: int) -> str:
    """What to do about a damaged checkpoint (appended to load errors)."""
    prev = paths.previous_complete(root, iteration)
    if prev is None:
        return (f". Restore iteration {iteration}'s files from a copy; there is no older complete "
                f"checkpoint under {root} to fall back to")
    return (f". Restore iteration {iteration}'s files from a copy, or pass "
            f"--ckpt-fallback-to-previous to resume from iteration {prev}, the newest older "
            "complete checkpoint")


def verify_local_share(directory: str, config) -> None:
    """Raise CheckpointError if this rank's share of `directory` is damaged (see module doc)."""
    if is_universal(directory):  # a universal root's iteration: tensors shared out by rank
        verify_universal_share(directory, config, dist.get_rank(), dist.get_world_size())
        return
    fmt = paths.detect_format(directory)
    if fmt is not paths.Format.TORCH and paths.sharded_backend(directory) is None:
        raise CheckpointError(f"{paths.METADATA_FILENAME} is unreadable or names no sharded "
                              "backend", path=directory)
    unsafe = config.checkpoint.allow_unsafe_pickle
    check_model_shape(saved_run_config(directory, fmt, unsafe), config, directory)
    if fmt is not paths.Format.DATASTATES:
        return  # torch and torch_dist (PyTorch DCP) files carry no checksums
    rank, world = dist.get_rank(), dist.get_world_size()
    with CheckpointReader(directory, verify=True) as reader:
        for saved_rank in reader.ranks():
            if saved_rank % world == rank:
                reader.load_state(saved_rank)  # every tensor of that rank, every checksum


def newest_intact(root: str, tracked: int, config) -> int:
    """Every rank: the newest iteration <= `tracked` that verifies on every rank."""
    candidates = [tracked] + [it for it in reversed(paths.complete_iterations(root))
                              if it < tracked]
    reasons = []
    for it in candidates:
        directory = paths.checkpoint_dir(root, it)
        error = None
        try:
            verify_local_share(directory, config)
        except Exception as err:  # noqa: BLE001 - any failure disqualifies the candidate
            error = err
        (ok,) = control_plane.all_reduce([0 if error is not None else 1], op=dist.ReduceOp.MIN)
        if ok:
            if it != tracked:
                print_rank_0(f"WARNING: --ckpt-fallback-to-previous: resuming from iteration {it}"
                             f" instead of {tracked}; skipped: " + " | ".join(reasons))
            return it
        reason = f"iteration {it}: " + (str(error) if error is not None else
                                         "damaged on another rank")
        say(f"[rank {dist.get_rank()}] checkpoint verification failed: {reason}")
        reasons.append(reason)
    raise CheckpointError("--ckpt-fallback-to-previous: no intact checkpoint under the --load "
                          "directory: " + " | ".join(reasons), path=root)
