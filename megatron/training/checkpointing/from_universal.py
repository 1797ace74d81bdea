"""Universal checkpoints in the trainer: load one at any TP/PP/DP, write one back as torch_dist.

The format lives in `datastates.universal`, the merge of Megatron checkpoints into it in
`datastates.megatron_adapter`. This module maps a universal checkpoint onto megatron-core's
sharded state dict:

  1) every rank builds the sharded state dict it would load (`build_sharded_state_dict`), which
     names each of its shards by global key, offset and shape;
  2) each ShardedTensor is filled with exactly its box of the universal tensor (memory-mapped
     safetensors slice), so a rank reads only its slices; optimizer keys are mapped from the
     universal spelling to the one this run's optimizer uses;
  3) the common state (iteration, counters, scheduler, param groups, step, fp16's loss scaler)
     comes from the manifest, in the form this run's optimizer expects, and everything is applied as any other
     checkpoint would be (`apply_loaded_state_dict`). RNG states are per rank and not restored.
Every byte read is verified against the checkpoint's per-chunk checksums (`datastates.universal`);
`verify_universal_share` verifies a whole checkpoint, shared out over the ranks, for the fallback.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Optional

import torch

import datastates
from datastates import control_plane
from datastates.fileio import hold_for_reading
from datastates.megatron_adapter import read_sharded_tensor
from datastates.safe_load import UnsafePickleError
from datastates.universal import Role, UniversalCheckpoint, split_name, tensor_name, \
    unchecked_warning

from megatron.training.checkpointing.contents import (
    CheckpointError,
    TrainState,
    apply_loaded_state_dict,
    build_sharded_state_dict,
    check_model_shape,
    init_distributed_optimizer_state,
)
from megatron.training.config import RunConfig
from megatron.training.log import print_rank_0
from megatron.training.timers import count_loaded

_DISTOPT_MAIN = "optimizer.state.param."


def universal_name(sharded_key: str) -> str:
    """The universal tensor holding a megatron sharded key of either optimizer's spelling."""
    if sharded_key.startswith(_DISTOPT_MAIN):
        return tensor_name(Role.FP32_PARAM, sharded_key[len(_DISTOPT_MAIN):])
    return sharded_key


def _read_box(u: UniversalCheckpoint, sh) -> torch.Tensor:
    name = universal_name(sh.key)
    info = u.info(name)
    return count_loaded(read_sharded_tensor(sh, info.shape, info.dtype,
                                            lambda off, shape: u.read(name, off, shape),
                                            where=u.directory, name=name))


def _fill(sd: Any, u: UniversalCheckpoint) -> Any:
    from megatron.core.dist_checkpointing.mapping import (LocalNonpersistentObject, ShardedObject,
                                                          ShardedTensor, ShardedTensorFactory)

    if isinstance(sd, dict):
        return {k: _fill(v, u) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_fill(v, u) for v in sd]
    if isinstance(sd, ShardedTensor):
        return _read_box(u, sd)
    if isinstance(sd, ShardedObject):
        if u.manifest.get("release") and sd.key.endswith("._extra_state"):
            # A Hugging Face import has no per-module extra state (TE's fp8 metadata; None for
            # the local spec): each module keeps the one it was built with.
            return sd.data
        return u.object(sd.unique_key)  # decoded without running code
    if isinstance(sd, LocalNonpersistentObject):
        return sd.unwrap()
    if isinstance(sd, ShardedTensorFactory):
        # e.g. swiglu's fc1: this rank's rows of both halves, read as the ShardedTensors the
        # factory builds and joined back into the local tensor as dist_checkpointing.load does.
        return sd.merge_fn(_fill(sd.build(), u))
    return sd


def _param_groups_holder(optimizer_sd: dict) -> dict:
    d = optimizer_sd
    while isinstance(d, dict) and "param_groups" not in d:
        d = d.get("optimizer")
    if d is None:
        raise CheckpointError("optimizer state dict has no param_groups")
    return d


def _restore_grad_scaler(optimizer_sd: dict, saved_common: Callable[[], dict]) -> None:
    """fp16's loss scaler (scale, growth and hysteresis trackers) as the source saved it in its
    common state, when both runs have one; else this run's own (a fresh scaler, or none in
    bf16/fp32). The common state is decoded only then (a Megatron-LM source's holds its args)."""
    if optimizer_sd.get("grad_scaler") is None:
        return
    saved = (saved_common().get("optimizer") or {}).get("grad_scaler")
    if saved is not None:
        optimizer_sd["grad_scaler"] = saved


def _apply_common(loaded: dict, m: dict, load_optim: bool, distributed: bool,
                  saved_common: Callable[[], dict]) -> None:
    for k in ("iteration", "consumed_train_samples", "consumed_valid_samples"):
        loaded[k] = m[k]
    loaded["skipped_train_samples"] = m.get("skipped_train_samples", 0)  # older manifests: none
    if not load_optim:
        return
    _restore_grad_scaler(loaded["optimizer"], saved_common)
    loaded["opt_param_scheduler"] = dict(m["scheduler"])
    holder = _param_groups_holder(loaded["optimizer"])
    saved_groups, step = m["optimizer"]["param_groups"], m["optimizer"]["step"]
    if len(holder["param_groups"]) != len(saved_groups):
        raise CheckpointError(f"universal checkpoint has {len(saved_groups)} optimizer param "
                              f"groups, this run {len(holder['param_groups'])}")
    for group, saved in zip(holder["param_groups"], saved_groups):
        group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
        if distributed:
            group["step"] = step  # the distributed optimizer keeps Adam's step in its groups
    if not distributed:
        holder.setdefault("state", {})["common_step"] = torch.tensor(step, dtype=torch.float32)


def _saved_model(m: dict, config: RunConfig) -> dict:
    """The checkpoint's model config as the shape check compares it. An unpadded vocabulary
    (``vocab_unpadded``: a Hugging Face import) fits any run that pads it to at least its size:
    the embedding and output rows past it start at zero (megatron-core's padding on load)."""
    model = dict(m["model_config"])
    if m.get("vocab_unpadded") and config.model.padded_vocab_size >= model["padded_vocab_size"]:
        model["padded_vocab_size"] = config.model.padded_vocab_size
    return model


def release_note(m: dict, directory: str) -> str:
    """What a resume from a release checkpoint (a Hugging Face import) starts with, as
    Megatron-LM treats one: iteration 0 and fresh optimizer, schedule and RNG."""
    return (f"{directory} is a release checkpoint ({m['source']['layout']}, no optimizer state): "
            "training starts at iteration 0 with a fresh optimizer, learning-rate schedule and "
            "RNG, as Megatron-LM starts from a release checkpoint (what --finetune "
            "--no-load-optim --no-load-rng do for another one)")


def open_universal(directory: str, config: RunConfig,
                   damage_hint: Callable[[], str] = lambda: "") -> UniversalCheckpoint:
    """Every rank: the universal checkpoint `directory`, its model checked against this run's
    (the trainer's CheckpointError on failure, with `damage_hint()` appended when a file is
    damaged); rank 0 warns about one without checksums."""
    try:
        u = UniversalCheckpoint(directory,
                                allow_unsafe_pickle=config.checkpoint.allow_unsafe_pickle)
    except UnsafePickleError as err:
        raise CheckpointError(str(err), path=directory) from err
    except datastates.CheckpointError as err:
        raise CheckpointError(str(err) + damage_hint(), path=directory) from err
    try:
        check_model_shape(json.dumps({"model": _saved_model(u.manifest, config)}), config,
                          directory)
    except BaseException:
        u.close()
        raise
    if not u.checksummed:
        print_rank_0("WARNING: " + unchecked_warning(directory))
    return u


def verify_universal_share(directory: str, config: RunConfig, rank: int, world: int) -> None:
    """Every rank, for --ckpt-fallback-to-previous: the checksums of every chunk of the tensors
    i with i % world == rank (together the ranks verify every tensor once)."""
    with open_universal(directory, config) as u:
        for i, name in enumerate(u.names()):
            if i % world == rank:
                u.verify(name)


def load_universal(state: TrainState, config: RunConfig, directory: str,
                   damage_hint: Callable[[], str] = lambda: "") -> None:
    """Every rank: restore `state` from the universal checkpoint `directory` at this run's
    layout (see the module docstring for the order). Each rank verifies the checksums of what
    it reads; the ranks agree before applying anything, so a box damaged on one rank fails the
    load on every rank (none is left waiting in a collective). `damage_hint()` says what to do
    about a damaged file (e.g. the older checkpoints to fall back to)."""
    ckpt = config.checkpoint
    what = f"loading the universal checkpoint {directory}"
    # Every rank reads the manifest and finds the same mistake (another model, a forged object):
    # one line; a tensor file damaged where one rank reads it stops every rank, named once.
    opened = control_plane.agree(lambda: open_universal(directory, config, damage_hint), what,
                                 describe=control_plane.reason_of, undo=UniversalCheckpoint.close)
    with opened as u:
        m = u.manifest
        load_optim = ckpt.load_optim and not ckpt.finetune and m["optimizer"] is not None
        if m.get("release"):
            print_rank_0(release_note(m, directory))
        distributed = config.parallel.use_distributed_optimizer
        if load_optim and distributed:
            init_distributed_optimizer_state(state.optimizer)
        sd = build_sharded_state_dict(state, config, is_loading=True, include_optim=load_optim,
                                      include_rng=False)
        loaded = control_plane.agree(
            lambda: _fill(sd, u), what, describe=lambda err: str(err) + (
                "" if isinstance(err, UnsafePickleError) else damage_hint()))

        def apply() -> Optional[str]:  # one line for a refusal (as in `loading._load`)
            _apply_common(loaded, m, load_optim, distributed, u.megatron_common)
            return apply_loaded_state_dict(
                state, loaded, load_optim=load_optim, load_rng=False,
                finetune=ckpt.finetune or bool(m.get("release")),
                schedule=config.optimizer.scheduler_on_resume, path=directory,
                allow_unsafe_pickle=ckpt.allow_unsafe_pickle)
        note = control_plane.agree(apply, what, describe=control_plane.reason_of)
    if note:
        print_rank_0(note)
    print_rank_0(f"loaded universal checkpoint {directory} (iteration {m['iteration']}, saved at "
                 f"{m['source']['layout']}; optimizer {'restored' if load_optim else 'not restored'}"
                 ", rng not restored)")


def single_process_group() -> None:
    """megatron's dist_checkpointing.save needs a process group; a converter is one process."""
    import torch.distributed as dist

    from megatron.training.cpu_compat import apply_cpu_patches

    apply_cpu_patches()
    if not dist.is_initialized():
        # An in-memory store: one rank needs no rendezvous, and nothing is left on disk.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def universal_to_torch_dist(universal_dir: str, out_dir: str,
                            progress: Optional[Callable[[int, int, str], None]] = None,
                            allow_unsafe_pickle: bool = False,
                            warn: Optional[Callable[[str], None]] = None) -> int:
    """Write the universal checkpoint as a megatron ``torch_dist`` checkpoint in `out_dir` (an
    ``iter_XXXXXXX`` directory), with the source's own key spelling and common state, so that
    a round trip reproduces the source. Every tensor is read (and its checksums verified) before
    anything is written. `warn` hears about a checkpoint without checksums. Returns the
    iteration."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    single_process_group()
    with hold_for_reading(universal_dir), \
            UniversalCheckpoint(universal_dir, allow_unsafe_pickle=allow_unsafe_pickle) as u:
        if not u.checksummed and warn is not None:
            warn(unchecked_warning(universal_dir))
        m = u.manifest
        sd: dict = u.megatron_common()
        content_metadata = sd.pop("content_metadata", None)
        names = u.names()
        steps = len(names) + 1  # every tensor read, then the files written
        for i, name in enumerate(names):
            entry = m["tensors"][name]
            role, key = split_name(name)
            # fp32 weights that were their own main weights have nothing separate to write
            if not (role is Role.FP32_PARAM and entry["source_key"] == key):
                sd[entry["source_key"]] = ShardedTensor.from_rank_offsets(
                    entry["source_key"], u.read(name), replica_id=0)
            if progress is not None:
                progress(i + 1, steps, name)
        for unique_key in u.object_keys():
            sd[unique_key] = whole_object(unique_key, u.object(unique_key))
        write_torch_dist(sd, out_dir, content_metadata, progress, steps)
        return u.iteration


def whole_object(unique_key: str, value):
    """A megatron ShardedObject of one process that holds every rank's objects."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    empty = ShardedObject.empty_from_unique_key(unique_key)
    return ShardedObject(empty.key, value, empty.global_shape, empty.global_offset, replica_id=0)


def write_torch_dist(sd: dict, out_dir: str, content_metadata, progress, steps: int) -> None:
    """One process writes `sd` (whole tensors and objects) with megatron's torch_dist strategy."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    os.makedirs(out_dir, exist_ok=True)
    dist_checkpointing.save(sd, out_dir, sharded_strategy=TorchDistSaveShardedStrategy(
        "torch_dist", 1), content_metadata=content_metadata)
    if progress is not None:
        progress(steps, steps, "torch_dist files written")
