"""The models the Slurm examples run, from their one definition (tools/scale/architecture.py).

Usage:
    python tools/models.py                 # table of every model
    python tools/models.py --shell 7B      # shell assignments, for examples/slurm/common.sh

``--shell`` prints MODEL_LAYERS, MODEL_HIDDEN, MODEL_HEADS, MODEL_FFN, MODEL_VOCAB (the
``--vocab-size`` of mock data: the vocabulary without its end-of-document id), MODEL_SEQ_LENGTH,
MODEL_TP, MODEL_PP (the paper's layout: one pipeline stage per node of 4 GPUs),
MODEL_FIRST_STAGE_LAYERS and MODEL_LAST_STAGE_LAYERS (empty: even split), and two bash arrays:
MODEL_ARCH_ARGS (pretrain_gpt.py's shape and family flags: the Llama flags for the paper's models)
and MODEL_RECOMPUTE_ARGS, with MODEL_SEQUENCE_PARALLEL (1 or empty: the job adds
``--sequence-parallel`` where its TP is above 1).
"""
from __future__ import annotations

import argparse
import shlex
import sys

from tools.scale.architecture import MODELS, GPTArch, architecture_args, memory_args, model


def shell_assignments(arch: GPTArch) -> str:
    values = {"LAYERS": arch.num_layers, "HIDDEN": arch.hidden_size, "HEADS": arch.num_attention_heads,
              "FFN": arch.ffn, "VOCAB": arch.vocab_size - 1, "SEQ_LENGTH": arch.seq_length,
              "TP": arch.tp, "PP": arch.nodes,
              "FIRST_STAGE_LAYERS": arch.first_stage_layers or "",
              "LAST_STAGE_LAYERS": arch.last_stage_layers or ""}
    lines = [f"MODEL_{k}={shlex.quote(str(v))}" for k, v in values.items()]
    arrays = {"ARCH_ARGS": architecture_args(arch), "RECOMPUTE_ARGS": memory_args(arch, tp=1)}
    lines += [f"MODEL_{k}=({' '.join(shlex.quote(a) for a in v)})" for k, v in arrays.items()]
    lines.append(f"MODEL_SEQUENCE_PARALLEL={1 if arch.sequence_parallel else ''}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shell", metavar="MODEL", help="print one model as shell assignments")
    args = parser.parse_args(argv)
    if args.shell:
        try:
            print(shell_assignments(model(args.shell)))
        except KeyError as error:
            print(f"error: {error.args[0]}", file=sys.stderr)
            return 2
        return 0
    print(f"{'model':<6} {'layers':>6} {'hidden':>6} {'heads':>5} {'kv heads':>8} {'ffn':>6} {'vocab':>6} "
          f"{'family':<7} {'TP':>3} {'paper nodes':>11}")
    for arch in MODELS:
        family = "Llama" if arch.rope else "GPT-2"
        print(f"{arch.name:<6} {arch.num_layers:>6} {arch.hidden_size:>6} {arch.num_attention_heads:>5} "
              f"{arch.query_groups:>8} {arch.ffn:>6} {arch.vocab_size:>6} {family:<7} {arch.tp:>3} {arch.nodes:>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
