"""Resume from ``--load``: find the newest complete checkpoint, check it fits, restore it.

Format is detected from the directory (torch_dist writes ``metadata.json``; torch writes
``mp_rank_*``), so a run may save in one format and resume from the other.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Callable, Optional, Tuple

# Importing datastates registers its dist_checkpointing load strategy, so megatron-core reads
# --async-lazy-save checkpoints (metadata.json names the "datastates" backend) like any other.
import torch
import torch.distributed as dist

import datastates
from datastates import control_plane
from datastates.fileio import safe_join, spare_path
from datastates.megatron_adapter import AgreedLoadStrategy, adopt_left_memory, \
    assemble_memory_for_layout, is_assembled_memory, load_strategies, memory_holds_other_ranks, \
    newest_on_every_node, node_index, paths, restore_memory_from_peers
from datastates.safe_load import UnsafePickleError
from datastates.universal import is_universal

from megatron.training.checkpointing import distopt_shards, upstream_compat
from megatron.training.checkpointing.contents import (
    CheckpointError,
    RngLayout,
    TrainState,
    apply_loaded_state_dict,
    build_sharded_state_dict,
    check_model_shape,
    init_distributed_optimizer_state,
    model_shape,
    model_shape_of,
    parallel_layout,
    rng_layout_of,
    safe_torch_load,
    saved_run_config,
    torch_rank_dir,
)
from megatron.training.checkpointing.manager import non_persistent_root_of_this_rank
from megatron.training.checkpointing.verify import damage_hint, newest_intact
from megatron.training.config import LENIENT_STRICTNESS, STRICTNESS, CkptFormat, RunConfig
from megatron.training.checkpointing.from_universal import load_universal
from megatron.training.checkpointing.lazy import local_dir_of_this_rank, restore_peer_copies
from megatron.training.log import print_rank_0, say
from megatron.training.metrics import Metrics
from megatron.training.timers import count_loaded, loaded_bytes, report_times_across_ranks


def _saved_config(directory: str, kind: paths.Format, allow_unsafe_pickle: bool,
                  also: Optional[str] = None) -> str:
    """`saved_run_config`, with what to do about a damaged or forged common state (`also`: see
    `damage_hint`)."""
    try:
        return saved_run_config(directory, kind, allow_unsafe_pickle)
    except UnsafePickleError as err:
        # Forged, or written by code we do not trust: an older checkpoint may still be good.
        raise UnsafePickleError(err.args[0] + _hint(directory, also)) from None
    except CheckpointError:
        raise
    except datastates.CheckpointError as err:
        raise CheckpointError(f"cannot read common.pt (the checkpoint's common state): "
                              f"{err.reason}" + _hint(directory, also),
                              path=err.file or directory) from err


def _load_distrib_optim(optimizer, path: str, allow_unsafe_pickle: bool) -> None:
    """megatron's `load_parameter_state` without its bare `torch.load`: data-parallel rank 0 of
    each optimizer reads the file safely and scatters it (`load_parameter_state_from_dp_zero`)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False):
            continue
        state_dict = None
        if opt.data_parallel_group.rank() == 0:
            state_dict = count_loaded(safe_torch_load(path, allow_unsafe_pickle))
        opt.load_parameter_state_from_dp_zero(state_dict)


def load_checkpoint(state: TrainState, config: RunConfig,
                    loader: Optional[Callable[[dict, str], dict]] = None) -> bool:
    """Restore ``state`` from ``config.checkpoint.load`` (with its non-persistent levels), else
    fine-tune from ``--pretrained-checkpoint`` when given; False when there is nothing to load.

    ``loader(sharded_state_dict, directory) -> state_dict`` replaces megatron-core's
    ``dist_checkpointing.load`` for a custom strategy (torch_dist layout assumed).
    """
    ckpt = config.checkpoint
    if ckpt.pretrained_checkpoint is None:
        return _load(state, config, loader)
    # Megatron-LM's rule: --load first, the pretrained checkpoint only where it holds none. A
    # --ckpt-step is --load's while --load has a tracker (a rollback of the fine-tuning), else
    # the pretrained checkpoint's (which of its iterations to start from).
    resumable = ckpt.ckpt_step is None or (
        ckpt.load is not None and os.path.isfile(os.path.join(ckpt.load, paths.TRACKER_FILENAME)))
    if resumable and _load(state, config, loader):
        return True
    if not resumable:
        print_rank_0(f"--ckpt-step {ckpt.ckpt_step}: --load {ckpt.load} has no "
                     f"{paths.TRACKER_FILENAME}: fine-tuning from iteration {ckpt.ckpt_step} of "
                     f"--pretrained-checkpoint {ckpt.pretrained_checkpoint}")
    return _load(state, pretrained_config(config), loader, pretrained=True)


def pretrained_config(config: RunConfig) -> RunConfig:
    """`config` reading --pretrained-checkpoint as --finetune would read --load: the weights
    only, from that directory alone (the non-persistent levels, --lazy-save-local-dir copies and
    peer replicas hold versions of --save, not of it)."""
    ckpt = config.checkpoint
    return dataclasses.replace(config, checkpoint=dataclasses.replace(
        ckpt, load=ckpt.pretrained_checkpoint, finetune=True, non_persistent_ckpt_type=None,
        lazy_save_local_dir=None, lazy_save_peer_replica=False))


def _load(state: TrainState, config: RunConfig, loader: Optional[Callable[[dict, str], dict]],
          pretrained: bool = False) -> bool:
    """`load_checkpoint` from ``config.checkpoint.load`` and its levels (`pretrained`: the
    `pretrained_config` pass, after --load held nothing)."""
    ckpt = config.checkpoint
    root = resume_root(config) if ckpt.ckpt_step is None else _step_root(config)
    if root is None:
        return False
    # Every rank reads the same tracker and finds the same mistake (a missing --ckpt-step, a
    # damaged tracker, --exit-on-missing-checkpoint): agreed on, one line.
    found = control_plane.agree(lambda: _find(config, root, pretrained), f"loading {root}",
                                describe=_words)
    if found is None:
        return False
    if found == _UNIVERSAL:  # --load names a universal checkpoint
        _load_universal(state, config, root)
        state.loaded = root
        return True
    iteration, directory = found
    release = directory is not None  # Megatron-LM's released weights: iteration 0, no optimizer
    if not release:
        if ckpt.ckpt_fallback_to_previous:  # universal roots too: their checksums are verified
            chosen, iteration = _newest_intact(root, iteration, config)
            if chosen != root and is_assembled_memory(root):
                _drop_assembled(root)
            root = chosen
        directory = paths.checkpoint_dir(root, iteration)
    also = ckpt.load if ckpt.load and root != ckpt.load else None  # for the damage hints
    # Every rank reads the same files and finds the same mistake (another model, a missing
    # directory, a forged common state): agreed on before the first collective, one line.
    plan = control_plane.agree(lambda: _inspect(state, config, directory, release, also),
                               f"loading {directory}", describe=_words)
    state.loaded = directory
    if plan is None:  # e.g. --load <save>/universal
        _load_universal(state, config, directory)
        return True
    kind, fmt, unsafe = plan.kind, plan.fmt, ckpt.allow_unsafe_pickle
    load_optim, load_rng, megatron_lm = plan.load_optim, plan.load_rng, plan.megatron_lm
    strictness, own_boxes = plan.strictness, plan.own_boxes
    node_local = root != ckpt.load and ckpt.non_persistent_node_local
    if load_optim and config.parallel.use_distributed_optimizer and not (
            own_boxes and distopt_shards.allocate_state(state.optimizer)):
        init_distributed_optimizer_state(state.optimizer)
    if fmt is CkptFormat.TORCH_DIST:
        sd = build_sharded_state_dict(state, config, is_loading=True,
                                      include_optim=load_optim and not own_boxes,
                                      include_rng=load_rng, rng_layout=plan.rng_layout,
                                      optimizer_metadata=plan.optimizer_metadata)
        if own_boxes:
            sd[_OWN_BOXES] = distopt_shards.param_state_sharded_tensors(state.optimizer, sd)
            views = [sh.data for sh in sd[_OWN_BOXES]]
            pointers = distopt_shards.state_pointers(state.optimizer)
        # A node-local version is read from this node's directory alone; the peer replicas and
        # --lazy-save-local-dir copies are of --save's versions. An in-memory version assembled
        # for this layout first receives the shard files its node's ranks read and lack.
        assembled = node_local and is_assembled_memory(root)
        peers = (restore_peer_copies(config, directory, sd, assembled=True) if assembled
                 else None if node_local else restore_peer_copies(config, directory, sd))
        loaded, lacking = _load_torch_dist(sd, directory, loader, unsafe,
                                           None if node_local else local_dir_of_this_rank(config),
                                           ckpt.ckpt_fully_parallel_load,
                                           on_read=None if peers is None else peers.report,
                                           also=also, strict=strictness)
        if strictness in LENIENT_STRICTNESS:
            _report_mismatch(strictness, lacking, load_optim, load_rng, directory)
        if assembled:  # read by every rank: its copies leave memory
            control_plane.barrier()
            _drop_assembled(root)
        if megatron_lm is not None:
            loaded = upstream_compat.normalize_loaded(loaded, directory)
    else:
        loaded = control_plane.agree(lambda: safe_torch_load(  # each rank reads its own file
            os.path.join(torch_rank_dir(directory), paths.TORCH_FILENAME), unsafe),
            f"loading {directory}", describe=_words)
        lacking = ((), ())
    count_loaded(loaded)
    if own_boxes:  # param groups, step, scaler here; the parameter state is in place already
        with torch.no_grad():  # except where the reader could not read in place (GPU tensors)
            for view, got in zip(views, loaded.pop(_OWN_BOXES)):
                if got is not view:
                    view.copy_(got)
        for key in ("param_state", "param_state_sharding_type"):
            loaded["optimizer"].pop(key, None)
    # Agreed on: a refusal (another schedule, a model that does not fit) is one line, not one
    # per rank, and a rank whose part fails stops every rank before the next collective.
    note = control_plane.agree(lambda: apply_loaded_state_dict(
        state, loaded, load_optim=load_optim, load_rng=load_rng, finetune=ckpt.finetune,
        schedule=config.optimizer.scheduler_on_resume, path=directory, allow_unsafe_pickle=unsafe,
        partial=bool(lacking[0])), f"loading {directory}",
        describe=control_plane.reason_of)
    if own_boxes and distopt_shards.state_pointers(state.optimizer) != pointers:
        raise CheckpointError("megatron-core's DistributedOptimizer.load_state_dict replaced the "
                              "optimizer's state tensors that the load read into; this version "
                              "of megatron-core is not supported by the in-place load",
                              path=directory)
    if release:
        state.iteration = 0
    if note:
        print_rank_0(note)
    if fmt is CkptFormat.TORCH and load_optim and config.parallel.use_distributed_optimizer:
        # After load_state_dict (param groups, step), as Megatron does: the sharded Adam state.
        _load_distrib_optim(state.optimizer, os.path.join(torch_rank_dir(directory),
                                                          paths.DISTRIB_OPTIM_FILENAME), unsafe)
    origin = "" if megatron_lm is None else ", written by Megatron-LM"
    print_rank_0(f"loaded checkpoint {directory} (format {kind.value}{origin}, "
                 f"iteration {iteration}; "
                 f"optimizer {'restored' if load_optim else 'not restored'}, rng "
                 f"{'restored' if load_rng else 'not restored'})")
    return True


def timed_load_checkpoint(state: TrainState, config: RunConfig,
                          metrics: Optional[Metrics] = None) -> bool:
    """`load_checkpoint`, then (after a resume) Megatron's `load-checkpoint` timers report and one
    line with the tensor bytes the ranks read into their state (summed; `timers.count_loaded`),
    the slowest rank's time and their ratio."""
    start, read_before = time.perf_counter(), loaded_bytes()
    loaded = load_checkpoint(state, config)
    seconds = time.perf_counter() - start
    if not loaded:
        return False
    slowest = report_times_across_ranks("load-checkpoint", seconds)
    metrics = metrics or Metrics.off(config)
    metrics.timer("load-checkpoint", slowest, state.iteration)
    (nbytes,) = control_plane.all_reduce([loaded_bytes() - read_before])
    print_rank_0(f" checkpoint load | iteration {state.iteration:8d} | bytes read: {nbytes} | "
                 f"time (s): {slowest:.3f} | throughput (GB/s): "
                 f"{nbytes / slowest / 1e9 if slowest > 0 else 0.0:.3f}")
    metrics.load(state.iteration, slowest, nbytes)
    return True


def resume_root(config: RunConfig) -> Optional[str]:
    """--load, or the non-persistent root when its tracker names an iteration at least as new as
    --load's, as Megatron-LM decides; None: no root. Every rank (collective for the local type,
    whose root is this rank's node's, taken only when every node holds the same version)."""
    ckpt = config.checkpoint
    non_persistent = non_persistent_root_of_this_rank(config, ckpt.load, saving=False)
    if non_persistent and ckpt.non_persistent_node_local:
        level = _LEVEL_NAMES[ckpt.non_persistent_ckpt_type]
        in_memory = ckpt.non_persistent_ckpt_type == "in_memory"
        if in_memory:
            _adopt_left_memory(non_persistent)
        if in_memory and ckpt.async_lazy_save and ckpt.lazy_save_peer_replica:
            _restore_memory_from_peers(non_persistent)
        why, other_layout = _foreign_reason(non_persistent, config)
        if in_memory and why is None and memory_holds_other_ranks(
                non_persistent, dist.get_rank(), dist.get_world_size()):
            other_layout = True  # saved under another node index: assembled as at a new layout
        assembled = (_memory_at_this_layout(non_persistent, why, other_layout)
                     if in_memory else None)
        if assembled is not None:  # the same on every rank
            non_persistent, newer = assembled, paths.tracked_iteration(assembled)
        else:
            if why is not None:
                print_rank_0(f"not loading the {level} checkpoint in {non_persistent}: {why}")
            newer, lacking = newest_on_every_node(non_persistent, dist.get_rank(),
                                                  accept=lambda root: why is None)
            if lacking and len(lacking) < dist.get_world_size():
                print_rank_0(f"{level} checkpoints: rank(s) {lacking} do not hold the newest one "
                             "on their node (or hold it for another model or parallel layout): "
                             "not loading them")
    else:
        newer = paths.tracked_iteration(non_persistent) if non_persistent else None
    if newer is None:
        return ckpt.load
    persistent = paths.tracked_iteration(ckpt.load) if ckpt.load else None
    level = _LEVEL_NAMES.get(ckpt.non_persistent_ckpt_type, "non-persistent")
    if persistent is not None and newer < persistent:
        print_rank_0(f"{level} checkpoint (iteration {newer} in {non_persistent}) is older "
                     f"than the persistent one (iteration {persistent}): loading {ckpt.load}")
        if is_assembled_memory(non_persistent):
            _drop_assembled(non_persistent)
        return ckpt.load
    print_rank_0(f"loading the {level} checkpoint of iteration {newer} from "
                 f"{non_persistent} (" + ("no complete persistent checkpoint" if persistent is None
                                          else f"persistent: iteration {persistent}") + ")")
    return non_persistent


#: `_find`: the root is a universal checkpoint.
_UNIVERSAL = "universal"


def _find(config: RunConfig, root: str, pretrained: bool):
    """Every rank, no collective: what `root` holds to resume from: None for nothing (rank 0
    said why) or the refusal, `_UNIVERSAL`, or (iteration, the release directory or None)."""
    ckpt = config.checkpoint
    if not os.path.isdir(root):
        if ckpt.ckpt_step is not None:
            raise CheckpointError(f"--ckpt-step {ckpt.ckpt_step}: the --load directory does not "
                                  "exist", path=root)
        # Megatron-LM's behaviour: nothing to load is a warning, not an error.
        flag = "--pretrained-checkpoint" if pretrained else "--load"
        _nothing_to_load(config, f"{flag} directory {root} does not exist: no checkpoint to "
                                 "load", root, warn=True, pretrained=pretrained)
        return None
    if is_universal(root):
        return _UNIVERSAL
    if ckpt.ckpt_step is not None:
        return _complete_step(root, ckpt.ckpt_step), None
    if not os.path.isfile(os.path.join(root, paths.TRACKER_FILENAME)):
        # Megatron-LM's behaviour, which makes `--save D --load D` restartable from scratch.
        _nothing_to_load(config, f"no {paths.TRACKER_FILENAME} in {root}: no complete "
                                 "checkpoint there yet", root, pretrained=pretrained)
        return None
    if paths.tracker_names_release(root):
        return 0, safe_join(root, paths.RELEASE_DIRNAME, what=paths.TRACKER_FILENAME)
    return _read_tracker(root), None


def _nothing_to_load(config: RunConfig, why: str, root: str, warn: bool = False,
                     pretrained: bool = False) -> bool:
    """--load names nothing to resume: training starts from scratch, as in Megatron-LM, unless
    --exit-on-missing-checkpoint (then the error says why, and the job exits 2 where
    Megatron-LM's exits 0: a scheduler sees it fail). With --pretrained-checkpoint, the run
    fine-tunes from it instead; when that holds nothing either, the error says so. A conversion
    (--ckpt-convert-format) with nothing to convert is an error too, as in Megatron-LM."""
    ckpt = config.checkpoint
    if pretrained:
        raise CheckpointError(f"{why}, and --load holds no checkpoint to resume either",
                              path=root)
    if ckpt.pretrained_checkpoint is not None:
        print_rank_0(f"{why}: fine-tuning from --pretrained-checkpoint "
                     f"{ckpt.pretrained_checkpoint}")
        return False
    if ckpt.ckpt_convert_format is not None:
        raise CheckpointError(f"{why}: nothing to convert (--ckpt-convert-format)", path=root)
    if ckpt.exit_on_missing_checkpoint:
        raise CheckpointError(f"{why}; not starting from scratch (--exit-on-missing-checkpoint)",
                              path=root)
    print_rank_0(("WARNING: " if warn else "") + why + ", starting from scratch")
    return False


def _step_root(config: RunConfig) -> str:
    """--ckpt-step: --load, whatever the non-persistent level holds (it is not read: its versions
    are newer, or of another run; a node-local level's newer ones are removed at the start of
    training, `LazyCheckpointManager.begin_training`)."""
    ckpt = config.checkpoint
    if ckpt.non_persistent_ckpt_type is not None:
        level = _LEVEL_NAMES.get(ckpt.non_persistent_ckpt_type, "non-persistent")
        print_rank_0(f"--ckpt-step {ckpt.ckpt_step}: loading iteration {ckpt.ckpt_step} of "
                     f"{ckpt.load}; the {level} checkpoints are not read")
    return ckpt.load


def _complete_step(root: str, step: int) -> int:
    """--ckpt-step `step`, once its directory under `root` is a complete checkpoint."""
    directory = paths.checkpoint_dir(root, step)
    complete, _ = paths.existing_iterations(root)
    if step not in complete:
        state = "is missing" if not os.path.isdir(directory) else \
            "is not a complete checkpoint (an unfinished save's leftovers)"
        raise CheckpointError(f"--ckpt-step {step}: {directory} {state}; the complete "
                              f"checkpoints under {root} are at iterations {complete or 'none'}",
                              path=root)
    return step


def _log(line: str) -> None:
    """A line of a level's restore, from every rank that has one (they name their rank)."""
    say(line)


def _adopt_left_memory(root: str) -> None:
    """Every rank (collective): a node whose in-memory directory is missing takes over the one
    its host holds under another node's index (`datastates.megatron_adapter.levels.in_memory`);
    a failure is agreed on and only warned about."""
    try:
        adopt_left_memory(root, dist.get_rank(), node_index(), log=_log)
    except datastates.CheckpointError as err:
        print_rank_0(f"WARNING: the in-memory checkpoints left on a host under another node's "
                     f"index were not taken over: {err}")


def _restore_memory_from_peers(root: str) -> None:
    """--lazy-save-peer-replica with the in-memory level, every rank (collective): a node that
    lost its memory gets its ranks' newest in-memory version back from the next node's replica
    (`datastates.megatron_adapter.levels.in_memory_peers`). A failure is agreed on by every rank
    and only warned about: the levels are then read as they are."""
    try:
        restore_memory_from_peers(root, dist.get_world_size(), dist.get_rank(), log=_log)
    except datastates.CheckpointError as err:
        print_rank_0(f"WARNING: the in-memory checkpoints were not restored from peer replicas: "
                     f"{err}")


#: How a resume names the level of the non-persistent checkpoint it takes or skips.
_LEVEL_NAMES = {"global": "non-persistent", "local": "non-persistent", "in_memory": "in-memory"}


def _drop_assembled(root: str) -> None:
    """An in-memory version assembled for this layout, once nothing reads it, leaves memory (by
    one rank per node; the node's own versions stay where they were)."""
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        shutil.rmtree(root, ignore_errors=True)


def _foreign_reason(root: str, config: RunConfig) -> Tuple[Optional[str], bool]:
    """(why the node-local versions under `root` (this rank's node's) are not this job's to load
    as they are, or None: none there, or saved by a run of this model at this parallel layout;
    whether the only reason is the layout). Each rank reads its own files of a node-local
    version, so it loads as it is only at its layout. Another --save's memory is in another root
    altogether (`config.shared_memory_dir`)."""
    if paths.tracked_iteration(root) is None:
        return None, False
    load = config.checkpoint.load
    tracker = os.path.join(load, paths.TRACKER_FILENAME) if load else None
    if tracker and not (os.path.exists(tracker) or os.path.exists(spare_path(tracker))):
        # The run that saved these versions prepared --load at its start (`paths.prepare_root`:
        # the tracker's spare, then the tracker); neither there: --load was removed or made anew
        # since (`rm -rf` to start over), and its memory is an older run's, not this one's.
        return (f"{load} holds no trace of the run that saved it (neither its "
                f"{paths.TRACKER_FILENAME} nor the spare made at its start): {load} was removed "
                "or made anew since"), False
    try:
        with open(os.path.join(root, paths.RUN_CONFIG_FILENAME)) as f:
            saved = json.load(f)
        layout = _layout_of(saved)
        shape = model_shape_of(saved)
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"its {paths.RUN_CONFIG_FILENAME} is missing or unreadable ({err})", False
    ours = model_shape(config)
    differ = sorted(k for k, v in ours.items() if shape.get(k) != v)
    if differ:
        return "saved by another model (" + ", ".join(
            f"{k}: {shape.get(k)} there, {ours[k]} here" for k in differ) + ")", False
    if layout != parallel_layout(config):
        return f"saved at parallel layout {layout}, this run is {parallel_layout(config)}", True
    return None, False


def _memory_at_this_layout(root: str, why: Optional[str], other_layout: bool) -> Optional[str]:
    """Every rank (collective): where some node holds the in-memory level's versions of this
    model at another parallel layout and none holds anything else foreign, their newest version
    the nodes hold whole, assembled on every node for this run's layout
    (`datastates.megatron_adapter.levels.in_memory_relayout`); None otherwise, or when that
    failed on any rank (agreed, and warned about: the levels are then read as they are)."""
    codes = control_plane.all_gather_ints(1 if other_layout else 2 if why is not None else 0)
    if 1 not in codes or 2 in codes:
        return None

    try:
        return assemble_memory_for_layout(root, dist.get_rank(), log=_log)
    except datastates.CheckpointError as err:
        print_rank_0(f"WARNING: the in-memory checkpoint was not assembled for this run's "
                     f"layout: {err}")
        return None


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a torch_dist, torch or DataStates checkpoint holds and what this run restores of it,
    decided from its files alone."""
    kind: paths.Format
    fmt: CkptFormat
    strictness: str
    load_optim: bool
    load_rng: bool
    megatron_lm: Optional[dict]  # the common state, when Megatron-LM wrote the checkpoint
    rng_layout: RngLayout
    optimizer_metadata: Optional[dict]
    own_boxes: bool  # each rank reads its distributed-optimizer ranges in place


def _inspect(state: TrainState, config: RunConfig, directory: str, release: bool,
             also: Optional[str]) -> Optional[_Plan]:
    """Every rank, no collective: the `_Plan` for loading `directory`, None for a universal
    checkpoint, or the refusal (the same on every rank)."""
    ckpt = config.checkpoint
    if not os.path.isdir(directory):
        raise CheckpointError(f"tracker names {os.path.basename(directory)} but {directory} is "
                              "missing" + _hint(directory, also), path=os.path.dirname(directory))
    if is_universal(directory):
        return None
    # DataStates checkpoints load through dist_checkpointing like torch_dist ones.
    kind = paths.detect_format(directory)
    fmt = CkptFormat.TORCH if kind is paths.Format.TORCH else CkptFormat.TORCH_DIST
    unsafe = ckpt.allow_unsafe_pickle
    saved_json = _saved_config(directory, kind, unsafe, also)
    strictness = ckpt.dist_ckpt_strictness if fmt is CkptFormat.TORCH_DIST else STRICTNESS[0]
    bridged = check_model_shape(saved_json, config, directory,
                                tensor_set_may_differ=strictness in LENIENT_STRICTNESS)
    if bridged:
        print_rank_0(f"--dist-ckpt-strictness {strictness}: the checkpoint's model differs in "
                     f"tensors it holds ({'; '.join(bridged)}); the tensors both have are loaded")
    saved = json.loads(saved_json)
    saved_layout = _layout_of(saved)
    run_layout = parallel_layout(config)
    same_layout = saved_layout == run_layout
    load_optim = (ckpt.load_optim and not ckpt.finetune and not release
                  and saved["checkpoint"]["save_optim"])
    load_rng = (ckpt.load_rng and not ckpt.finetune and not release
                and saved["checkpoint"]["save_rng"])
    # torch files were read by saved_run_config, which requires ours
    common = None if kind is paths.Format.TORCH else paths.saved_common(directory, unsafe)
    megatron_lm = common if common is not None and upstream_compat.is_upstream(common) else None
    rng_layout = (RngLayout.MEGATRON_LM if megatron_lm is not None else
                  rng_layout_of(common) if common is not None else RngLayout.PER_RANK)
    # Ours is per rank; Megatron-LM's per (PP, TP) rank, restored on every DP rank as it does.
    rng_fits = same_layout if megatron_lm is None else _same_tp_pp(saved_layout, run_layout)
    if load_rng and not rng_fits:
        print_rank_0(f"checkpoint layout {saved_layout} differs from this run's {run_layout}: "
                     "RNG states are per rank and are not restored")
        load_rng = False
    if fmt is CkptFormat.TORCH and not same_layout:
        raise CheckpointError(f"torch-format checkpoint saved at layout {saved_layout} cannot be "
                              f"loaded at {run_layout}; use --ckpt-format torch_dist to "
                              "change TP/PP/DP", path=directory)
    distributed = config.parallel.use_distributed_optimizer
    if load_optim and distributed != saved["parallel"]["use_distributed_optimizer"]:
        raise CheckpointError("optimizer state was saved with use_distributed_optimizer="
                              f"{saved['parallel']['use_distributed_optimizer']}; load it with the "
                              "same setting or pass --no-load-optim", path=directory)
    optimizer_metadata = None
    if megatron_lm is not None and load_optim and distributed:
        optimizer_metadata = _megatron_lm_optimizer_metadata(megatron_lm, saved_layout,
                                                             run_layout, directory)
    # Ours, with the distributed optimizer: each rank reads its own ranges of the optimizer's
    # state straight into the optimizer, at any layout (distopt_shards), instead of megatron's
    # whole-model buffers on every rank. A node-local version holds only its node's ranks'
    # pieces of that state, which are exactly those ranges at its own layout.
    own_boxes = (load_optim and distributed and kind is paths.Format.DATASTATES
                 and _fully_reshardable(common) and distopt_shards.supported(state.optimizer))
    return _Plan(kind, fmt, strictness, load_optim, load_rng, megatron_lm, rng_layout,
                 optimizer_metadata, own_boxes)


def _newest_intact(root: str, iteration: int, config: RunConfig):
    """--ckpt-fallback-to-previous: (root, iteration) of the newest version intact on every rank,
    from `root` (tracked: `iteration`) and, when `root` is a non-persistent level's, from --load
    too: newest first over both, the level's first on equal iterations."""
    ckpt = config.checkpoint
    levels = [(root, iteration)]
    persistent = paths.tracked_iteration(ckpt.load) if ckpt.load and root != ckpt.load else None
    if persistent is not None:
        levels.append((ckpt.load, persistent))
    return newest_intact(levels, config)


def _read_tracker(root: str) -> int:
    try:
        return paths.read_tracker(root)
    except CheckpointError:
        raise
    except datastates.CheckpointError as err:
        raise CheckpointError(err.reason, path=err.file) from err


def _load_universal(state: TrainState, config: RunConfig, directory: str) -> None:
    load_universal(state, config, directory, damage_hint=lambda: _universal_hint(directory))


def _universal_hint(directory: str) -> str:
    """`damage_hint` for an iteration of a universal root (nothing for a lone directory)."""
    try:
        root, iteration = _split(directory)
    except datastates.CheckpointError:
        return ""
    if not os.path.isfile(os.path.join(root, paths.TRACKER_FILENAME)):
        return ""
    return damage_hint(root, iteration)


def _same_tp_pp(saved_layout: dict, run_layout: dict) -> bool:
    return (saved_layout["tp"], saved_layout["pp"]) == (run_layout["tp"], run_layout["pp"])


def _megatron_lm_optimizer_metadata(common: dict, saved_layout: dict, run_layout: dict,
                                    directory: str) -> dict:
    """The content metadata to load a Megatron-LM distributed optimizer with; its default
    ``dp_reshardable`` state reshards over DP only, so another TP/PP is refused (as Megatron-LM
    refuses it) with the ways forward."""
    sharding = upstream_compat.optimizer_sharding(common, directory)
    if sharding is None:
        raise CheckpointError("the checkpoint's content metadata names no distributed-optimizer "
                              "sharding type (Megatron-LM core_v0.16.1 writes "
                              "distrib_optim_sharding_type); pass --no-load-optim", path=directory)
    if sharding == upstream_compat.DP_RESHARDABLE and not _same_tp_pp(saved_layout, run_layout):
        raise CheckpointError(
            f"the distributed-optimizer state is {sharding} (Megatron-LM's default), which loads "
            f"only at the TP/PP it was saved with (TP={saved_layout['tp']}, "
            f"PP={saved_layout['pp']}; this run has TP={run_layout['tp']}, "
            f"PP={run_layout['pp']}). Convert it first: resume it once at TP="
            f"{saved_layout['tp']} PP={saved_layout['pp']} with this trainer (its checkpoints are "
            "fully_reshardable), or re-save it with Megatron-LM's "
            "--dist-ckpt-optim-fully-reshardable; or pass --no-load-optim", path=directory)
    return upstream_compat.optimizer_metadata(common)


def _layout_of(saved: dict) -> dict:
    p = saved["parallel"]
    tp, pp = p["tensor_model_parallel_size"], p["pipeline_model_parallel_size"]
    return {"tp": tp, "pp": pp, "vpp": p["virtual_pipeline_model_parallel_size"],
            "dp": p["world_size"] // (tp * pp)}


#: Where a load's sharded state dict holds the distributed optimizer's own boxes.
_OWN_BOXES = "datastates_distributed_optimizer_boxes"


def _fully_reshardable(common: Optional[dict]) -> bool:
    """Whether a checkpoint's common state describes the distributed optimizer's state in
    megatron's `fully_reshardable` form (one global tensor per parameter and moment)."""
    optimizer = (common or {}).get("optimizer")
    return (isinstance(optimizer, dict)
            and optimizer.get("param_state_sharding_type") == "fully_reshardable")


def _load_torch_dist(sd: dict, directory: str, loader, allow_unsafe_pickle: bool = False,
                     local_dir: Optional[str] = None, fully_parallel: bool = False,
                     on_read: Optional[Callable[[dict], None]] = None,
                     also: Optional[str] = None, strict: str = STRICTNESS[0]):
    """(the loaded state dict, (the sharded keys this rank asked for and the checkpoint lacks,
    the checkpoint's keys no rank asked for)); the keys are found only with a lenient `strict`
    (--dist-ckpt-strictness), whose tensors left out keep their values."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    if strict in LENIENT_STRICTNESS:  # the keys come back to be reported here, on rank 0
        strict = "return_all" if strict.endswith("_all") else "return_unexpected"
    try:
        if loader is not None:
            return loader(sd, directory), ((), ())
        sharded, common = load_strategies(directory, allow_unsafe_pickle, local_dir)
        strategy = AgreedLoadStrategy(sharded, f"loading {directory}", describe=lambda err: (
            _words(_read_error(err, directory, also))))
        if fully_parallel:  # --ckpt-fully-parallel-load (CUDA only, checked with the flags)
            from megatron.core import parallel_state as ps
            from megatron.core.dist_checkpointing.strategies.fully_parallel import \
                FullyParallelLoadStrategyWrapper

            strategy = FullyParallelLoadStrategyWrapper(
                strategy, ps.get_data_parallel_group(with_context_parallel=True))
        loaded = dist_checkpointing.load(sd, directory, sharded_strategy=strategy,
                                         common_strategy=common, strict=StrictHandling(strict))
        lacking = ((), ())
        if isinstance(loaded, tuple):  # return_*: (state dict, missing, unexpected)
            loaded, missing, unexpected = loaded
            lacking = (tuple(sorted(unexpected)), tuple(sorted(missing)))
        if getattr(sharded, "last_read", None) is not None:
            if local_dir is not None:
                _report_sources(directory, sharded.last_read)
            if on_read is not None:
                on_read(sharded.last_read)
        return loaded, lacking
    except BaseException as err:  # noqa: BLE001 - DCP's per-rank failure report is one
        # The tensors' read was agreed on (one line): as it is; else the trainer's words.
        translated = err if getattr(err, "agreed", False) else _read_error(err, directory, also)
        if translated is err:
            raise
        raise translated from err


def _words(err: BaseException) -> str:
    """A rank's error as a load's agreement words it (the agreed line names the ranks): a forged
    pickle by its type and file, any other by its reason (`control_plane.reason_of`)."""
    if isinstance(err, UnsafePickleError):
        return f"{type(err).__name__}: {err}"
    return control_plane.reason_of(err)


def _read_error(err: BaseException, directory: str, also: Optional[str]) -> BaseException:
    """The trainer's error for a failed read of `directory` (`err` itself when it has none)."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException as DcpException

    if isinstance(err, UnsafePickleError):
        return err  # already names the file and the offending global
    if isinstance(err, (CheckpointingException, datastates.CheckpointError, OSError, ValueError)):
        return CheckpointError(f"could not load the checkpoint: {err}" + _hint(directory, also),
                               path=directory)
    if isinstance(err, DcpException):  # a BaseException: PyTorch DCP's per-rank failure report
        lines = [line for line in str(err).splitlines() if line.strip()]
        return CheckpointError(f"could not load the checkpoint (torch_dist reader): "
                               f"{lines[-1] if lines else err}" + _backend_note(directory)
                               + _hint(directory, also), path=directory)
    return err


def _report_mismatch(strictness: str, lacking: Tuple[tuple, tuple], load_optim: bool,
                     load_rng: bool, directory: str) -> None:
    """Every rank (collective), a lenient --dist-ckpt-strictness load: one line on rank 0 with
    the tensors the model has and the checkpoint lacks ("unexpected" in megatron-core's words;
    they keep their values) and, for the *_all values, those the checkpoint has and no rank
    asked for ("missing"; not the optimizer or RNG states the run chose not to restore);
    nothing for ignore_all. With the optimizer restored, lacking tensors are refused on every
    rank: their optimizer state would be missing."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, lacking, group=control_plane.control_group())
    unexpected = sorted({k for mine, _ in gathered for k in mine})
    not_asked = (() if load_optim else ("optimizer.",)) + (() if load_rng else ("rng_state",))
    missing = sorted({k for _, theirs in gathered for k in theirs if not k.startswith(not_asked)})
    if unexpected and load_optim:
        raise CheckpointError(
            f"--dist-ckpt-strictness {strictness}: the checkpoint lacks {len(unexpected)} "
            f"tensor(s) of this model ({', '.join(unexpected[:8])}"
            f"{', ...' if len(unexpected) > 8 else ''}), whose optimizer state it cannot restore; "
            "add --finetune (or --no-load-optim) to start the optimizer afresh", path=directory)
    if strictness == "ignore_all" or not (unexpected or missing):
        return
    parts = []
    if unexpected:
        parts.append(f"the checkpoint lacks {len(unexpected)} tensor(s) of this model, which "
                     f"keep their initial values (unexpected): {', '.join(unexpected)}")
    if missing:
        parts.append(f"{len(missing)} tensor(s) of the checkpoint are not in this model, not "
                     f"read (missing): {', '.join(missing)}")
    print_rank_0(f"--dist-ckpt-strictness {strictness}: " + "; ".join(parts))


def _report_sources(directory: str, read: dict) -> None:
    """Every rank: where its shards came from (--lazy-save-local-dir), bytes and read seconds."""
    rank = dist.get_rank()
    for saved_rank, why in sorted(read["fallbacks"].items()):
        say(f"[rank {rank}] WARNING: the local copy of saved rank {saved_rank}'s shards failed "
            f"verification ({why}); read from {directory} instead")
    parts = []
    for kind, where in (("local", read["local_copy"]), ("shared", directory)):
        if kind in read["sources"]:
            nbytes, seconds = read["sources"][kind]
            parts.append(f"{kind} {where}: {nbytes / 2**20:.2f} MiB in {seconds:.3f} s")
    if not parts:
        parts.append("no shard bytes read")
    say(f"[rank {rank}] restored shards from " + "; ".join(parts))


def _backend_note(directory: str) -> str:
    """A DataStates directory whose metadata.json names another backend was edited."""
    if os.path.isfile(os.path.join(directory, paths.DATASTATES_COMMIT_FILENAME)):
        return (". The directory holds a DataStates checkpoint (COMMIT.json) but metadata.json "
                "names another backend: metadata.json was edited or replaced")
    return ""

def _hint(directory: str, also: Optional[str] = None) -> str:
    """`damage_hint` for ROOT/iter_NNNNNNN; nothing for a release directory."""
    if os.path.basename(os.path.normpath(directory)) == paths.RELEASE_DIRNAME:
        return ". Restore its files from a copy"
    return damage_hint(*_split(directory), also=also)


def _split(directory: str):
    """(root, iteration) of ROOT/iter_NNNNNNN."""
    return os.path.dirname(os.path.normpath(directory)), paths.iteration_of(directory)
