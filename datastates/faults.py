"""Fault points: environment-controlled pauses at the phases of a save, for crash tests.

A crash test needs to kill a job *inside* a given phase of a checkpoint, every time, not only when
a random kill happens to land there. Each phase calls `fault_point(phase, step, rank)` once per
save (never per byte). Without the environment variables below it returns at once; nothing else
in the engine depends on them.

    DATASTATES_FAULT_DELAY_<PHASE>="<seconds>[@<step>][:<rank>]"

pauses that phase for `seconds` (only at `step`, only on `rank`, when given) after printing one
line to stderr that a harness can wait for before it kills the process:

    DATASTATES_FAULT phase=<phase> step=<step> rank=<rank> delay=<seconds>

Phases (in the order a save goes through them):
  copy     engine copy thread, before the first tensor of the save is copied to the host cache
           (training blocks in wait_for_snapshot; nothing of this version is on disk yet)
  flush    engine writer, after every byte was written, before the shard's fsync and the rank's
           index and marker (the version has data but no marker)
  commit   trainer (rank 0), after every rank is durable and metadata.json is written, before
           COMMIT.json
  tracker  trainer (rank 0), after COMMIT.json, before latest_checkpointed_iteration.txt moves
  merge    universal-checkpoint merge process (started by rank 0 after a commit), after its
           first safetensors file, before its index, manifest and commit marker; its stderr goes
           to <universal root>/merge_logs/worker-K.log (K: the worker)

A pause of many seconds models a hung writer (see the drain timeout of the trainer).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Dict, Optional

from .errors import CheckpointError

ENV_PREFIX = "DATASTATES_FAULT_DELAY_"
PHASES = ("copy", "flush", "commit", "tracker", "merge")


@dataclass(frozen=True)
class FaultSpec:
    """A pause at one phase: `seconds`, optionally restricted to one step and one rank."""

    seconds: float
    step: Optional[int] = None
    rank: Optional[int] = None

    def matches(self, step: int, rank: int) -> bool:
        return (self.step is None or self.step == step) and (self.rank is None or self.rank == rank)


def parse_spec(name: str, text: str) -> FaultSpec:
    """'2.5', '2.5@7', '2.5@7:1' or '2.5:1' -> FaultSpec; a clear error otherwise."""
    seconds, step, rank = text, None, None
    if ":" in seconds:
        seconds, rank = seconds.rsplit(":", 1)
    if "@" in seconds:
        seconds, step = seconds.split("@", 1)
    try:
        spec = FaultSpec(float(seconds), None if step is None else int(step),
                         None if rank is None else int(rank))
    except ValueError:
        raise CheckpointError(f"{name}={text!r}: expected <seconds>[@<step>][:<rank>], e.g. "
                              "'2.0@5:1'") from None
    if spec.seconds < 0:
        raise CheckpointError(f"{name}={text!r}: seconds must be >= 0")
    return spec


def _read_env() -> Dict[str, FaultSpec]:
    specs = {}
    for key, value in os.environ.items():
        if key.startswith(ENV_PREFIX) and value:
            specs[key[len(ENV_PREFIX):].lower()] = parse_spec(key, value)
    return specs


# Read once, at import: the engine's threads must not parse the environment per save.
_SPECS = _read_env()


def reload_from_env() -> None:
    """Re-read the environment (tests that set the variables after import)."""
    global _SPECS
    _SPECS = _read_env()


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
