"""The node-local tier (`--lazy-save-local-dir`): where it is, whether it is usable, what is kept.

Each rank's shards of ROOT/iter_NNNNNNN are written first to LOCAL/iter_NNNNNNN (the engine's
level 3), then migrated to ROOT by the engine in the background. Ranks of one node share LOCAL;
every file in it is named by rank, so each rank removes only its own files when a copy ages out,
and the last one out removes the directory.
"""
from __future__ import annotations

import os
import shutil
import socket
from typing import Iterable, List, Mapping, Optional

from ...errors import CheckpointError
from ...storage_errors import advice
from ...layout import FORMAT_FILE, index_file, rank_marker_file, shard_file
from ..paths import checkpoint_dir, iteration_of, probe_writable

__all__ = ["check_usable", "expand", "local_iterations", "prune", "remove_rank_files"]

FLAG = "--lazy-save-local-dir"


def expand(template: str, rank: int, env: Optional[Mapping[str, str]] = None,
           flag: str = FLAG) -> str:
    """`template` with {rank} (global rank), {local_rank}, {node} (node index: torchrun's
    GROUP_RANK, else Slurm's SLURM_NODEID, else 0) and {host} (host name) filled in; an error
    names `flag`, the option the template came from."""
    env = os.environ if env is None else env
    node = env.get("GROUP_RANK", env.get("SLURM_NODEID", "0"))
    try:
        return template.format(rank=rank, local_rank=env.get("LOCAL_RANK", "0"), node=node,
                               host=socket.gethostname())
    except (KeyError, IndexError, ValueError) as err:
        raise CheckpointError(f"{flag} {template!r}: unknown or malformed placeholder ({err}); "
                              "expected only {rank}, {local_rank}, {node} or {host}") from None


def check_usable(local_dir: str, rank: int) -> Optional[str]:
    """None when this rank can create, write and fsync a file in `local_dir` (created if
    missing); otherwise why not, naming the directory."""
    try:
        probe_writable(local_dir, rank)
    except OSError as err:
        # why, in words, and what to do (a full disk: the free space there)
        return f"{FLAG} {local_dir} is not usable on rank {rank}: {err.strerror or err}" \
            + advice(err, FLAG, local_dir)
    return None


def local_iterations(local_dir: str) -> List[int]:
    """Iterations with a directory under `local_dir`, oldest first."""
    try:
        names = os.listdir(local_dir)
    except OSError:
        return []
    found = []
    for name in names:
        try:
            it = iteration_of(name)
        except CheckpointError:
            continue  # not a copy of ours (another tool's file, our probe)
        if os.path.isdir(os.path.join(local_dir, name)):
            found.append(it)
    return sorted(found)


def remove_rank_files(directory: str, rank: int) -> None:
    """This rank's files of one local copy; the directory too once no rank's files are left."""
    for name in (rank_marker_file(rank), index_file(rank), shard_file(rank)):  # marker first
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            pass
    try:
        left = [n for n in os.listdir(directory) if n != FORMAT_FILE]
    except FileNotFoundError:
        return
    if not left:  # another rank of this node may race us here: both outcomes are fine
        shutil.rmtree(directory, ignore_errors=True)


def prune(local_dir: str, rank: int, keep: int, protected: Iterable[int]) -> List[int]:
    """Remove this rank's files of the local copies (LOCAL/iter_NNNNNNN) beyond the newest
    `keep`, never those of `protected` iterations (still migrating, newest committed). Returns
    the iterations removed."""
    its = local_iterations(local_dir)
    kept = set(its[-keep:]) | set(protected)
    removed = [it for it in its if it not in kept]
    for it in removed:
        remove_rank_files(checkpoint_dir(local_dir, it), rank)
    return removed
