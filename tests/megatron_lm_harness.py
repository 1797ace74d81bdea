"""Run NVIDIA Megatron-LM's own training code (its `megatron/training` and `pretrain_gpt.py`, from a
source tree at tag core_v0.16.1) on this CPU machine, in a process of its own.

    torchrun --nproc_per_node N tests/megatron_lm_harness.py MLM_TREE pretrain [its flags]

Megatron-LM's package is also named `megatron.training`, so ours is never imported here: its tree
is appended to sys.path (megatron.core stays the installed 0.16.1 wheel our trainer uses, the
same version as the tree's), and our two patch modules are loaded by file under other names.
What this harness changes, none of it numerics:
- our CPU patches (`cpu_compat`) and megatron-core fixes (`mcore_fixes`), as our trainer applies;
- torch.distributed is initialised (gloo) before Megatron-LM looks, and CUDA's device count,
  `set_device`, streams and `empty_cache` answer as one device that needs no synchronisation
  (Megatron-LM seeds its RNG tracker and builds its parallel groups only with a device);
- `initialize_megatron(allow_no_cuda=True)`; its legacy fused-kernel build and dataset-helper
  compilation are skipped (the wheel ships the helpers prebuilt; the local spec uses no kernel);
- modules it imports but never uses with these flags when their dependency is absent (`six` for
  BERT's tokenizer, triton's batch-invariant kernels) are stood in for.

`pretrain` runs Megatron-LM's pretrain_gpt.py training loop unchanged: with `--save` it writes
Megatron-LM checkpoints, with `--load` it resumes one through its own `load_checkpoint`. Needs
flags `--distributed-backend gloo --transformer-impl local` and the fusions off (see
`UPSTREAM_CPU_FLAGS` in tests/megatron_lm_fixtures.py). `MEGATRON_LM_IMPORT=datastates` imports
those modules first (what a Megatron-LM user adds to read our `--async-lazy-save` checkpoints).
"""
import contextlib
import functools
import importlib.util
import os
import runpy
import sys
import types

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_ours(name: str, relpath: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, relpath))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class _NoStream:
    """get_model builds DDP on a side stream; on CPU there is one stream and nothing to wait on."""

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


def _stand_in(name: str, **attrs) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules.setdefault(name, module)


def _refuse_batch_invariant(*args, **kwargs):
    raise RuntimeError("--batch-invariant-mode needs triton, which is not installed")


def prepare(tree: str) -> None:
    """Everything but the run; also done in the spawned children of dist_checkpointing's async
    writer, which import this file as their main module."""
    # After site-packages: megatron.core is the installed wheel; megatron.training is theirs,
    # found before ours (our tree stays importable for `datastates` only).
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") not in (REPO, tree)]
    sys.path += [tree, REPO]
    _stand_in("six", PY2=False, PY3=True)  # bert_tokenization's version checks only
    _stand_in("megatron.core.transformer.custom_layers.batch_invariant_kernels",
              enable_batch_invariant_mode=_refuse_batch_invariant)
    _load_ours("_ours_cpu_compat", "megatron/training/cpu_compat.py").apply_cpu_patches()
    _load_ours("_ours_mcore_fixes", "megatron/training/mcore_fixes.py").apply_torch_adam_patches()
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.Stream = lambda *a, **k: _NoStream()
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    from megatron.core.datasets import utils as dataset_utils
    from megatron.legacy import fused_kernels
    from megatron.training import training

    dataset_utils.compile_helpers = lambda: None
    fused_kernels.load = lambda args: None
    if not isinstance(training.initialize_megatron, functools.partial):
        training.initialize_megatron = functools.partial(training.initialize_megatron,
                                                         allow_no_cuda=True)


def pretrain(tree: str) -> None:
    """pretrain_gpt.py loaded as a module (run as __main__, the async writer's spawned children
    would re-run it without `prepare`), then what its __main__ block does."""
    from megatron.core.enums import ModelType

    g = runpy.run_path(os.path.join(tree, "pretrain_gpt.py"), run_name="megatron_lm_pretrain_gpt")
    # pretrain_gpt.py's __main__ block, without in-process restart and ModelOpt (both off).
    g["train_valid_test_datasets_provider"].is_distributed = True
    g["pretrain"](g["train_valid_test_datasets_provider"],
                  functools.partial(g["model_provider"], g["gpt_builder"]),
                  ModelType.encoder_or_decoder, g["forward_step"],
                  args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
                  get_embedding_ranks=g["get_embedding_ranks"])


def main() -> None:
    tree, mode = os.path.abspath(sys.argv[1]), sys.argv[2]
    os.environ["MEGATRON_LM_TREE"] = tree  # for the spawned children (below)
    if "RANK" not in os.environ:  # one process without torchrun
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    prepare(tree)
    sys.argv = [os.path.join(tree, "pretrain_gpt.py")] + sys.argv[3:]
    torch.distributed.init_process_group("gloo")
    for name in filter(None, os.environ.get("MEGATRON_LM_IMPORT", "").split(",")):
        importlib.import_module(name)  # e.g. datastates: what a Megatron-LM user adds for ours
    if mode != "pretrain":
        raise SystemExit(f"unknown mode {mode!r}; expected 'pretrain'")
    pretrain(tree)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
else:  # a spawned child (dist_checkpointing's writer) importing the main module
    _tree = os.environ.get("MEGATRON_LM_TREE")
    if _tree:
        prepare(_tree)
