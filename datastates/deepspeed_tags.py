"""What a DeepSpeed tag saved with DataStates is on disk, and how it is read (no DeepSpeed import).

- Each file DeepSpeed names, `<save_dir>/<tag>/<name>.pt`, is a one-rank DataStates version
  directory at that path (shard, checksummed index, commit marker).
- A rank whose files of a tag are all durable writes `<tag>/.datastates/rank_NNNNN.json`
  listing them; whichever rank then finds every rank's marker (and every listed file committed)
  writes `<tag>/.datastates/COMMIT.json` and moves DeepSpeed's `latest` to the tag.
- A file is read only from a committed tag (`read_file`), every piece verified; DeepSpeed's own
  objects (its loss scaler, slice mappings) are stored as class name and attribute dict and
  rebuilt without running their code, for the classes of `SAFE_CLASSES` only.
- `export_torch` writes a committed tag as DeepSpeed's own torch.save files, for its tools.

The engine that writes them, and when: `deepspeed_engine.py`.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import layout
from .errors import CheckpointError
from .fileio import atomic_write, fsync_dir
from .reader import CheckpointReader

TAG_MARKERS = ".datastates"
TAG_COMMIT = "COMMIT.json"

#: DeepSpeed classes found in its state dicts (ZeRO's loss scaler, its parameter slice
#: mappings). Stored as their class name and attribute dict; rebuilt without running their code.
_OBJ = "__datastates_deepspeed_object__"
SAFE_CLASSES = ("deepspeed.runtime.fp16.loss_scaler:LossScaler",
                "deepspeed.runtime.fp16.loss_scaler:DynamicLossScaler",
                "deepspeed.utils.tensor_fragment:fragment_address")



# ------------------------------------------------------------------ DeepSpeed objects, safely
def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}:{type(obj).__qualname__}"


def encode_objects(obj: Any) -> Any:
    """DeepSpeed's own objects and sets as plain dicts the safe format stores; the rest as is.
    Containers are rebuilt (a shallow copy); tensors are not touched."""
    if isinstance(obj, dict):
        return {k: encode_objects(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [encode_objects(v) for v in obj]
    if type(obj) is tuple:
        return tuple(encode_objects(v) for v in obj)
    if isinstance(obj, (set, frozenset)):
        return {_OBJ: type(obj).__name__, "items": [encode_objects(v) for v in sorted(obj, key=repr)]}
    if _class_name(obj) in SAFE_CLASSES:
        return {_OBJ: _class_name(obj), "state": encode_objects(dict(vars(obj)))}
    return obj


def _rebuild(name: str, state: Dict[str, Any], file: str) -> Any:
    if name not in SAFE_CLASSES:
        raise CheckpointError(f"{file} names class {name!r}, which a DeepSpeed checkpoint may "
                              f"not build (allowed: {list(SAFE_CLASSES)})", file=file)
    module, _, qual = name.partition(":")
    cls = sys.modules.get(module)  # never imported here: importing may run code
    for part in qual.split("."):
        cls = getattr(cls, part, None)
    if not isinstance(cls, type):
        raise CheckpointError(f"{file} holds a {name}; import deepspeed before loading it",
                              file=file)
    obj = object.__new__(cls)  # no __init__, no __setstate__: nothing of the class runs
    obj.__dict__.update(state)
    return obj


def decode_objects(obj: Any, file: str, device: Optional[torch.device] = None) -> Any:
    """Inverse of `encode_objects`, in place where it can; tensors moved to `device` if given."""
    if isinstance(obj, torch.Tensor):
        return obj if device is None else obj.to(device)
    rec = lambda v: decode_objects(v, file, device)  # noqa: E731
    if isinstance(obj, dict):
        kind = obj.get(_OBJ)
        if kind in ("set", "frozenset") and set(obj) == {_OBJ, "items"}:
            items = [rec(v) for v in obj["items"]]
            return set(items) if kind == "set" else frozenset(items)
        if isinstance(kind, str) and set(obj) == {_OBJ, "state"}:
            return _rebuild(kind, rec(obj["state"]), file)
        for k, v in obj.items():
            obj[k] = rec(v)
        return obj
    if isinstance(obj, list):
        return [rec(v) for v in obj]
    if type(obj) is tuple:
        return tuple(rec(v) for v in obj)
    return obj


def safe_globals() -> List[Any]:
    """The DeepSpeed classes a plain torch.save file of DeepSpeed's may hold (weights_only)."""
    out = []
    for name in SAFE_CLASSES + ("deepspeed.runtime.zero.config:ZeroStageEnum",):
        module, _, qual = name.partition(":")
        cls = getattr(sys.modules.get(module), qual, None)
        if isinstance(cls, type):
            out.append(cls)
    return out


# ------------------------------------------------------------------ tags: the unit DeepSpeed loads
def tag_marker(tag_dir: str, rank: int) -> str:
    return os.path.join(tag_dir, TAG_MARKERS, f"rank_{rank:05d}.json")


def tag_commit(tag_dir: str) -> str:
    return os.path.join(tag_dir, TAG_MARKERS, TAG_COMMIT)


def _read_doc(path: str) -> Optional[Dict[str, Any]]:
    try:
        doc = layout.read_json(path, what="DeepSpeed tag marker")
    except CheckpointError:
        return None
    return doc if isinstance(doc, dict) else None


def tag_is_committed(tag_dir: str) -> bool:
    return _read_doc(tag_commit(tag_dir)) is not None


def try_commit_tag(tag_dir: str, world_size: int) -> bool:
    """If every rank's marker is there and every file it lists is committed, write the tag's
    commit marker (atomically; any rank may, the content is the same) and return True."""
    if tag_is_committed(tag_dir):
        return True
    # One directory read first: only the last rank(s) to mark read every marker (each rank
    # reading all of them would be world_size^2 reads of the shared file system per tag).
    try:
        names = os.listdir(os.path.join(tag_dir, TAG_MARKERS))
    except OSError:
        return False
    if sum(1 for n in names if n.startswith("rank_") and n.endswith(".json")) < world_size:
        return False
    files: List[str] = []
    started = []
    for r in range(world_size):
        doc = _read_doc(tag_marker(tag_dir, r))
        if doc is None or doc.get("world_size") != world_size:
            return False
        for name in doc.get("files", []):
            path = os.path.join(tag_dir, os.path.basename(str(name)))
            if not layout.is_committed(path):
                return False
            files.append(os.path.basename(str(name)))
        started.append(float(doc.get("started", 0.0)))
    atomic_write(tag_commit(tag_dir), layout.dumps(dict(
        layout.format_header(), tag=os.path.basename(tag_dir), world_size=world_size,
        files=sorted(set(files)), started=min(started))))
    return True


def _tag_order(save_dir: str, tag: str) -> tuple:
    """Sort key of a committed tag: DeepSpeed's default tags by step, others by save time."""
    m = re.fullmatch(r"global_step(\d+)", tag)
    doc = _read_doc(tag_commit(os.path.join(save_dir, tag))) or {}
    return (int(m.group(1)) if m else -1, float(doc.get("started", 0.0)))


def _latest(save_dir: str) -> str:
    """The tag DeepSpeed's `latest` file of `save_dir` names ('' without one)."""
    try:
        with open(os.path.join(save_dir, "latest")) as f:
            return f.read().strip()
    except OSError:
        return ""


def advance_latest(save_dir: str, tag: str) -> None:
    """Point DeepSpeed's `latest` file at `tag` unless it names a newer committed tag."""
    current = _latest(save_dir)
    if current and current != tag and tag_is_committed(os.path.join(save_dir, current)) \
            and _tag_order(save_dir, current) > _tag_order(save_dir, tag):
        return
    if current != tag:
        atomic_write(os.path.join(save_dir, "latest"), tag.encode())


def _newer(save_dir: str, tag: str, than: str) -> bool:
    """Whether committed `tag` was saved after `than` in a rollback's sense: by step when both
    are DeepSpeed's default tags, else by save start time when both are committed; False when
    they cannot be compared (e.g. `than` is another engine's torch.save tag with its own name)."""
    steps = [re.fullmatch(r"global_step(\d+)", t) for t in (tag, than)]
    if all(steps):
        return int(steps[0].group(1)) > int(steps[1].group(1))
    docs = [_read_doc(tag_commit(os.path.join(save_dir, t))) for t in (tag, than)]
    if not all(docs):
        return False
    return float(docs[0].get("started", 0.0)) > float(docs[1].get("started", 0.0))


def newer_committed_tags(save_dir: str, than: str) -> List[str]:
    """The committed tags of `save_dir` saved after tag `than` (`_newer`), oldest first: after a
    run resumed from `than` in that directory, those are another run's (the one rolled back
    from), which this run's saves would otherwise meet."""
    try:
        names = os.listdir(save_dir)
    except OSError:
        return []
    return sorted((n for n in names if n != than
                   and tag_is_committed(os.path.join(save_dir, n)) and _newer(save_dir, n, than)),
                  key=lambda n: _tag_order(save_dir, n))


def supersede_tags(save_dir: str, tags: List[str], loaded: str) -> str:
    """Rank 0: move committed `tags` of `save_dir`, whole and untouched, into a
    `layout.superseded_dir` (no DeepSpeed load, `latest` or save meets them there), `latest`
    first: to `loaded` if it names one of them (a kill in between leaves it naming a tag in
    place). Returns that directory."""
    if _latest(save_dir) in tags:
        atomic_write(os.path.join(save_dir, "latest"), loaded.encode())
    into = layout.superseded_dir(save_dir, loaded)
    layout.move_aside(save_dir, tags, into)
    return into


def newest_committed_tag(save_dir: str) -> Optional[str]:
    try:
        names = [n for n in os.listdir(save_dir)
                 if tag_is_committed(os.path.join(save_dir, n))]
    except OSError:
        return None
    return max(names, key=lambda n: _tag_order(save_dir, n), default=None)


def check_tag(tag_dir: str, file: str) -> None:
    """The tag is committed; otherwise a CheckpointError (naming `file`) names the tag and the
    newest committed one in its save directory."""
    if not tag_is_committed(tag_dir):
        save_dir = os.path.dirname(tag_dir)
        newest = newest_committed_tag(save_dir)
        raise CheckpointError(
            f"DeepSpeed checkpoint tag {os.path.basename(tag_dir)!r} in {save_dir} is not "
            f"committed: its save was interrupted before every rank's files were durable "
            f"(no {TAG_MARKERS}/{TAG_COMMIT}); "
            + (f"the newest committed tag there is {newest!r}" if newest
               else "no tag there is committed"), file=file)


def check_loadable(path: str) -> None:
    """`path`, a file of a DeepSpeed tag written by us, may be read: its tag is committed and
    lists it."""
    tag_dir = os.path.dirname(path)
    check_tag(tag_dir, path)
    doc = _read_doc(tag_commit(tag_dir)) or {}
    if os.path.basename(path) not in doc.get("files", []):
        raise CheckpointError(f"DeepSpeed checkpoint tag {os.path.basename(tag_dir)!r} was "
                              f"committed without this file", file=path)


def read_file(path: str, allow_pickle: bool = False,
              device: Optional[torch.device] = None) -> Any:
    """One file of a committed tag, every piece verified, DeepSpeed's objects rebuilt."""
    check_loadable(path)
    with CheckpointReader(path, allow_pickle=allow_pickle) as reader:
        return decode_objects(reader.load_state(rank=0), path, device)


def resolve_tag(src: str) -> str:
    """The tag directory `src` names: itself (it holds our tag markers), or the tag that
    DeepSpeed's `latest` file in it names."""
    src = os.path.abspath(src)
    if os.path.isdir(os.path.join(src, TAG_MARKERS)):
        return src
    try:
        with open(os.path.join(src, "latest")) as f:
            tag = f.read().strip()
    except OSError:
        raise CheckpointError("expected a DeepSpeed tag written with DataStates (it holds "
                              f"{TAG_MARKERS}/) or a save directory with a `latest` file; "
                              "found neither", file=src) from None
    tag_dir = os.path.join(src, os.path.basename(tag))
    if not os.path.isdir(os.path.join(tag_dir, TAG_MARKERS)):
        raise CheckpointError(f"`latest` names tag {tag!r}, which was not written with DataStates",
                              file=tag_dir)
    return tag_dir


def export_torch(src: str, dst: str, allow_pickle: bool = False) -> Tuple[str, List[str]]:
    """Write the committed tag that `src` names as DeepSpeed's own torch.save files,
    `dst/<tag>/<file>`, and `dst/latest`, for the tools that torch.load them (DeepSpeed's
    zero_to_fp32.py, ds_to_universal). Every piece is verified as it is read; deepspeed must be
    imported (its objects are rebuilt). Nothing is left in `dst/<tag>` unless every file was
    written. Returns (tag, file names)."""
    tag_dir = resolve_tag(src)
    tag = os.path.basename(tag_dir)
    check_tag(tag_dir, tag_dir)
    names = list((_read_doc(tag_commit(tag_dir)) or {}).get("files", []))
    out = os.path.join(os.path.abspath(dst), tag)
    if os.path.exists(out):
        raise CheckpointError("the output tag directory already exists; remove it or choose "
                              "another destination", file=out)
    partial = f"{out}.partial-{time.time_ns()}"
    os.makedirs(partial)
    try:
        for name in names:
            state = read_file(os.path.join(tag_dir, name), allow_pickle)
            torch.save(state, os.path.join(partial, name))
        os.rename(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    fsync_dir(os.path.dirname(out))
    atomic_write(os.path.join(os.path.dirname(out), "latest"), tag.encode())
    return tag, names
