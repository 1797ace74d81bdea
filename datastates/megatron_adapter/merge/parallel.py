"""One merge by several worker processes, outside training (``convert_checkpoint.py merge
--workers K``).

The parts of the background merge on one node (universal/parts.py), driven from the calling
process: 1) K merge workers (worker.py, normal priority, started here and stopped at the
end) each write their part of the tensors into ``<dst>.tmp-parts-<pid>`` and its part record;
2) once every part is durable this process commits (index, manifest, commit marker, rename).
A worker that fails or dies fails the merge: the other workers are killed, the temporary
directory is removed, nothing is committed, and a checkpoint already at `dst` stays as it was.
When this process is killed its workers die with it (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import dataclasses
import os
import queue
import shutil
import tempfile
import time
from typing import Callable, List, Optional

from ...errors import CheckpointError
from ...universal import MergeResult, MergeSource, is_committed, remove_stale_temporaries
from ...universal.parts import commit_parts
from .background import _Worker, worker_command

Progress = Callable[[int, int, str], None]


def merge_with_workers(source: MergeSource, dst: str, workers: int, *, max_file_bytes: int,
                       overwrite: bool = False, allow_unsafe_pickle: bool = False,
                       progress: Optional[Progress] = None) -> MergeResult:
    """Merge `source` into the universal checkpoint `dst` with `workers` processes."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, found {workers}")
    t0 = time.perf_counter()
    dst = os.path.abspath(dst)
    if is_committed(dst) and not overwrite:
        return MergeResult(dst, source.iteration(), 0, 0.0, skipped=True)
    total = sum(e.nbytes for e in source.entries())
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    remove_stale_temporaries(dst)
    tmp = f"{dst}.tmp-parts-{os.getpid()}"
    os.makedirs(tmp)
    started: List[_Worker] = []
    with tempfile.TemporaryDirectory(prefix="datastates-merge-logs-") as logs:
        try:
            answers: queue.Queue = queue.Queue()
            for k in range(workers):
                started.append(_Worker(k, worker_command(), os.path.join(logs, f"{k}.log"),
                                       answers, "w"))
                started[k].send({"id": k, "op": "part", "source": source.directory,
                                 "tmp": tmp, "part": k, "parts": workers, "create": False,
                                 "max_file_bytes": max_file_bytes,
                                 "allow_unsafe_pickle": allow_unsafe_pickle})
            _wait_for_parts(started, answers, total, progress)
        except BaseException:
            for w in started:
                w.proc.kill()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            for w in started:
                w.close()
    result = commit_parts(source, tmp, dst, workers, max_file_bytes=max_file_bytes,
                          overwrite=overwrite)
    return dataclasses.replace(result, seconds=time.perf_counter() - t0)


def _wait_for_parts(started: List[_Worker], answers: queue.Queue, total: int,
                    progress: Optional[Progress]) -> None:
    remaining, done = set(range(len(started))), 0
    while remaining:
        k, answer = answers.get()
        if k not in remaining:
            continue  # its exit, after its answer
        remaining.discard(k)
        if answer is None:
            code = started[k].proc.wait()
            raise CheckpointError(f"merge worker {k} exited (code {code}) before its part was "
                                  f"durable: {_tail(started[k].log_path)}")
        if not answer.get("ok"):
            raise CheckpointError(f"part {k} of {len(started)}: {answer.get('error')}")
        done += int(answer["result"]["bytes"])
        if progress is not None:
            progress(done, total, f"part {k} of {len(started)} durable")


def _tail(path: str, lines: int = 3) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(f.read().strip().splitlines()[-lines:]) or "(its log is empty)"
    except OSError:
        return "(no log)"
