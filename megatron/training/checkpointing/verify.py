"""Is a checkpoint intact? Full verification before loading, and the fallback to older ones.

`--ckpt-fallback-to-previous` (every rank, in `load_checkpoint`):
  1) candidates: the iteration the tracker names, then every older complete one, newest first;
     with a non-persistent level, its versions and --load's in one list, newest first (the
     level's first between equal iterations); only those every rank lists (`newest_intact`);
  2) every rank verifies its share of a candidate (for DataStates checkpoints: every tensor of the
     saved ranks r with r % world == rank, all checksums; plus metadata.json, common.pt and the
     model shape; for universal ones: the manifest and index against the commit marker, the model
     shape, and every chunk of the tensors i with i % world == rank);
  3) one all-reduce: the first candidate intact on every rank is loaded. Verifying first (instead
     of catching a failed load) keeps the ranks in step: a load that fails on one rank only would
     leave the others waiting in megatron's collectives.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch.distributed as dist

from datastates import CheckpointReader
from datastates import control_plane
from datastates.megatron_adapter import paths
from datastates.universal import is_universal

from megatron.training.checkpointing.contents import CheckpointError, check_model_shape, \
    saved_run_config
from megatron.training.checkpointing.from_universal import verify_universal_share
from megatron.training.log import print_rank_0, say


def damage_hint(root: str, iteration: int, also: Optional[str] = None) -> str:
    """What to do about a damaged checkpoint (appended to load errors). `also`: --load, when
    `root` is a non-persistent level's (--ckpt-fallback-to-previous looks there too)."""
    prev, where = paths.previous_complete(root, iteration), root
    other = paths.tracked_iteration(also) if also else None
    if other is not None and other <= iteration and (prev is None or other > prev):
        prev, where = other, also
    if prev is None:
        return (f". Restore iteration {iteration}'s files from a copy; there is no older complete "
                f"checkpoint under {root}" + (f" or {also}" if also else "") + " to fall back to")
    return (f". Restore iteration {iteration}'s files from a copy, or pass "
            f"--ckpt-fallback-to-previous to resume from iteration {prev}"
            + ("" if where == root else f" of {where}") + ", the newest older complete checkpoint")


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


def newest_intact(levels: Sequence[Tuple[str, int]], config) -> Tuple[str, int]:
    """Every rank: the newest (root, iteration) that verifies on every rank. `levels`: (root,
    the iteration its tracker names), in the order of preference between equal iterations (a
    non-persistent level before --load, as `resume_root` prefers it). A level's candidates are
    its tracked iteration and every older complete one under it; only those that every rank
    lists are tried (a node-local root is each node's own: nodes may hold different older
    versions, and a rank trying one that another lacks would pair its collectives with another
    candidate's)."""
    width = len(levels)
    mine = sorted({it * width + (width - 1 - i)  # newer first, then the preferred level
                   for i, (root, tracked) in enumerate(levels)
                   for it in [tracked] + paths.complete_iterations(root) if it <= tracked},
                  reverse=True)
    (longest,) = control_plane.all_reduce([len(mine)], op=dist.ReduceOp.MAX)
    rows = control_plane.all_gather_ints(control_plane.padded(mine, longest))
    common = set(mine).intersection(*map(set, rows))
    reasons = []
    for code in sorted(common, reverse=True):
        root, it = levels[width - 1 - code % width][0], code // width
        directory = paths.checkpoint_dir(root, it)
        error = None
        try:
            verify_local_share(directory, config)
        except Exception as err:  # noqa: BLE001 - any failure disqualifies the candidate
            error = err
        (ok,) = control_plane.all_reduce([0 if error is not None else 1], op=dist.ReduceOp.MIN)
        if ok:
            if reasons:
                where = "" if root == levels[0][0] else f" of {root}"
                print_rank_0(f"WARNING: --ckpt-fallback-to-previous: resuming from iteration {it}"
                             f"{where} instead of {levels[0][1]}; skipped: " + " | ".join(reasons))
            return root, it
        reason = f"iteration {it}" + ("" if root == levels[0][0] else f" of {root}") + ": " + (
            str(error) if error is not None else "damaged on another rank")
        say(f"[rank {dist.get_rank()}] checkpoint verification failed: {reason}")
        reasons.append(reason)
    where = " or ".join(root for root, _ in levels)
    raise CheckpointError(f"--ckpt-fallback-to-previous: no intact checkpoint under {where}: "
                          + (" | ".join(reasons) or "none is complete on every rank"),
                          path=levels[0][0])
