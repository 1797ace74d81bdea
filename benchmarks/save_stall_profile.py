"""Where the stall of one `--async-lazy-save` checkpoint goes, phase by phase.

    python benchmarks/save_stall_profile.py --config small --iters 12
    python benchmarks/save_stall_profile.py --config 117m --iters 4
    torchrun --nproc_per_node 2 benchmarks/save_stall_profile.py --config small --iters 10 \
        --extra "--non-persistent-ckpt-type in_memory --non-persistent-save-interval 1 \
                 --save-interval 100 --global-batch-size 8 --save DIR"

Trains the GPT of `checkpoint_compare.py` in this process (one rank, or each rank under torchrun,
which then needs a --save shared by the ranks in --extra; a checkpoint after every iteration)
with `time.perf_counter` spans wrapped around the functions a save goes through, and prints each
span's median inclusive time per call (ms) over the saves after the first (the first
builds caches). Spans nest: an indented line is part of the line above it. A save's dict and work
are part of its call, except a steady save's: the checkpointer's save worker makes them
during the next forward/backward (`datastates/megatron_adapter/save/offload.py`), and "wait
before step" includes the wait for it. "save call" and "wait before step" together are the
stall `checkpoint_compare.py` reports; "poll" (agreements, the
commit's collectives, retention) runs at the end of each iteration, outside that stall, and the
last line adds it: what each save costs the training thread. The commit marker and tracker are
written by rank 0's commit thread, whose spans are timed there, off the training loop. No change
to the code measured: the spans are installed by replacing module attributes before training
starts. Each rank also counts the control-plane collectives its training thread issues between
two save calls (one rank has none for the plan check: count on 2 ranks for what N ranks pay),
and the file-system calls it makes under the checkpoint roots (`tests/fs_calls.py`: created,
opened, listed, renamed or removed; on a shared file system each is a metadata round trip).
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))  # fs_calls

_TIMES: Dict[str, List[float]] = defaultdict(list)
_ORDER: List[str] = []
#: Control-plane collectives the training thread issued (see `count_collectives`).
_COLLECTIVES: List[str] = []
_AT_SAVE: List[int] = []  # len(_COLLECTIVES) when each save call started
_CACHES: list = []  # every `SaveStateCache` built (one per lazy checkpoint manager)
_RETENTION = {"training thread": 0, "other threads": 0}  # where retention ran (this rank)
_FILES: list = []  # the training thread's `fs_calls.Recorder` (set in `main`)
_FILES_AT_SAVE: List[int] = []  # len(its calls) when each save call started


def _wrap(owner, attr: str, label: str) -> None:
    fn = getattr(owner, attr)
    if label not in _ORDER:
        _ORDER.append(label)

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        if label == "save call":
            _AT_SAVE.append(len(_COLLECTIVES))
            if _FILES:
                _FILES_AT_SAVE.append(len(_FILES[0].calls))
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _TIMES[label].append(time.perf_counter() - t0)

    setattr(owner, attr, timed)


def install_spans() -> None:
    """The phases of a save, outermost first (labels are indented by nesting)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import state_dict_utils
    from megatron.core.dist_checkpointing.strategies import fully_parallel

    import datastates.engine as engine
    import datastates.megatron_adapter.save.checkpointer as checkpointer
    import datastates.megatron_adapter.save.payload as payload
    import datastates.megatron_adapter.save.preprocess as preprocess
    import datastates.megatron_adapter.save.strategies as strategies
    from megatron.training.checkpointing import distopt_shards, lazy as lazy_checkpointing

    mgr = lazy_checkpointing.LazyCheckpointManager
    spans = [
        (mgr, "_save", "save call"),
        (lazy_checkpointing, "save_values", "  RNG states and counters taken"),
        (checkpointer.LazyCheckpointer, "save_built", "  LazyCheckpointer.save_built"),
        (mgr, "_state_dict", "sharded state dict (trainer; steady saves: save worker)"),
        (lazy_checkpointing, "build_sharded_state_dict", "  megatron sharded_state_dict()"),
        (distopt_shards, "param_state_boxes", "  distributed-optimizer boxes"),
        (checkpointer.LazyCheckpointer, "_save",
         "the save's work (steady saves: on the save worker)"),
        (checkpointer.LazyCheckpointer, "_prepare_directory",
         "  version directory (rank 0; steady: its files thread)"),
        (checkpointer, "make_spare", "    spare files (2 per save)"),
        (checkpointer.LazyCheckpointer, "_before_save", "  commit to settle first (in memory)"),
        (preprocess, "split", "  preprocessing in one walk (split)"),
        (checkpointer.SavePlanCache, "prepare", "  plan check (fingerprint)"),
        (checkpointer.LazyCheckpointer, "_settled", "  commit settled (in memory)"),
        (checkpointer, "_megatron_save", "  the save: megatron's call, or without it"),
        (dist_checkpointing, "save", "    megatron dist_checkpointing.save"),
        (dist_checkpointing.serialization, "save_preprocess", "      megatron save_preprocess"),
        (state_dict_utils, "apply_factories", "        apply_factories"),
        (state_dict_utils, "extract_nonpersistent", "        extract_nonpersistent"),
        (state_dict_utils, "extract_sharded_base", "        extract_sharded_base"),
        (state_dict_utils, "filter_out_empty_flatten_tensor",
         "        filter_out_empty_flatten_tensor"),
        (state_dict_utils, "determine_global_metadata", "        determine_global_metadata"),
        (state_dict_utils, "validate_sharding_integrity", "        validate_sharding_integrity"),
        (strategies.DurableCommonSaveStrategy, "save_common", "      common.pt (torch.save)"),
        (fully_parallel.FullyParallelSaveStrategyWrapper, "async_save",
         "      fully-parallel wrapper async_save"),
        (strategies.DataStatesSaveStrategy, "async_save", "        DataStates async_save"),
        (payload.PayloadPlan, "flatten", "          payload (PayloadPlan.flatten)"),
        (payload, "engine_payload", "            engine_payload (plan built)"),
        (payload, "flatten_state", "            flatten_state (all / objects only)"),
        (engine.CheckpointEngine, "save", "          engine.save"),
        (engine, "flatten_state", "            flatten_state"),
        (engine, "plan_layout", "            plan_layout"),
        (engine.CheckpointEngine, "start_copies", "  engine.start_copies"),
        (engine.CheckpointEngine, "_withdraw",
         "engine files made (writer thread; in memory: the save's work)"),
        (engine.layout, "invalidate", "  layout.invalidate"),
        (mgr, "before_optimizer_step", "wait before step"),
        (mgr, "after_iteration", "poll (end of iteration)"),
        (checkpointer.LazyCheckpointer, "_agree", "  agreement (all-gather: durable, figures)"),
        (checkpointer.LazyCheckpointer, "_commit", "  commit (finalize, start commit thread)"),
        (checkpointer.LazyCheckpointer, "_settle", "  commit agreed (all-reduce)"),
        (checkpointer.LazyCheckpointer, "_publish", "commit thread (rank 0, off the loop)"),
        (checkpointer, "release_spare", "  metadata.json's spare released"),
        (strategies, "write_metadata", "  metadata.json written"),
        (checkpointer, "fsync_file", "  fsync metadata.json"),
        (checkpointer, "try_commit", "  commit marker"),
        (checkpointer, "write_tracker", "  tracker"),
        (mgr, "_after_commit", "  retention"),
    ]
    for owner, attr, label in spans:
        _wrap(owner, attr, label)


def track_retention() -> None:
    """Count where retention (the manager's `_after_commit`) runs: on the commit threads, off
    the training loop."""
    import threading

    from megatron.training.checkpointing import lazy as lazy_checkpointing

    mgr = lazy_checkpointing.LazyCheckpointManager
    fn = mgr._after_commit

    def counted(*args, **kwargs):
        main = threading.current_thread() is threading.main_thread()
        _RETENTION["training thread" if main else "other threads"] += 1
        return fn(*args, **kwargs)

    mgr._after_commit = counted


def track_state_caches() -> None:
    """Keep each lazy checkpoint manager's `SaveStateCache`, for its hits in the report."""
    from megatron.training.checkpointing import state_cache

    init = state_cache.SaveStateCache.__init__

    def tracked(self):
        init(self)
        _CACHES.append(self)

    state_cache.SaveStateCache.__init__ = tracked


def count_collectives() -> None:
    """Count the control plane's collectives (`datastates.control_plane`) issued by the main
    thread: at scale each is a round over every rank that the training loop waits for, however
    small its values (a peer replica's own thread and group are not counted)."""
    import threading

    from datastates import control_plane

    main = threading.main_thread()
    for name in ("all_reduce", "all_gather_ints", "barrier"):
        fn = getattr(control_plane, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            if threading.current_thread() is main:
                _COLLECTIVES.append(_name)
            return _fn(*args, **kwargs)

        setattr(control_plane, name, counted)


def install_cprofile(skip: int):
    """cProfile around save calls after the first `skip` (the trainer's dict and
    `LazyCheckpointer.save`: function-level detail inside the spans; it slows what it measures,
    so read its shares, not its times)."""
    import cProfile

    from megatron.training.checkpointing import lazy as lazy_checkpointing

    prof, calls = cProfile.Profile(), [0]
    fn = lazy_checkpointing.LazyCheckpointManager._save

    def profiled(*args, **kwargs):
        calls[0] += 1
        if calls[0] <= skip:
            return fn(*args, **kwargs)
        prof.enable()
        try:
            return fn(*args, **kwargs)
        finally:
            prof.disable()

    lazy_checkpointing.LazyCheckpointManager._save = profiled
    return prof


def report(skip: int, iters: int) -> None:
    print(f"\nper-call medians over calls after the first {skip} "
          f"(load average {os.getloadavg()[0]:.2f}):")
    print(f"{'phase':56s} {'ms':>8s} {'calls':>6s}")
    for label in _ORDER:
        xs = _TIMES.get(label, [])
        used = xs[skip:] if len(xs) > skip else xs
        if used:
            print(f"{label:56s} {statistics.median(used) * 1e3:8.2f} {len(xs):6d}")
    stall = [a + b for a, b in zip(_TIMES["save call"][skip:], _TIMES["wait before step"][skip:])]
    if stall:
        print(f"{'stall (save call + wait before step)':56s} "
              f"{statistics.median(stall) * 1e3:8.2f}")
    total = [a + b for a, b in zip(stall, _TIMES["poll (end of iteration)"][skip:])]
    if total:
        print(f"{'training thread per save (stall + poll)':56s} "
              f"{statistics.median(total) * 1e3:8.2f}")
    steady = [b - a for a, b in zip(_AT_SAVE[skip:], _AT_SAVE[skip + 1:])]
    if steady:
        names = _COLLECTIVES[_AT_SAVE[-2]:_AT_SAVE[-1]]
        print(f"{'control-plane collectives per iteration':56s} {statistics.median(steady):8g}"
              f"   (the last: {', '.join(names)})")
    print(f"control-plane collectives over {iters} iterations, start-up included: "
          f"{len(_COLLECTIVES)}")
    print(f"retention runs (training thread/other threads): {_RETENTION['training thread']}/"
          f"{_RETENTION['other threads']}")
    if _FILES and len(_FILES_AT_SAVE) > skip + 1:
        calls = _FILES[0].calls
        per = [b - a for a, b in zip(_FILES_AT_SAVE[skip:], _FILES_AT_SAVE[skip + 1:])]
        last = calls[_FILES_AT_SAVE[-2]:_FILES_AT_SAVE[-1]]
        print(f"{'file-system calls per iteration (training thread)':56s} "
              f"{statistics.median(per):8g}   (the last: "
              f"{', '.join(sorted({e for e, _ in last})) or 'none'})")
    for cache in _CACHES:  # what the saves' sharded state dicts took from the previous save's
        print(f"state kept between saves (reused/built): model {cache.model.reused}/"
              f"{cache.model.built}, optimizer {cache.optimizer.reused}/{cache.optimizer.built}")


def main(argv=None) -> int:
    import fs_calls
    from checkpoint_compare import COMMON, CONFIGS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="small")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--extra", default="", help="more trainer flags, space-separated")
    p.add_argument("--no-plan-cache", action="store_true",
                   help="rebuild and validate the plan on every save (the cost before cached "
                        "plans, for a same-machine comparison)")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also print the N functions with the most own time inside the save call "
                        "(PROFILE_SORT=cumtime: the most inclusive time)")
    a = p.parse_args(argv)
    from megatron.training import warning_filters

    warning_filters.install()
    import pretrain_gpt

    if a.no_plan_cache:
        from datastates.megatron_adapter.save import plan as save_plan

        save_plan.SavePlanCache.confirm = save_plan.SavePlanCache.forget
    prof = install_cprofile(skip=1) if a.cprofile else None
    install_spans()
    count_collectives()
    track_state_caches()
    track_retention()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with tempfile.TemporaryDirectory(dir=str(REPO / "runs") if (REPO / "runs").is_dir()
                                     else None) as save:
        args = (CONFIGS[a.config] + COMMON + ["--train-iters", str(a.iters), "--async-lazy-save",
                "--save", save, "--save-interval", "1", "--keep-last-n-checkpoints", "2"]
                + a.extra.split())
        # File-system calls under --save (also one given in --extra, which wins) and shared
        # memory (the in-memory level).
        roots = [v for k, v in zip(args, args[1:]) if k == "--save"] + ["/dev/shm"]
        with fs_calls.recording(*roots) as files:
            _FILES.append(files)
            rc = pretrain_gpt.main(args)
    report(skip=1, iters=a.iters)
    if prof is not None:
        import pstats

        pstats.Stats(prof).sort_stats(os.environ.get("PROFILE_SORT", "tottime")).print_stats(a.cprofile)
    return rc


if __name__ == "__main__":
    sys.exit(main())
