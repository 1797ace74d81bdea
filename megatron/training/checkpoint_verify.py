"""Is a checkpoint intact? Full verification before loading, and the fallback to older ones.

`--ckpt-fallback-to-previous` (every rank, in `load_checkpoint`):
  1) candidates: the iteration the tracker names, then every older complete one, newest first;
  2) every rank verifies its share of a candidate (for DataStates checkpoints: every tensor of the
     saved ranks r with r % world == rank, all checksums; plus metadata.json, common.pt and the
     model shape);
  3) one all-reduce: the first candidate intact on every rank is loaded. Verifying first (instead
     of catching a failed load) keeps the ranks in step: a load that fails on one rank only would
     leave the others waiting in megatron's collectives.
"""
from __future__ import annotations

import json
import os
import re
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.training.checkpoint_state import CheckpointError
from megatron.training.log import print_rank_0

_ITER_PREFIX = "iter_"
_ITER_DIR = re.compile(r"iter_[0-9]+")  # str.isdigit() would take non-ASCII digits too


def complete_iterations(root: str) -> List[int]:
    """Iterations under `root` whose save finished: metadata.json present and, for DataStates
    checkpoints, the commit marker too. Ascending."""
    from datastates import CheckpointError as DataStatesError, is_committed
    from datastates.layout import safe_join

    out = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if not _ITER_DIR.fullmatch(name):
            continue
        try:
            path = safe_join(root, name, what="--load directory")
        except DataStatesError:
            continue  # a link out of the root is not one of its checkpoints
        meta = os.path.join(path, "metadata.json")
        if not os.path.isfile(meta):
            continue
        try:
            backend = json.load(open(meta)).get("sharded_backend")
        except (OSError, ValueError, AttributeError):
            continue
        if backend != "datastates" or is_committed(path):
            out.append(int(name[len(_ITER_PREFIX):]))
    return sorted(out)


def previous_complete(root: str, iteration: int) -> Optional[int]:
    older = [it for it in complete_iterations(root) if it < iteration]
    return older[-1] if older else None


def damage_hint(root: str, iteration: int) -> str:
    """What to do about a damaged checkpoint (appended to load errors)."""
    prev = previous_complete(root, iteration)
    if prev is None:
        return (f". Restore iteration {iteration}'s files from a copy; there is no older complete "
                f"checkpoint under {root} to fall back to")
    return (f". Restore iteration {iteration}'s files from a copy, or pass "
            f"--ckpt-fallback-to-previous to resume from iteration {prev}, the newest older "
            "complete checkpoint")


def verify_local_share(directory: str, config) -> None:
    """Raise CheckpointError if this rank's share of `directory` is damaged (see module doc)."""
    from megatron.training.checkpoint_loading import _saved_config, detect_format
    from megatron.training.checkpoint_state import check_model_shape
    from megatron.training.config import CkptFormat

    fmt = detect_format(directory)
    check_model_shape(_saved_config(directory, fmt), config, directory)
    if fmt is not CkptFormat.TORCH_DIST:
        return  # torch files carry no checksums: what torch.load accepts is all we can check
    try:
        backend = json.load(open(os.path.join(directory, "metadata.json")))["sharded_backend"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"metadata.json is unreadable: {err}", path=directory) from err
    if backend != "datastates":
        return  # torch_dist (PyTorch DCP) files carry no checksums either
    from datastates import CheckpointReader

    rank, world = dist.get_rank(), dist.get_world_size()
    with CheckpointReader(directory, verify=True) as reader:
        for saved_rank in reader.ranks():
            if saved_rank % world == rank:
                reader.load_state(saved_rank)  # every tensor of that rank, every checksum


def newest_intact(root: str, tracked: int, config) -> int:
    """Every rank: the newest iteration <= `tracked` that verifies on every rank."""
    candidates = [tracked] + [it for it in reversed(complete_iterations(root)) if it < tracked]
    reasons = []
    for it in candidates:
        directory = os.path.join(root, f"{_ITER_PREFIX}{it:07d}")
        error = None
        try:
            verify_local_share(directory, config)
        except Exception as err:  # noqa: BLE001 - any failure disqualifies the candidate
            error = err
        ok = torch.tensor([0 if error is not None else 1], dtype=torch.int64)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if int(ok.item()):
            if it != tracked:
                print_rank_0(f"WARNING: --ckpt-fallback-to-previous: resuming from iteration {it}"
                             f" instead of {tracked}; skipped: " + " | ".join(reasons))
            return it
        reason = f"iteration {it}: " + (str(error) if error is not None else
                                         "damaged on another rank")
        print(f"[rank {dist.get_rank()}] checkpoint verification failed: {reason}", flush=True)
        reasons.append(reason)
    raise CheckpointError("--ckpt-fallback-to-previous: no intact checkpoint under the --load "
                          "directory: " + " | ".join(reasons), path=root)
