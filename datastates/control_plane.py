"""The control plane: the small collectives checkpointing issues, on a gloo group of all ranks.

Checkpointing agrees on a few integers per save (is every rank durable? did a rank fail? byte
counts and times for the report; is this candidate intact on every rank?) and meets at barriers.
These are CPU values. On a GPU run the default process group is NCCL, which accepts only CUDA
tensors, so they go through a gloo group of every rank instead, created once per default group:
no host-device copy or stream sync for a flag, and nothing queued behind training's NCCL kernels.
CPU runs (default group gloo) get their own group too, so the path CI runs is the GPU one.

`control_group()` is collective the first time it is called for a default group (it may create a
group): every rank calls it at the same point, e.g. right after `init_process_group`. Its
`timeout_s` bounds every collective on it: a rank that stops answering (hung storage, a stuck
thread) makes the others fail after that long instead of waiting forever.

`agree(fn, what)` is how a step that can fail on some ranks only is made safe: every rank runs
it, then one all-gather tells every rank whether any failed, and all raise the same
`CheckpointError` naming the failing ranks and their errors before anyone enters the next
collective (a rank that raised alone would leave the others waiting in it).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist

from .errors import CheckpointError

__all__ = ["agree", "agreed_failure", "all_gather_ints", "all_reduce", "barrier",
           "before_use", "control_group", "exchange", "new_side_group", "padded", "post_exchange"]

T = TypeVar("T")

# (the default group it was made for, the gloo group); holding the first keeps its id unique.
_CACHE: Optional[Tuple[object, object]] = None

#: Called, on the calling thread, before each use of the control group (`control_group()`): a
#: caller whose own work on the group is still in flight on another thread finishes it first
#: (`LazyCheckpointer`'s save worker), so the group's collectives are issued by one thread at a
#: time, in the same order on every rank.
_BEFORE_USE: List[Callable[[], None]] = []


def before_use(fn: Callable[[], None]) -> Callable[[], None]:
    """Register `fn` (see `_BEFORE_USE`); returns the call that unregisters it."""
    _BEFORE_USE.append(fn)
    return lambda: _BEFORE_USE.remove(fn) if fn in _BEFORE_USE else None


def control_group(timeout_s: Optional[float] = None):
    """The gloo group of all ranks for checkpoint collectives (see module doc). `timeout_s`
    bounds each of its collectives when this call creates it (None: torch's default)."""
    global _CACHE
    for fn in list(_BEFORE_USE):
        fn()
    if not dist.is_initialized():
        raise RuntimeError("the checkpoint control plane needs torch.distributed to be "
                           "initialized (init_process_group) first")
    world = dist.group.WORLD
    if _CACHE is None or _CACHE[0] is not world:
        kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        _CACHE = (world, dist.new_group(backend="gloo", **kwargs))
    return _CACHE[1]


def agree(fn: Callable[[], T], what: str,
          describe: Callable[[BaseException], Optional[str]] = str,
          undo: Optional[Callable[[T], None]] = None) -> T:
    """Every rank: run `fn` and return its result, unless it raised on any rank; then every rank
    raises the same `CheckpointError` ("`what` failed on rank(s) [...]: ...", each failing
    rank's error as `describe` words it, or `(text, ranks)` for an error about other ranks),
    after `undo(result)` where `fn` succeeded (e.g. closing what it opened). One all-gather of
    one integer when nothing failed.
    Exceptions outside `Exception` count too (PyTorch DCP's CheckpointException is a
    BaseException), but not KeyboardInterrupt and SystemExit."""
    err: Optional[BaseException] = None
    result = None
    try:
        result = fn()
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001 - agreed on and re-raised below, on every rank
        err = e
    failure = agreed_failure(err, what, describe)
    if failure is None:
        return result
    if err is None and undo is not None:
        undo(result)
    if isinstance(err, CheckpointError) and err.agreed and \
            failure.ranks == list(range(dist.get_world_size())):
        raise err  # every rank raised an error agreed on inside `fn` (a nested agreement)
    raise failure from err


def reason_of(err: BaseException) -> str:
    """A `describe` for `agree`: a CheckpointError's reason without its [rank, file] prefix (the
    agreed message names the ranks; the same words on several ranks are then listed once)."""
    return getattr(err, "reason", None) or str(err)


def agreed_failure(err: Optional[BaseException], what: str,
                   describe: Callable[[BaseException], Optional[str]] = str
                   ) -> Optional[CheckpointError]:
    """Every rank, with its own error or None: None when no rank failed, else the same
    `CheckpointError` on every rank, naming the failing ranks (`ranks`) and their errors (ranks
    with the same words are listed together). `describe` may return None for an error that only
    echoes another rank's (e.g. a collective that raises everywhere, with the details on one
    rank): such ranks are named only if no rank says more."""
    try:
        flags = all_gather_ints(int(err is not None))
        failed = [r for r, f in enumerate(flags) if f]
        if not failed:
            return None
        texts: List[Optional[str]] = [None] * dist.get_world_size()
        dist.all_gather_object(texts, None if err is None else describe(err),
                               group=control_group())
    except RuntimeError as lost:  # a rank died or stopped answering within the timeout
        return CheckpointError(
            f"{what}: not every rank reached the agreement ({lost}); a rank died or hangs"
            + (f"; this rank's own error: {describe(err) or err}" if err is not None else ""),
            rank=dist.get_rank())
    # A description may name the ranks it is about: (text, ranks), e.g. a coordinator reporting
    # the writes that failed on other ranks.
    named = sorted({n for r in failed if isinstance(texts[r], tuple) for n in texts[r][1]})
    told = [r for r in failed if texts[r] is not None]
    by_text: Dict[str, List[int]] = {}
    for r in told or failed:
        item = texts[r]
        text = item[0] if isinstance(item, tuple) else item
        by_text.setdefault(text or "see the other ranks' output", []).append(r)
    failed = sorted(set(named) | {r for r in told if not isinstance(texts[r], tuple)}) \
        or told or failed
    detail = "; ".join(text if len(by_text) == 1 else f"rank(s) {ranks}: {text}"
                       for text, ranks in by_text.items())
    return CheckpointError(f"{what} failed on rank(s) {failed}: {detail}", ranks=failed)


def all_reduce(values: Sequence[float], op=dist.ReduceOp.SUM,
               dtype: torch.dtype = torch.int64, group=None) -> List:
    """`values` reduced element-wise over every rank (CPU tensor on the control group, or on
    `group`, e.g. a `new_side_group`)."""
    t = torch.tensor(list(values), dtype=dtype)
    dist.all_reduce(t, op=op, group=group or control_group())
    return t.tolist()


def all_gather_ints(value, group=None) -> List:
    """Every rank's `value` (an int, or a sequence of ints of the same length on every rank),
    indexed by rank."""
    t = torch.tensor([int(value)] if isinstance(value, int) else [int(v) for v in value],
                     dtype=torch.int64)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t, group=group or control_group())
    return [int(x.item()) if isinstance(value, int) else x.tolist() for x in out]


def padded(values: Sequence[int], width: int, fill: int = -1) -> List[int]:
    """`values` filled up to `width` with `fill`: a row of the same length on every rank for
    `all_gather_ints`, when ranks have different numbers of things to report. More than `width`
    is a bug of the caller (the rows would no longer line up): ValueError."""
    if len(values) > width:
        raise ValueError(f"{len(values)} values do not fit a row of {width}")
    return list(values) + [fill] * (width - len(values))


def new_side_group():
    """A second gloo group of all ranks, for one background thread of every rank (its collectives
    then never interleave with the control group's). Collective: every rank, same point."""
    control_group()
    return dist.new_group(backend="gloo")


def exchange(sends: Dict[Tuple[int, int], torch.Tensor],
             recvs: Dict[Tuple[int, int], torch.Tensor], group=None) -> None:
    """Point to point, all at once: each tensor of `sends`, keyed (destination rank, tag), goes
    to its rank and each buffer of `recvs`, keyed (source rank, tag), is filled from its rank
    (CPU tensors; ranks of the default group, which every group made here spans). Posting every
    operation before waiting on any never deadlocks on order."""
    for w in post_exchange(sends, recvs, group):
        w.wait()


def post_exchange(sends: Dict[Tuple[int, int], torch.Tensor],
                  recvs: Dict[Tuple[int, int], torch.Tensor], group=None) -> List:
    """`exchange` without the wait: the posted operations' works, to wait on later (the caller
    keeps the tensors alive and unchanged until then)."""
    group = group or control_group()
    works = [dist.isend(t, dst, group=group, tag=tag) for (dst, tag), t in sends.items()]
    works += [dist.irecv(t, src, group=group, tag=tag) for (src, tag), t in recvs.items()]
    return works


def barrier() -> None:
    dist.barrier(group=control_group())
