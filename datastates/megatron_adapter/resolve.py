"""What a checkpoint path given to a converter names: what `pretrain_gpt.py --load` takes, and
an error that says precisely what is missing when it names nothing usable.

Accepted, as by ``--load``:
  * a checkpoint directory: ``iter_XXXXXXX`` of a --save root (DataStates, torch_dist, torch) or
    of a universal root;
  * a root with a tracker (a --save root, a universal root such as ``SAVE/universal``): the
    iteration its tracker names.
A converter that needs a universal checkpoint (`locate_universal`: to-hf, to-torch-dist of a
universal checkpoint) also takes the --save root or the ``iter_XXXXXXX`` directory of a
checkpoint the background merge has merged: its copy in ``SAVE/universal/iter_XXXXXXX``.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Optional

from ..errors import CheckpointError
from ..fileio import read_iteration
from ..universal import MANIFEST_FILE, is_committed as universal_committed, is_universal
from .paths import (METADATA_FILENAME, TRACKER_FILENAME, Format, checkpoint_dir,
                    complete_iterations, detect_format, is_complete, iteration_of, read_tracker,
                    resolve_checkpoint_dir)

__all__ = ["Located", "UNIVERSAL_KIND", "locate", "locate_universal"]

UNIVERSAL_KIND = "universal"
#: Where the background merge writes by default (--universal-save): SAVE/universal.
DEFAULT_UNIVERSAL_DIR = "universal"
_TOOL = "python tools/convert_checkpoint.py"


@dataclass(frozen=True)
class Located:
    """A checkpoint directory and what it holds."""

    directory: str
    kind: str
    """"universal", or a `paths.Format` value ("datastates", "torch_dist", "torch")."""
    note: str = ""
    """How it was found when that is not obvious from the path given (for the user)."""


def locate(path: str) -> Located:
    """The checkpoint `path` names (see module doc); CheckpointError saying what is missing."""
    if not os.path.isdir(path):
        raise CheckpointError("checkpoint path does not exist (expected an iter_XXXXXXX "
                              "directory or a root with " + TRACKER_FILENAME + ")", file=path)
    note = ""
    directory = path
    if not is_universal(path) and os.path.isfile(os.path.join(path, TRACKER_FILENAME)):
        iteration = read_tracker(path)
        directory = resolve_checkpoint_dir(path)
        if not os.path.isdir(directory):
            raise CheckpointError(f"{TRACKER_FILENAME} names iteration {iteration}, but "
                                  f"{directory} does not exist (removed by hand?); complete "
                                  f"iterations here: {complete_iterations(path) or 'none'}",
                                  file=path)
        note = f"iteration {iteration}, named by {os.path.join(path, TRACKER_FILENAME)}"
    if is_universal(directory):
        if not universal_committed(directory):
            raise CheckpointError(_unfinished_merge(directory), file=directory)
        return Located(directory, UNIVERSAL_KIND, note)
    if os.path.isfile(os.path.join(directory, METADATA_FILENAME)) or _has_torch_ranks(directory):
        kind = detect_format(directory)
        if not is_complete(directory) and kind is not Format.TORCH:
            raise CheckpointError("the save of this checkpoint did not finish (no commit marker): "
                                  "load or convert an earlier one", file=directory)
        return Located(directory, kind.value, note)
    raise CheckpointError(_nothing_here(directory), file=directory)


def locate_universal(path: str) -> Located:
    """A committed universal checkpoint for `path` (see module doc). For a --save root or one of
    its checkpoints, its merged copy; if there is none, the error names the iteration, what is
    missing and the command that makes it."""
    found = locate(path)
    if found.kind == UNIVERSAL_KIND:
        return found
    if found.kind == Format.TORCH.value:
        raise CheckpointError("this is a legacy torch-format checkpoint, which the converters do "
                              "not read; resume from it with pretrain_gpt.py and save with "
                              "--ckpt-format torch_dist or --async-lazy-save",
                              file=found.directory)
    command = "merge" if found.kind == Format.DATASTATES.value else "from-torch-dist"
    try:
        iteration = iteration_of(found.directory)
    except CheckpointError:  # not inside a --save root: no merged copy to look for
        raise CheckpointError(f"this is a {found.kind} checkpoint, not a universal one; run "
                              f"`{_TOOL} {command} {found.directory} DST` first",
                              file=found.directory) from None
    root = os.path.dirname(os.path.abspath(found.directory))
    universal_root = os.path.join(root, DEFAULT_UNIVERSAL_DIR)
    copy = checkpoint_dir(universal_root, iteration)
    if os.path.isdir(copy) and is_universal(copy) and universal_committed(copy):
        return Located(copy, UNIVERSAL_KIND, f"the universal copy of iteration {iteration}"
                       + (f" ({found.note})" if found.note else ""))
    if os.path.isdir(copy) or glob.glob(glob.escape(copy) + ".tmp-*"):
        missing = f"its merge into {copy} has not finished (still running, or it failed)"
    else:
        missing = f"it has no universal copy yet ({copy} does not exist)"
    newest = _newest_universal(universal_root)
    hint = (f"; the newest universal checkpoint there is iteration {newest}: pass "
            f"{universal_root} to use it" if newest is not None and newest != iteration else "")
    raise CheckpointError(
        f"iteration {iteration} is a {found.kind} checkpoint and {missing}; run `{_TOOL} "
        f"{command} {found.directory} {copy}` first{hint}", file=found.directory)


def _newest_universal(universal_root: str) -> Optional[int]:
    try:
        return read_iteration(os.path.join(universal_root, TRACKER_FILENAME))
    except CheckpointError:
        done = complete_iterations(universal_root)
        return done[-1] if done else None


def _has_torch_ranks(directory: str) -> bool:
    return any(n.startswith("mp_rank_") for n in os.listdir(directory))


def _unfinished_merge(directory: str) -> str:
    """What to say about a universal directory without its commit marker."""
    try:
        with open(os.path.join(directory, MANIFEST_FILE)) as f:
            source = json.load(f)["source"]["directory"]
    except (OSError, ValueError, KeyError, TypeError):
        source = "SOURCE"
    return ("this universal checkpoint was never committed (no UNIVERSAL_COMMIT.json): its merge "
            f"did not finish (still running, or killed); rerun `{_TOOL} merge {source} "
            f"{directory} --overwrite`")


def _nothing_here(directory: str) -> str:
    names = sorted(os.listdir(directory))
    iters = [n for n in names if n.startswith("iter_") and ".tmp-" not in n]
    if iters:
        return (f"no {TRACKER_FILENAME} here, so no iteration is complete yet (a merge or save "
                f"may still be running); pass one of its directories to use it anyway: "
                f"{', '.join(iters[-3:])}")
    temporaries = [n for n in names if ".tmp-" in n]
    if temporaries:
        return (f"holds only unfinished merges ({', '.join(temporaries[:3])}): no checkpoint "
                "was committed here yet")
    return (f"not a checkpoint: expected {MANIFEST_FILE} (universal), {METADATA_FILENAME} or "
            f"mp_rank_* (an iter_XXXXXXX directory), or {TRACKER_FILENAME} (a root)")
