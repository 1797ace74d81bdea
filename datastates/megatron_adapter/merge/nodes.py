"""One background merge on several nodes: how the nodes' mergers meet in the shared universal root.

Every node runs a `BackgroundMerger` (on its first rank) with `MergerConfig.workers` workers; the
merger of rank 0's node (node 0, the coordinator) decides what is merged, the others follow. A
merge of iteration i with N nodes of K workers splits the tensors into N*K parts
(universal/parts.py); node n's worker k writes part n*K + k. All of it goes through files in the
temporary directory ``tmp = <root>/iter_XXXXXXX.tmp-parts-<run>`` (`job_tmp`; ``<run>`` is a
number rank 0 draws at start and every rank learns, so nothing of another run is mistaken for
this one's):

  1) the coordinator creates ``tmp`` and writes ``JOB.json`` there (`announce`), then gives its
     own workers their parts;
  2) a follower, at each poll, looks for the ``JOB.json`` of the iterations it saw committed
     (`announced`), never of others, so it only ever reads its own --save root's checkpoints,
     and gives its workers their parts; a follower whose worker failed writes ``FAILED-<n>.json``
     (`report_failure`; only into an existing ``tmp``);
  3) the coordinator, once its own parts are done, polls ``tmp`` (`progress`) until every part
     record ``PART-<p>.json`` is there (each appears atomically once its files are durable): it
     then removes ``JOB.json`` and worker 0 commits (manifest last). A ``FAILED-`` record, one of
     its own workers failing, or no new part record for `MergerConfig.remote_timeout_s` fails
     the merge: ``tmp`` is removed and nothing is committed; a follower still writing then fails
     on the missing directory and never recreates it;
  4) at exit the coordinator finishes its merges, then writes ``<root>/.merge-run-<run>.done``
     (`mark_done`); followers serve merges until they see it.
Before all that, at start, rank 0 writes ``<root>/.merge-run-<run>`` (`mark_start`) and each
node's first rank says whether it sees it: a node that does not (a universal root that is not
on a shared file system) would never find an announcement, so then only rank 0's node merges.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import List, Optional

from ...errors import CheckpointError
from ...fileio import atomic_write, read_confined

JOB_FILE = "JOB.json"
_FAILED = re.compile(r"FAILED-(\d+)\.json")
_PART = re.compile(r"PART-(\d+)\.json")


def job_tmp(output: str, run_id: str) -> str:
    return f"{output}.tmp-parts-{run_id}"


def start_marker(root: str, run_id: str) -> str:
    return os.path.join(root, f".merge-run-{run_id}")


def done_marker(root: str, run_id: str) -> str:
    return start_marker(root, run_id) + ".done"


def mark_start(root: str, run_id: str) -> None:
    """Step 0), rank 0 at start: the other nodes' first ranks look for this file to learn
    that they see the same universal root (else only rank 0's node merges)."""
    os.makedirs(root, exist_ok=True)
    atomic_write(start_marker(root, run_id), b"")


@dataclass(frozen=True)
class Job:
    iteration: int
    parts: int


def announce(tmp: str, job: Job) -> None:
    """Step 1): the coordinator's announcement (``tmp`` must not exist)."""
    os.makedirs(tmp)
    atomic_write(os.path.join(tmp, JOB_FILE),
                 json.dumps({"iteration": job.iteration, "parts": job.parts}).encode())


def announced(tmp: str, iteration: int) -> Optional[Job]:
    """Step 2): the job announced in ``tmp``, None when there is none (yet); a CheckpointError
    when its announcement is not one of ours for `iteration`."""
    path = os.path.join(tmp, JOB_FILE)
    try:
        raw = read_confined(path, what="merge announcement")
    except FileNotFoundError:
        return None
    except OSError as err:
        if not os.path.isdir(tmp):
            return None
        raise CheckpointError(f"cannot read the merge announcement: {err}", file=path) from None
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if (not isinstance(doc, dict) or doc.get("iteration") != iteration
            or not isinstance(doc.get("parts"), int) or doc["parts"] < 1):
        raise CheckpointError(f"expected a merge announcement of iteration {iteration} "
                              f"({{\"iteration\": {iteration}, \"parts\": P}}), found "
                              f"{raw[:200]!r}", file=path)
    return Job(iteration, doc["parts"])


def report_failure(tmp: str, node: int, error: str) -> None:
    """Step 2), a follower's part failed: tell the coordinator (nothing if ``tmp`` is gone)."""
    try:
        atomic_write(os.path.join(tmp, f"FAILED-{node}.json"),
                     json.dumps({"node": node, "error": error}).encode())
    except OSError:
        pass  # the coordinator already abandoned the merge and removed tmp


@dataclass(frozen=True)
class Progress:
    done: List[int]
    """Parts whose record is there."""
    failures: List[str]
    """What the followers that failed reported."""


def progress(tmp: str) -> Progress:
    """Step 3): what ``tmp`` holds now."""
    try:
        names = os.listdir(tmp)
    except FileNotFoundError:
        return Progress([], [f"its temporary directory {tmp} is gone"])
    done = sorted(int(m.group(1)) for m in map(_PART.fullmatch, names) if m)
    failures = []
    for name in sorted(n for n in names if _FAILED.fullmatch(n)):
        try:
            doc = json.loads(read_confined(os.path.join(tmp, name), what="merge failure"))
            failures.append(f"node {doc['node']}: {doc['error']}")
        except (OSError, ValueError, KeyError, TypeError) as err:
            failures.append(f"{name}: {err}")
    return Progress(done, failures)


def withdraw(tmp: str) -> None:
    """Step 3), all parts are durable: the announcement is no part of the checkpoint."""
    os.unlink(os.path.join(tmp, JOB_FILE))


def mark_done(root: str, run_id: str) -> None:
    """Step 4)."""
    atomic_write(done_marker(root, run_id), b"")


def remove_leftovers(root: str, run_id: str) -> None:
    """The coordinator before each merge (none runs then): the markers of earlier runs, and the
    temporary directories of this run's failed merges (removing one can race with a follower
    that is still creating a file in it)."""
    for path in glob.glob(os.path.join(glob.escape(root), ".merge-run-*")):
        if path not in (start_marker(root, run_id), done_marker(root, run_id)):
            try:
                os.unlink(path)
            except OSError:
                pass
    for path in glob.glob(os.path.join(glob.escape(root), f"iter_*.tmp-parts-{run_id}")):
        shutil.rmtree(path, ignore_errors=True)
