"""Fault points: environment-controlled pauses at the phases of a save, for crash tests.

A crash test needs to kill a job *inside* a given phase of a checkpoint, every time, not only when
a random kill happens to land there. Each phase calls `fault_point(phase, step, rank)` once per
save (never per byte). Without the environment variables below it returns at once; nothing else
in the engine depends on them.

    DATASTATES_FAULT_DELAY_<PHASE>="<seconds>[@<step>|#<n>][:<rank>]"

pauses that phase for `seconds` (only at `step`, or only the `n`-th time this process reaches
the phase, counting from 1; only on `rank`, when given) after printing one line to stderr that
a harness can wait for before it kills the process:

    DATASTATES_FAULT phase=<phase> step=<step> rank=<rank> delay=<seconds>

Phases (in the order a save goes through them):
  copy     engine copy thread, before the first tensor of the save is copied to the host cache
           (training blocks in wait_for_snapshot; nothing of this version is on disk yet)
  flush    engine writer, after every byte was written, before the shard's fsync and the rank's
           index and marker (the version has data but no marker); for a torch_dist sync save,
           the rank's writer before it starts (a hung writer, bounded by --ckpt-drain-timeout)
  commit   trainer (rank 0), after every rank is durable and metadata.json is written, before
           COMMIT.json
  tracker  trainer (rank 0), after COMMIT.json, before latest_checkpointed_iteration.txt moves
  replica  peer replica thread (--lazy-save-peer-replica), once every byte of its version
           arrived from the previous node, before it is moved into place (the received files
           are still temporary; step: the version's iteration)
  merge    universal-checkpoint merge process (started by rank 0 after a commit), after its
           first safetensors file, before its index, manifest and commit marker; its stderr goes
           to <universal root>/merge_logs/worker-K.log (K: the worker)

A pause of many seconds models a hung writer (see the drain timeout of the trainer). `#<n>`
picks an occurrence where the step that reaches a phase depends on timing: the peer replica
sends the newest version whenever the network frees up (latest wins), so "the second version
received" is certain to come where "version 4" may be skipped.

Failures, for the fault-matrix tests: one step of a save fails on one rank while the others go on.

    DATASTATES_FAULT_FAIL_<STEP>="<kind>[@<step>|#<n>][:<rank>]"

makes `fail_point(step_name, step, rank)` print ``DATASTATES_FAULT fail=<step_name> kind=<kind>
step=<step> rank=<rank>`` on stderr and then, by kind: ``error`` raises RuntimeError, ``enospc``,
``erofs`` and ``eacces`` raise the OSError of that errno, and ``kill`` sends SIGKILL to the rank's
process (from a child process the rank forked too). Steps, in save order:
  probe     every rank, start-up check that a checkpoint root can be written
  prepare   the rank that prepares a version directory (rank 0), at the save call
  common    the rank that writes common.pt (rank 0), as it writes it
  write     every rank's shard writes (DataStates' writer; torch_dist's writer process)
  commit    the commit marker: DataStates' COMMIT.json, torch_dist's metadata.json (rank 0)
  tracker   the tracker move (rank 0)
  retention the removal of old checkpoints after a commit (rank 0)
  merge     the hand-off of a committed version to the universal merge (rank 0)
"""
from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Optional

from .errors import CheckpointError

ENV_PREFIX = "DATASTATES_FAULT_DELAY_"
PHASES = ("copy", "flush", "commit", "tracker", "replica", "merge")
FAIL_PREFIX = "DATASTATES_FAULT_FAIL_"
FAIL_STEPS = ("probe", "prepare", "common", "write", "commit", "tracker", "retention", "merge")
FAIL_KINDS = ("error", "enospc", "erofs", "eacces", "kill")
_ERRNO = {"enospc": errno.ENOSPC, "erofs": errno.EROFS, "eacces": errno.EACCES}


def split_spec(text: str):
    """'<what>[@<step>|#<n>][:<rank>]' -> (what, step, n, rank), each None where not given;
    ints parsed (ValueError otherwise)."""
    what, step, nth, rank = text, None, None, None
    if ":" in what:
        what, rank = what.rsplit(":", 1)
    if "@" in what:
        what, step = what.split("@", 1)
    elif "#" in what:
        what, nth = what.split("#", 1)
        if int(nth) < 1:
            raise ValueError(nth)
    return what, *(None if v is None else int(v) for v in (step, nth, rank))


class _Where:
    """Mixin: a spec restricted to one step (or to its n-th occurrence) and one rank when they
    are given. The count is per spec, so per process (and per phase or step name)."""

    step: Optional[int]
    rank: Optional[int]
    nth: Optional[int]
    _seen: list

    def matches(self, step: int, rank: int) -> bool:
        if not ((self.step is None or self.step == step) and
                (self.rank is None or self.rank == rank)):
            return False
        if self.nth is None:
            return True
        with _COUNT_LOCK:  # the phases run on several threads
            self._seen.append(step)
            return len(self._seen) == self.nth


_COUNT_LOCK = threading.Lock()


@dataclass(frozen=True)
class FaultSpec(_Where):
    """A pause at one phase: `seconds`, optionally restricted to one step (or occurrence) and
    one rank."""

    seconds: float
    step: Optional[int] = None
    rank: Optional[int] = None
    nth: Optional[int] = None
    _seen: list = field(default_factory=list, compare=False, repr=False)


@dataclass(frozen=True)
class FailSpec(_Where):
    """A failure of one step: `kind` (FAIL_KINDS), optionally at one step (or occurrence) and on
    one rank."""

    kind: str
    step: Optional[int] = None
    rank: Optional[int] = None
    nth: Optional[int] = None
    _seen: list = field(default_factory=list, compare=False, repr=False)


def parse_spec(name: str, text: str) -> FaultSpec:
    """'2.5', '2.5@7', '2.5#2', '2.5@7:1' or '2.5:1' -> FaultSpec; a clear error otherwise."""
    try:
        seconds, step, nth, rank = split_spec(text)
        spec = FaultSpec(float(seconds), step, rank, nth)
    except ValueError:
        raise CheckpointError(f"{name}={text!r}: expected <seconds>[@<step>|#<n>][:<rank>] "
                              "(n >= 1), e.g. '2.0@5:1' or '2.0#2'") from None
    if spec.seconds < 0:
        raise CheckpointError(f"{name}={text!r}: seconds must be >= 0")
    return spec


def _read_env() -> Dict[str, FaultSpec]:
    specs = {}
    for key, value in os.environ.items():
        if key.startswith(ENV_PREFIX) and value:
            specs[key[len(ENV_PREFIX):].lower()] = parse_spec(key, value)
    return specs


def parse_fail(name: str, text: str) -> FailSpec:
    """'enospc', 'kill@3', 'kill#2', 'erofs@3:1' or 'error:0' -> FailSpec; a clear error
    otherwise."""
    try:
        kind, step, nth, rank = split_spec(text)
    except ValueError:
        raise CheckpointError(f"{name}={text!r}: expected <kind>[@<step>|#<n>][:<rank>] (n >= 1), "
                              "e.g. 'enospc@3:1'") from None
    if kind not in FAIL_KINDS:
        raise CheckpointError(f"{name}={text!r}: expected <kind>[@<step>|#<n>][:<rank>] with kind "
                              f"one of {', '.join(FAIL_KINDS)}, found {kind!r}")
    return FailSpec(kind, step, rank, nth)


def _read_fail_env() -> Dict[str, FailSpec]:
    specs = {}
    for key, value in os.environ.items():
        if key.startswith(FAIL_PREFIX) and value:
            step = key[len(FAIL_PREFIX):].lower()
            if step not in FAIL_STEPS:
                raise CheckpointError(f"{key}: unknown step {step!r}; expected one of "
                                      f"{', '.join(FAIL_STEPS)}")
            specs[step] = parse_fail(key, value)
    return specs


# Read once, at import: the engine's threads must not parse the environment per save.
_SPECS = _read_env()
_FAILS = _read_fail_env()
_PID = os.getpid()  # the rank's process: `kill` from a forked writer kills it too


def reload_from_env() -> None:
    """Re-read the environment (tests that set the variables after import)."""
    global _SPECS, _FAILS
    _SPECS = _read_env()
    _FAILS = _read_fail_env()


def fail_point(name: str, step: int, rank: int, path: Optional[str] = None) -> None:
    """Fail here if DATASTATES_FAULT_FAIL_<NAME> asks for it (see module doc); `path` is the
    file the failing operation would have touched (named in the OSError)."""
    if not _FAILS:
        return
    spec = _FAILS.get(name)
    if spec is None or not spec.matches(step, rank):
        return
    sys.stderr.write(f"DATASTATES_FAULT fail={name} kind={spec.kind} step={step} rank={rank}\n")
    sys.stderr.flush()
    if spec.kind == "kill":
        if os.getpid() != _PID:
            os.kill(_PID, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    if spec.kind == "error":
        raise RuntimeError(f"injected failure of step {name!r} (DATASTATES_FAULT_FAIL_"
                           f"{name.upper()})")
    code = _ERRNO[spec.kind]
    raise OSError(code, os.strerror(code), path)


def fault_point(phase: str, step: int, rank: int) -> None:
    """Pause here if DATASTATES_FAULT_DELAY_<PHASE> asks for it; otherwise return at once."""
    if not _SPECS:
        return
    spec = _SPECS.get(phase)
    if spec is None or not spec.matches(step, rank):
        return
    sys.stderr.write(f"DATASTATES_FAULT phase={phase} step={step} rank={rank} "
                     f"delay={spec.seconds:g}\n")
    sys.stderr.flush()
    time.sleep(spec.seconds)
