"""Megatron checkpoint paths, in one place: what a ``--save`` root holds and how to read its names.

    SAVE/
      latest_checkpointed_iteration.txt   the tracker: the newest complete iteration, moved last
      .latest_checkpointed_iteration.txt.spare   blocks set aside so the tracker moves on a full disk
      run_config.json                     the run's resolved configuration
      iter_0000010/                       one checkpoint:
        metadata.json                     megatron's: which sharded backend (torch_dist, datastates)
        common.pt                         megatron's common state (iteration, counters, run config)
        COMMIT.json                       DataStates only: every rank's shards are durable
        mp_rank_00[_001]/model_optim_rng.pt, distrib_optim.pt   the legacy torch format instead

A universal root (``SAVE/universal``) has the same tracker and ``iter_XXXXXXX`` names; its
directories count as complete once committed. Needs no megatron import: the trainer, the tools
and the background merge all use it. Every name
read from a checkpoint (the tracker, directory listings) is confined to the root (`fileio`).
"""
from __future__ import annotations

import enum
import json
import os
import re
import time
from typing import List, Optional, Tuple

from ..errors import CheckpointError
from ..faults import fail_point
from ..fileio import TRACKER_MAX_BYTES, atomic_write, fsync_dir, make_spare, read_confined, \
    read_iteration, replace_from_spare, safe_join
from ..layout import COMMIT_FILE, SUPERSEDED_PREFIX, is_committed, move_aside
from ..layout import superseded_dir as layout_superseded_dir
from ..safe_load import torch_load

__all__ = ["COMMON_FILENAME", "DISTRIB_OPTIM_FILENAME", "METADATA_FILENAME",
           "RUN_CONFIG_FILENAME", "TORCH_FILENAME", "TRACKER_FILENAME", "Format",
           "checkpoint_dir", "complete_iterations", "detect_format", "existing_iterations",
           "INCOMPLETE_PREFIX", "is_complete", "probe_writable", "set_aside",
           "iteration_of", "prepare_root", "RELEASE_DIRNAME", "tracker_names_release", "previous_complete", "read_tracker",
           "resolve_checkpoint_dir", "saved_common", "sharded_backend", "torch_rank_dir",
           "SUPERSEDED_PREFIX", "supersede", "superseded_dir", "tracked_iteration",
           "write_tracker"]

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
RELEASE_DIRNAME = "release"  # Megatron-LM's tracker text and directory for released weights
RUN_CONFIG_FILENAME = "run_config.json"
METADATA_FILENAME = "metadata.json"  # megatron.core.dist_checkpointing.core.CONFIG_FNAME
COMMON_FILENAME = "common.pt"        # megatron's COMMON_STATE_FNAME
TORCH_FILENAME = "model_optim_rng.pt"
DISTRIB_OPTIM_FILENAME = "distrib_optim.pt"
_ITER_PREFIX = "iter_"
_ITER_DIR = re.compile(r"iter_[0-9]+")  # str.isdigit() would take non-ASCII digits too


class Format(str, enum.Enum):
    """What a checkpoint directory holds."""

    TORCH_DIST = "torch_dist"   # megatron dist_checkpointing, PyTorch DCP files
    DATASTATES = "datastates"   # dist_checkpointing with our backend (--async-lazy-save)
    TORCH = "torch"             # Megatron's legacy one-file-per-(TP, PP)-rank format


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"{_ITER_PREFIX}{iteration:07d}")


def iteration_of(directory: str) -> int:
    """The iteration of ``ROOT/iter_NNNNNNN``."""
    name = os.path.basename(os.path.normpath(directory))
    if not _ITER_DIR.fullmatch(name):
        raise CheckpointError(f"expected an {_ITER_PREFIX}NNNNNNN directory, found {name!r}",
                              file=directory)
    return int(name[len(_ITER_PREFIX):])


# ----------------------------------------------------------------------------- tracker

def read_tracker(root: str) -> int:
    """The iteration the tracker of `root` names; refused unless it is a plain non-negative
    number naming a directory that is no link out of `root`."""
    if not os.path.isdir(root):
        raise CheckpointError("--load directory does not exist", file=root)
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        raise CheckpointError(f"no {TRACKER_FILENAME} in the --load directory (no complete "
                              f"checkpoint was ever written there)", file=root)
    iteration = read_iteration(path, what=TRACKER_FILENAME)
    safe_join(root, os.path.basename(checkpoint_dir(root, iteration)), what=TRACKER_FILENAME)
    return iteration


def tracker_names_release(root: str) -> bool:
    """Whether the tracker of `root` says ``release`` (Megatron-LM's released weights: the
    checkpoint is ``root/release``, loaded as iteration 0 without optimizer or RNG state)."""
    path = os.path.join(root, TRACKER_FILENAME)
    try:
        raw = read_confined(path, what=TRACKER_FILENAME, limit=TRACKER_MAX_BYTES + 1)
    except (OSError, CheckpointError):
        return False
    return raw.decode("ascii", errors="replace").strip() == RELEASE_DIRNAME


def tracked_iteration(root: Optional[str]) -> Optional[int]:
    """The iteration the tracker names, or None if there is none or it is unreadable (for error
    messages)."""
    try:
        return read_iteration(os.path.join(root, TRACKER_FILENAME))
    except (CheckpointError, TypeError):
        return None


def prepare_root(root: str) -> None:
    """Rank 0, once at start-up, before any save: create `root` and allocate the tracker's
    spare (see `write_tracker`)."""
    os.makedirs(root, exist_ok=True)
    make_spare(os.path.join(root, TRACKER_FILENAME))


def probe_writable(root: str, rank: int) -> None:
    """Every rank, at start-up: create `root` if needed, then create, write, fsync and remove a
    small file there; raises the OSError of the first step that fails, naming `root` (a read-only
    mount, a full disk, a permission problem show up here instead of at the first save)."""
    try:
        fail_point("probe", 0, rank, root)
        os.makedirs(root, exist_ok=True)
        probe = os.path.join(root, f".datastates_probe_r{rank:05d}")
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as err:  # named by the directory: every rank's words match, one line
        raise OSError(err.errno, err.strerror, root) from err


def existing_iterations(root: str) -> Tuple[List[int], List[int]]:
    """(complete, incomplete): the iterations under `root` with a version directory whose save
    finished and those whose directory holds an unfinished save's leftovers. Finished: `is_complete`
    (metadata.json, and DataStates' commit marker); the legacy torch format has no marker of its
    own, so its directories up to the iteration the tracker names count as finished (its saves
    run in order and the tracker moves only after every rank's files are written)."""
    done = set(complete_iterations(root))
    tracked = tracked_iteration(root)
    incomplete = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        if not _ITER_DIR.fullmatch(name) or not os.path.isdir(path):
            continue
        it = int(name[len(_ITER_PREFIX):])
        if it in done:
            continue
        legacy = any(n.startswith("mp_rank_") for n in os.listdir(path)) \
            and sharded_backend(path) is None
        if legacy and tracked is not None and it <= tracked:
            done.add(it)
        else:
            incomplete.append(it)
    return sorted(done), sorted(incomplete)


INCOMPLETE_PREFIX = ".incomplete-"


def set_aside(directory: str) -> Optional[str]:
    """Rank 0, before a save into `directory`: an earlier, unfinished save's leftovers there are
    renamed out of the ``iter_*`` namespace (``.incomplete-iter_N-<ns>``), so no file of theirs is
    mixed with the new save's and no reader takes them for a checkpoint. Returns the new name (for
    the caller to remove), or None when there was nothing. Never called on a complete version:
    a committed checkpoint is never rewritten (see `CheckpointManager.maybe_save`)."""
    if not os.path.isdir(directory):
        return None
    if is_complete(directory):
        raise CheckpointError("refusing to set aside a complete checkpoint (a committed "
                              "checkpoint is never rewritten)", file=directory)
    root, name = os.path.split(os.path.normpath(directory))
    aside = os.path.join(root, f"{INCOMPLETE_PREFIX}{name}-{time.time_ns()}")
    os.replace(directory, aside)
    return aside


def superseded_dir(root: str, start_iteration: int) -> str:
    """Where `supersede` moves the checkpoints a run starting from `start_iteration` replaces
    (`layout.superseded_dir`, named by that iteration's directory)."""
    return layout_superseded_dir(root, os.path.basename(checkpoint_dir(root, start_iteration)))


def supersede(root: str, iterations: List[int], into: str, tracker_to: Optional[int]) -> None:
    """Rank 0: move the complete checkpoints `iterations` of `root`, whole and untouched, into
    `into` (under `root`, out of the ``iter_*`` names: no loader, retention or save meets them
    again). The tracker first, if it names one of them: to `tracker_to`, or removed where no
    complete checkpoint is left (a kill in between leaves it naming a checkpoint in place)."""
    if tracked_iteration(root) in iterations:
        if tracker_to is not None:
            write_tracker(root, tracker_to)
        else:
            os.unlink(os.path.join(root, TRACKER_FILENAME))
            fsync_dir(root)
    move_aside(root, [os.path.basename(checkpoint_dir(root, it)) for it in iterations], into)


def write_tracker(root: str, iteration: int, run_config_json: Optional[str] = None) -> None:
    """Rank 0, after a save is complete: name `iteration` as the newest complete checkpoint.

    On a disk that filled up after the save completed the tracker still moves: it is rewritten
    into blocks allocated beforehand (`prepare_root`, then renewed each time), and
    run_config.json is rewritten only when the run's configuration differs from it."""
    if run_config_json is not None:
        data = run_config_json.encode()
        path = os.path.join(root, RUN_CONFIG_FILENAME)
        try:
            with open(path, "rb") as f:
                same = f.read() == data
        except OSError:
            same = False
        if not same:
            atomic_write(path, data)
    replace_from_spare(os.path.join(root, TRACKER_FILENAME), str(iteration).encode())


# ----------------------------------------------------------------------------- formats

def sharded_backend(directory: str) -> Optional[str]:
    """The sharded backend metadata.json names, or None without a readable metadata.json."""
    try:
        with open(os.path.join(directory, METADATA_FILENAME)) as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, ValueError, AttributeError):
        return None
    return backend if isinstance(backend, str) else None


def detect_format(directory: str) -> Format:
    """torch_dist and DataStates write metadata.json (naming their backend); torch writes
    ``mp_rank_*``."""
    if os.path.isfile(os.path.join(directory, METADATA_FILENAME)):
        backend = sharded_backend(directory)
        return Format.DATASTATES if backend == Format.DATASTATES.value else Format.TORCH_DIST
    if os.path.isdir(directory) and any(n.startswith("mp_rank_") for n in os.listdir(directory)):
        return Format.TORCH
    raise CheckpointError(f"not a checkpoint directory: expected {METADATA_FILENAME} (torch_dist, "
                          f"datastates) or mp_rank_* (torch)", file=directory)


def torch_rank_dir(directory: str, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """The legacy torch format's per-(TP, PP)-rank directory, as Megatron-LM names it."""
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp_size > 1 else "")
    return os.path.join(directory, name)


def saved_common(directory: str, allow_unsafe_pickle: bool = False) -> dict:
    """megatron's common.pt of a dist_checkpointing checkpoint, read without running code."""
    path = os.path.join(directory, COMMON_FILENAME)
    if not os.path.isfile(path):
        raise CheckpointError(f"no {COMMON_FILENAME}: not a complete dist_checkpointing "
                              "checkpoint", file=directory)
    return torch_load(path, file=path, allow_unsafe=allow_unsafe_pickle,
                      extra_globals=megatron_args_globals())


def megatron_args_globals() -> list:
    """The classes besides `safe_load.safe_globals` that Megatron-LM's ``args`` Namespace holds
    (checked against its core_v0.16.1 defaults): two megatron-core enums, rebuilt from their value
    (an enum lookup runs no code of the file's choosing). Anything else is refused by name."""
    try:
        from megatron.core.enums import ModelType
        from megatron.core.transformer.enums import AttnBackend
    except ImportError:  # no megatron-core here: such args are refused by name
        return []
    return [AttnBackend, ModelType]


def is_complete(directory: str) -> bool:
    """A dist_checkpointing checkpoint whose save finished: metadata.json present and, for
    DataStates checkpoints, the commit marker too; or a committed universal checkpoint."""
    backend = sharded_backend(directory)
    if backend is None:
        from ..universal import is_committed as universal_committed

        return universal_committed(directory)
    return backend != Format.DATASTATES.value or is_committed(directory)


def complete_iterations(root: str) -> List[int]:
    """Iterations under `root` whose save finished (`is_complete`), ascending. Directories that
    are links out of `root` are not among them."""
    out = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if not _ITER_DIR.fullmatch(name):
            continue
        try:
            path = safe_join(root, name, what="--load directory")
        except CheckpointError:
            continue
        if is_complete(path):
            out.append(int(name[len(_ITER_PREFIX):]))
    return sorted(out)


def previous_complete(root: str, iteration: int) -> Optional[int]:
    older = [it for it in complete_iterations(root) if it < iteration]
    return older[-1] if older else None


def resolve_checkpoint_dir(path: str) -> str:
    """`path` itself, or for a save root the ``iter_XXXXXXX`` its tracker names (confined to it)."""
    if os.path.isfile(os.path.join(path, TRACKER_FILENAME)):
        iteration = read_tracker(path)
        return safe_join(path, os.path.basename(checkpoint_dir(path, iteration)),
                         what=TRACKER_FILENAME)
    return path


# Referenced by the adapter's commit step; kept here so every Megatron-layout name is listed once.
DATASTATES_COMMIT_FILENAME = COMMIT_FILE
