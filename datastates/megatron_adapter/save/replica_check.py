"""--ckpt-verify-replicas: silent data corruption caught before a version becomes the newest.

Data-parallel replicas of a tensor must be bit-identical: the model parameters on every
data-parallel rank (and, without the distributed optimizer, the optimizer state too). A GPU or host
that silently flips a bit in its copy trains on, and a checkpoint taken afterwards would save the
damage and become "latest". At a verified save every rank fingerprints each of its plain shards
(megatron-core ShardedTensors without a flattened range: a box of a global tensor), in pieces of
PIECE_BYTES, and the data-parallel group compares them once the version is durable, before it is
committed: a box that two or more ranks hold is by megatron-core's own definition one tensor's
replicas (one rank writes it, the others hold the same bytes). Boxes only one rank holds (e.g. the
distributed optimizer's flattened shards) are not compared.

Fingerprints: CRC-32C of each piece's bytes on the host (~18 GB/s per core, the GIL released), on a
background thread while the next forward/backward runs (parameters do not change before the next
optimizer step, which waits for it as it waits for the snapshot); on a GPU a device-side sum of the
piece's 32-bit words weighted by their position (any single flipped bit changes it), so no byte is
copied to the host for the check.

A disagreement names the tensor, its global offset, the byte range of the pieces that differ and
the ranks: with three or more replicas the minority (those whose fingerprint differs from the
majority's), with two both. The version is not committed (`ReplicaMismatch`, agreed on by every
rank); `--ckpt-failure-policy` decides whether training stops or goes on without it.
"""
from __future__ import annotations

import os
import sys
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ...errors import CheckpointError

__all__ = ["PIECE_BYTES", "ReplicaCheck", "ReplicaMismatch", "compare", "fingerprint",
           "flip_point"]

#: Bytes per fingerprint: the resolution of the byte range a disagreement names.
PIECE_BYTES = 4 << 20
#: DATASTATES_FAULT_FLIP_BIT="<key part or any>@<step>[:<rank>]" flips bit 0 of byte 0 of the
#: first plain shard whose key contains <key part> on <rank>, in the live tensor, at the save of
#: <step> (tests only: a silent corruption of one replica).
FLIP_ENV = "DATASTATES_FAULT_FLIP_BIT"

Box = Tuple[str, Tuple[int, ...], int]  # key, global offset, bytes


class ReplicaMismatch(CheckpointError):
    """Replicas of a tensor disagree: the version is refused (the same error on every rank)."""


def _weights(n: int, device) -> torch.Tensor:
    return torch.arange(1, n + 1, dtype=torch.int64, device=device) % 65521 + 1


def _device_pieces(flat: torch.Tensor) -> List[int]:
    """Position-weighted sums of the 32-bit words of each piece, computed where `flat` (uint8)
    lives; one transfer of the results."""
    pad = (-flat.numel()) % 4
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    words = flat.view(torch.int32)
    step = PIECE_BYTES // 4
    weights = _weights(min(step, max(words.numel(), 1)), words.device)
    sums = []
    for lo in range(0, max(words.numel(), 1), step):
        w = words[lo:lo + step].to(torch.int64)
        sums.append((w * weights[:w.numel()]).sum())
    return [int(x) for x in torch.stack(sums).cpu().tolist()]


def fingerprint(t: torch.Tensor, device_side: Optional[bool] = None) -> List[int]:
    """One fingerprint per PIECE_BYTES of `t`'s bytes (see module doc). `device_side` defaults
    to whether `t` is on a GPU."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if device_side if device_side is not None else flat.is_cuda:
        return _device_pieces(flat)
    from ...checksum import function
    from ...config import Checksum

    crc = function(Checksum.CRC32C)
    view = memoryview(flat.numpy()) if flat.numel() else memoryview(b"")
    return [crc(view[lo:lo + PIECE_BYTES]) for lo in range(0, max(len(view), 1), PIECE_BYTES)]


def flip_point(boxes: Sequence[Tuple[Box, torch.Tensor]], step: int, rank: int) -> Optional[str]:
    """The DATASTATES_FAULT_FLIP_BIT fault (module constant FLIP_ENV): flips one bit of the live
    tensor of the first matching box and returns its key; None when it does not apply."""
    spec = os.environ.get(FLIP_ENV)
    if not spec:
        return None
    from ...faults import split_spec

    what, at, nth, on = split_spec(spec)
    if nth is not None:
        raise CheckpointError(f"{FLIP_ENV}={spec!r}: expected <key>[@<step>][:<rank>] (no #<n>)")
    if (at is not None and at != step) or (on is not None and on != rank):
        return None
    for (key, _, nbytes), t in boxes:
        if nbytes and (what == "any" or what in key):
            with torch.no_grad():
                t.reshape(-1).view(torch.uint8)[:1].bitwise_xor_(1)
            sys.stderr.write(f"DATASTATES_FAULT flip_bit key={key} step={step} rank={rank}\n")
            sys.stderr.flush()
            return key
    return None


def collect(sharded_state_dict: Any) -> List[Tuple[Box, torch.Tensor]]:
    """This rank's plain shards (see module doc), in the state dict's order."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = []
    for leaf in nested_values(sharded_state_dict):
        if isinstance(leaf, ShardedTensor) and leaf.flattened_range is None and \
                isinstance(leaf.data, torch.Tensor):
            t = leaf.data
            out.append(((leaf.key, tuple(int(o) for o in leaf.global_offset),
                         t.numel() * t.element_size()), t))
    return out


class ReplicaCheck:
    """One verified save on one rank: its fingerprints, computed off the training thread (host
    tensors) or at once on the device (GPU tensors)."""

    def __init__(self, boxes: List[Tuple[Box, torch.Tensor]], executor: ThreadPoolExecutor):
        self.boxes = [b for b, _ in boxes]
        on_gpu = any(t.is_cuda for _, t in boxes)
        if on_gpu:  # device-side, on the current stream: nothing is copied to the host
            done: Future = Future()
            done.set_result([fingerprint(t) for _, t in boxes])
            self.future = done
        else:
            tensors = [t for _, t in boxes]
            self.future = executor.submit(lambda: [fingerprint(t) for t in tensors])

    def wait(self) -> None:
        """Before the next optimizer step: the tensors must not change while they are read."""
        self.future.result()

    def mine(self) -> Dict[Box, List[int]]:
        return dict(zip(self.boxes, self.future.result()))


def compare(by_rank: Dict[int, Dict[Box, List[int]]]) -> List[str]:
    """Every disagreement among the ranks' fingerprints (rank -> box -> pieces), one line each
    (see module doc)."""
    holders: Dict[Box, List[int]] = {}
    for rank in sorted(by_rank):
        for box in by_rank[rank]:
            holders.setdefault(box, []).append(rank)
    problems = []
    for box, ranks in holders.items():
        if len(ranks) < 2:
            continue
        prints = {r: tuple(by_rank[r][box]) for r in ranks}
        if len(set(prints.values())) == 1:
            continue
        key, offset, nbytes = box
        counts = Counter(prints.values())
        (top, n_top), = counts.most_common(1)
        majority = n_top * 2 > len(ranks) and list(counts.values()).count(n_top) == 1
        pieces = [i for i in range(max(len(p) for p in prints.values()))
                  if len({p[i] if i < len(p) else None for p in prints.values()}) > 1]
        lo, hi = pieces[0] * PIECE_BYTES, min((pieces[-1] + 1) * PIECE_BYTES, nbytes)
        where = f"{key} (global offset {list(offset)}, bytes {lo}-{hi} of {nbytes})"
        if majority:
            minority = [r for r in ranks if prints[r] != top]
            problems.append(f"replicas of {where} disagree: rank(s) {minority} differ from "
                            f"rank(s) {[r for r in ranks if prints[r] == top]} (the minority "
                            "is the likely corrupted copy)")
        else:
            problems.append(f"replicas of {where} disagree between rank(s) {ranks} (no majority "
                            "tells which copy is corrupted)")
    return problems


def gather_and_compare(check: Optional[ReplicaCheck], group) -> List[str]:
    """Every rank of the data-parallel `group` (gloo), collective: this group's disagreements."""
    import torch.distributed as dist

    mine = check.mine() if check is not None else {}
    everyone: List[Optional[Dict[Box, List[int]]]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (dist.get_rank(), mine), group=group)
    return compare({rank: prints for rank, prints in everyone})
