"""Export a universal checkpoint to Hugging Face safetensors + `config.json`: GPT-2 or Llama.

The architecture is chosen from the run config: rotary position embeddings mean Llama
(`llama.py`), learned absolute positions mean GPT-2 (`gpt2.py`). Either refuses, naming the
part, a model its Hugging Face class cannot express, rather than exporting names that would load
and compute something else. The way back is `importer.py`.
"""
from __future__ import annotations

import os
import shutil
from typing import Callable, Dict, Optional, Tuple

import torch

from ...errors import CheckpointError
from ...fileio import fsync_dir, fsync_file, give_default_mode, hold_for_reading
from ...universal import UniversalCheckpoint, unchecked_warning, write_json
from .common import Plan, architecture_fields
from .gpt2 import gpt2_config, gpt2_tensors
from .llama import llama_config, llama_tensors
from ..resolve import locate_universal

HF_WEIGHTS = "model.safetensors"
def _config_and_plan(u: UniversalCheckpoint) -> Tuple[dict, Plan]:
    if architecture_fields(u.manifest["model_config"])["position_embedding_type"] == "rope":
        cfg = llama_config(u)
        return cfg, llama_tensors(u, cfg)
    cfg = gpt2_config(u)
    return cfg, gpt2_tensors(u, cfg)


def export_hf(src: str, out_dir: str,
              progress: Optional[Callable[[int, int, str], None]] = None,
              allow_unsafe_pickle: bool = False,
              warn: Optional[Callable[[str], None]] = None) -> dict:
    """Write ``config.json`` + ``model.safetensors`` (model weights in the model's dtype) into
    `out_dir` (created; refused if it holds files): ``LlamaForCausalLM`` for a rotary model,
    ``GPT2LMHeadModel`` otherwise. `src` is anything `locate_universal` takes (a universal
    checkpoint or root, or a --save root whose checkpoint was merged). Every weight read is
    verified against its checksums first; a damaged one fails the export and nothing is left in
    `out_dir`. Files get the permissions open() gives (0644 under umask 0022). `warn` hears about
    a checkpoint without checksums. Returns the config."""
    from safetensors.torch import save_file

    directory = locate_universal(src).directory
    with hold_for_reading(directory), \
            UniversalCheckpoint(directory, allow_unsafe_pickle=allow_unsafe_pickle) as u:
        if not u.checksummed and warn is not None:
            warn(unchecked_warning(directory))
        cfg, plan = _config_and_plan(u)
        if os.path.isdir(out_dir) and os.listdir(out_dir):
            raise CheckpointError("output directory is not empty; choose a new one",
                                  file=out_dir)
        tmp = out_dir.rstrip("/") + ".tmp-hf"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            tensors: Dict[str, torch.Tensor] = {}
            for i, (name, load) in enumerate(plan):
                tensors[name] = load()
                if progress is not None:
                    progress(i + 1, len(plan), name)
            path = os.path.join(tmp, HF_WEIGHTS)
            save_file(tensors, path, metadata={"format": "pt"})
            give_default_mode(path)
            fsync_file(path)
            write_json(os.path.join(tmp, "config.json"), cfg)
            fsync_dir(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)
        os.rename(tmp, out_dir)
        fsync_dir(os.path.dirname(os.path.abspath(out_dir)))
    return cfg
