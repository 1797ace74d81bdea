"""Megatron-LM's --use-checkpoint-args: a launch's model flags from the --load checkpoint.

Before the run's configuration is built, the model the checkpoint was saved with fills in the
flags, as Megatron-LM's `load_args_from_checkpoint` does: its sizes (layers, widths, heads,
sequence length, position table, vocabulary) where the command line gives none, and its
architecture (position embedding, rotary settings, norm, MLP, key/value groups, biases, tied
embeddings, dropouts) whatever the command line says. So an evaluation, a conversion or a
fine-tuning launch names the checkpoint instead of repeating the model. Its tokenizer too, as
Megatron-LM 0.16 takes it unless --no-use-tokenizer-model-from-checkpoint-args: the type and
model whatever is given, the vocabulary size or files where none is given (the padded vocabulary
the checkpoint holds is checked against them at load); with --use-mp-args-from-checkpoint-args
its TP/PP/VPP.

The checkpoint is the one a resume would load from --load: the tracker's iteration (or
--ckpt-step's, or Megatron-LM's ``release``), or --load itself when it is a checkpoint directory;
where --load holds none, --pretrained-checkpoint's, read the same way.
Its model comes from its common state (this trainer's run config, or Megatron-LM's ``args``),
from a universal checkpoint's manifest, or from a torch-format file, each read without running
code from it. Without a checkpoint there, the flags given are used, as in Megatron-LM.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import List, Optional, Tuple

from datastates.fileio import safe_join
from datastates.megatron_adapter import paths
from datastates.universal import UniversalCheckpoint, is_universal

from megatron.training.checkpointing.contents import safe_torch_load, saved_run_config
from megatron.training.checkpointing.errors import CheckpointError

#: (flag, saved model field = the flag's argparse destination): taken where the flag is not given.
SIZES = (("--num-layers", "num_layers"), ("--hidden-size", "hidden_size"),
         ("--ffn-hidden-size", "ffn_hidden_size"), ("--seq-length", "seq_length"),
         ("--num-attention-heads", "num_attention_heads"),
         ("--max-position-embeddings", "max_position_embeddings"))
#: The same, taken whatever the command line says (Megatron-LM forces these).
ARCHITECTURE = (("--position-embedding-type", "position_embedding_type"),
                ("--normalization", "normalization"), ("--swiglu", "swiglu"),
                ("--disable-bias-linear", "add_bias_linear"),
                ("--untie-embeddings-and-output-weights", "untie_embeddings_and_output_weights"),
                ("--apply-layernorm-1p", "apply_layernorm_1p"),
                ("--hidden-dropout", "hidden_dropout"),
                ("--attention-dropout", "attention_dropout"))
_ROPE = (("--rotary-base", "rotary_base"), ("--rotary-percent", "rotary_percent"))


def apply_checkpoint_args(a: argparse.Namespace) -> List[str]:
    """With --use-checkpoint-args: fill `a` from the --load checkpoint's model; the lines to
    print (one saying what was taken from where). Raises datastates' CheckpointError for a
    checkpoint that cannot be read."""
    if not a.use_checkpoint_args:
        return []
    sources = [d for d in (a.load, a.pretrained_checkpoint) if d is not None]
    if not sources:
        return ["--use-checkpoint-args: no --load or --pretrained-checkpoint directory, using the "
                "model flags given"]
    # The checkpoint the run will load: --load's, else (a first fine-tuning launch) the
    # pretrained one's.
    found = None
    for directory in sources:
        found = found or _saved_model(directory, a.ckpt_step, a.allow_unsafe_pickle)
    if found is None:
        return [f"--use-checkpoint-args: no checkpoint in {' or '.join(sources)} to take the model "
                "flags from, using the flags given"]
    directory, saved = found
    model = saved["model"]
    taken, kept = [], []
    for flag, field in SIZES:
        value = model.get(field)
        if value is None:
            continue
        if getattr(a, field) is None:
            setattr(a, field, value)
            taken.append(f"{flag} {value}")
        elif getattr(a, field) != value:
            kept.append(f"{flag} {getattr(a, field)} (checkpoint: {value})")
    rope = model.get("position_embedding_type") == "rope"
    for flag, field in ARCHITECTURE + (_ROPE if rope else ()):
        if field in model:
            setattr(a, field, model[field])
            on = not model[field] if field == "add_bias_linear" else model[field]
            if on is not False:  # a flag that is off is not written, as on a command line
                taken.append(flag if on is True else f"{flag} {on}")
    if "num_query_groups" in model:
        groups = model["num_query_groups"]
        a.group_query_attention, a.num_query_groups = groups is not None, groups
        if groups is not None:
            taken.append(f"--group-query-attention --num-query-groups {groups}")
    if not rope:  # rotary settings mean nothing for it (and would be refused)
        a.rotary_base = a.rotary_percent = None
    if a.use_tokenizer_model_from_checkpoint_args:
        taken += _take_tokenizer(a, saved.get("data"))
    if a.use_mp_args_from_checkpoint_args:
        taken += _take_layout(a, saved.get("parallel"), directory)
    return [f"--use-checkpoint-args: model flags from {directory}: {' '.join(taken)}"
            + (f"; given on the command line, kept: {', '.join(kept)}" if kept else "")]


def _take_tokenizer(a: argparse.Namespace, data: Optional[dict]) -> List[str]:
    """The checkpoint's tokenizer, as Megatron-LM takes it unless
    --no-use-tokenizer-model-from-checkpoint-args: its type and model whatever the command line
    says, and its vocabulary size and files where the command line gives none; the flags taken.
    (A path from another cluster that is not here fails at start, naming it.)"""
    if not data or data.get("tokenizer_type") is None:
        return []  # a universal checkpoint, or a Megatron-LM one without them
    a.tokenizer_type, a.tokenizer_model = data["tokenizer_type"], data.get("tokenizer_model")
    taken = [f"--tokenizer-type {a.tokenizer_type}"] + (
        [f"--tokenizer-model {a.tokenizer_model}"] if a.tokenizer_model else [])
    kind = a.tokenizer_type
    wanted = {"NullTokenizer": ("vocab_size",),
              "GPT2BPETokenizer": ("vocab_file", "merge_file")}.get(kind, ())
    for field in wanted:
        if getattr(a, field) is None and data.get(field) is not None:
            setattr(a, field, data[field])
            taken.append(f"--{field.replace('_', '-')} {data[field]}")
    for field in ("vocab_size", "vocab_file", "merge_file"):  # what the type does not read
        if field not in wanted:
            setattr(a, field, None)
    return taken


def _take_layout(a: argparse.Namespace, parallel: Optional[dict], directory: str) -> List[str]:
    """--use-mp-args-from-checkpoint-args: the checkpoint's TP, PP and virtual pipeline (and an
    uneven first/last stage), whatever the command line says, as Megatron-LM forces them; the
    flags taken. A universal checkpoint has no layout to take: refused, with what to do."""
    if parallel is None:
        raise CheckpointError(f"--use-mp-args-from-checkpoint-args: {directory} is a universal "
                              "checkpoint, which has no parallel layout to take; give the "
                              "layout flags and drop this one")
    tp, pp = parallel["tensor_model_parallel_size"], parallel["pipeline_model_parallel_size"]
    vpp = parallel.get("virtual_pipeline_model_parallel_size")
    a.tensor_model_parallel_size, a.pipeline_model_parallel_size = tp, pp
    a.num_layers_per_virtual_pipeline_stage = a.num_layers // (pp * vpp) if vpp else None
    a.decoder_first_pipeline_num_layers = parallel.get("decoder_first_pipeline_num_layers")
    a.decoder_last_pipeline_num_layers = parallel.get("decoder_last_pipeline_num_layers")
    taken = [f"--tensor-model-parallel-size {tp}", f"--pipeline-model-parallel-size {pp}"]
    if vpp:
        taken.append(f"--num-layers-per-virtual-pipeline-stage "
                     f"{a.num_layers_per_virtual_pipeline_stage}")
    for stage in ("first", "last"):
        field = f"decoder_{stage}_pipeline_num_layers"
        if getattr(a, field) is not None:
            taken.append(f"--decoder-{stage}-pipeline-num-layers {getattr(a, field)}")
    return taken


def _saved_model(load: str, ckpt_step: Optional[int],
                 allow_unsafe_pickle: bool) -> Optional[Tuple[str, dict]]:
    """(checkpoint directory, its run config as run_config.json writes it: "model", and
    "parallel" except for a universal checkpoint), or None when `load` holds no checkpoint."""
    directory = _checkpoint_directory(load, ckpt_step)
    if directory is None:
        return None
    if is_universal(directory):
        with UniversalCheckpoint(directory, allow_unsafe_pickle=allow_unsafe_pickle) as u:
            return directory, {"model": dict(u.manifest["model_config"])}
    kind = paths.detect_format(directory)
    if kind is paths.Format.TORCH:  # every (TP, PP) file holds the run config: the first's
        name = sorted(n for n in os.listdir(directory) if n.startswith("mp_rank_"))[0]
        path = os.path.join(directory, name, paths.TORCH_FILENAME)
        return directory, json.loads(safe_torch_load(path, allow_unsafe_pickle)["run_config"])
    return directory, json.loads(saved_run_config(directory, kind, allow_unsafe_pickle))


def _checkpoint_directory(load: str, ckpt_step: Optional[int]) -> Optional[str]:
    """The checkpoint a resume would read from `load`; None without one."""
    if is_universal(load) or os.path.isfile(os.path.join(load, paths.METADATA_FILENAME)):
        return load  # --load names a checkpoint directory itself
    if ckpt_step is not None:
        directory = paths.checkpoint_dir(load, ckpt_step)
        return directory if os.path.isdir(directory) else None
    if paths.tracker_names_release(load):
        return safe_join(load, paths.RELEASE_DIRNAME, what=paths.TRACKER_FILENAME)
    iteration = paths.tracked_iteration(load)
    return None if iteration is None else paths.checkpoint_dir(load, iteration)
