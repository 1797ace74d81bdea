"""Validate a launch without GPUs: parse pretrain_gpt.py's flags, build each (stage, TP rank) on the
meta device, print the layer split, per-rank parameter counts and per-rank checkpoint bytes.

Usage:
    python tools/dry_run.py --world-size 8 -- --num-layers 32 --hidden-size 4096 \
        --num-attention-heads 32 --seq-length 2048 --micro-batch-size 16 --train-iters 5 \
        --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --bf16 \
        --use-distributed-optimizer --mock-data --vocab-size 50256
    python tools/dry_run.py --paper-models        # the five paper models beside the paper's sizes

Flags after ``--`` are pretrain_gpt.py's, checked by its own parser (megatron.training.arguments).
"""
from __future__ import annotations

import argparse
import json
import sys

GB = 1e9


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=None, help="ranks of the launch (default: TP*PP)")
    parser.add_argument("--paper-models", action="store_true", help="report the paper's five models")
    parser.add_argument("--json", default=None, help="also write the report here")
    parser.add_argument("--lazy-cache-mb", action="store_true",
                        help="end with the --lazy-save-cache-mb that holds the largest rank's checkpoint")
    parser.add_argument("launch_args", nargs=argparse.REMAINDER, help="-- pretrain_gpt.py flags")
    return parser


def _rank_rows(report) -> list[dict]:
    rows = []
    for c in report.ranks:
        held = report.rank_bytes(c)
        unique = report.rank_bytes(c, unique_only=True)
        rows.append({"stage": c.stage, "tp_rank": c.tp_rank, "layers": c.layers, "params": c.params,
                     "tp_replicated": c.tp_replicated, "embedding_copy": c.embedding_copy,
                     "weights_bytes": held.weights, "main_params_bytes": held.main_params,
                     "adam_moments_bytes": held.adam_moments, "held_bytes": held.total,
                     "unique_bytes_dp0": unique.total})
    return rows


def print_report(report, name: str = "") -> None:
    print(f"{name} layer split per stage: {list(report.stage_layers)}  (TP={report.tp}, DP={report.dp}, "
          f"{'bf16 + fp32 main params' if report.bf16 else 'fp32'} + Adam)")
    print(f"{'stage':>5} {'tp':>5} {'layers':>6} {'params':>14} {'replicated':>11} {'emb copy':>11} "
          f"{'weights GB':>10} {'main GB':>8} {'adam GB':>8} {'rank GB':>8}")
    rows = _rank_rows(report)

    def shape_of(r):  # the printed columns (the de-duplicated bytes differ on TP rank 0)
        return tuple(v for k, v in r.items() if k not in ("tp_rank", "unique_bytes_dp0"))

    shown = set()
    for row in rows:
        # Megatron splits a stage evenly over its TP ranks: print one row per distinct rank shape.
        if shape_of(row) in shown:
            continue
        shown.add(shape_of(row))
        same = [r["tp_rank"] for r in rows if shape_of(r) == shape_of(row)]
        ranks = f"{same[0]}-{same[-1]}" if len(same) > 1 else str(same[0])
        print(f"{row['stage']:>5} {ranks:>5} {row['layers']:>6} {row['params']:>14,} "
              f"{row['tp_replicated']:>11,} {row['embedding_copy']:>11,} {row['weights_bytes'] / GB:>10.3f} "
              f"{row['main_params_bytes'] / GB:>8.3f} {row['adam_moments_bytes'] / GB:>8.3f} "
              f"{row['held_bytes'] / GB:>8.3f}")
    print(f"unique parameters {report.unique_parameters():,}; checkpoint {report.total_bytes(False) / GB:.1f} GB "
          f"as written per rank (torch format), {report.total_bytes(True) / GB:.1f} GB de-duplicated (torch_dist)")


def lazy_cache_mb(rank_bytes: int, multiple: int = 64) -> int:
    """--lazy-save-cache-mb for a rank that writes `rank_bytes`: the whole snapshot fits, so the
    copy never waits for the flush of the same checkpoint (MiB, rounded up to `multiple`)."""
    mib = -(-rank_bytes // 2**20)
    return max(multiple, -(-mib // multiple) * multiple)


def _launch(args) -> dict:
    from megatron.training.arguments import ArgumentError, build_run_config, parse_args

    from tools.scale.dry_run import dry_run

    launch = args.launch_args[1:] if args.launch_args[:1] == ["--"] else args.launch_args
    try:
        namespace = parse_args(launch)
        world = args.world_size or namespace.tensor_model_parallel_size * namespace.pipeline_model_parallel_size
        config = build_run_config(namespace, world_size=world)
    except (ArgumentError, ValueError) as error:
        raise SystemExit(f"error: the launch arguments do not parse: {error}")
    try:
        report = dry_run(config.model, config.parallel, config.parallel.stage_layers(config.model.num_layers))
    except ValueError as error:  # megatron-core's own checks of the layout, as one line
        raise SystemExit(f"error: megatron-core refuses this layout: {error}")
    print_report(report)
    if args.lazy_cache_mb:
        print(f"lazy cache per rank (MiB): {lazy_cache_mb(max(report.rank_bytes(c).total for c in report.ranks))}")
    return {"stage_layers": list(report.stage_layers), "ranks": _rank_rows(report),
            "checkpoint_bytes_torch": report.total_bytes(False), "checkpoint_bytes_torch_dist": report.total_bytes(True)}


def _paper(args) -> dict:
    from megatron.training.config import ModelConfig, ParallelConfig

    from tools.scale.architecture import PAPER_MODELS
    from tools.scale.dry_run import dry_run

    out = {}
    summary = []
    for arch in PAPER_MODELS:
        tp, pp = 4, arch.nodes
        model = ModelConfig(num_layers=arch.num_layers, hidden_size=arch.hidden_size,
                            num_attention_heads=arch.num_attention_heads, ffn_hidden_size=arch.ffn,
                            seq_length=arch.seq_length, max_position_embeddings=arch.seq_length,
                            vocab_size=arch.vocab_size, padded_vocab_size=arch.padded_vocab(tp), bf16=True)
        parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  use_distributed_optimizer=True, world_size=tp * pp)
        report = dry_run(model, parallel, arch.stage_layers(pp))
        print_report(report, arch.name)
        print()
        n = report.unique_parameters()
        row = {"model": arch.name, "unique_params": n, "torch_gb": report.total_bytes(False) / GB,
               "torch_dist_gb": report.total_bytes(True) / GB, "paper_gb": arch.paper_checkpoint_gb,
               "paper_bytes_per_param": arch.paper_checkpoint_gb * GB / n,
               "max_rank_gb": max(report.rank_bytes(c).total for c in report.ranks) / GB}
        summary.append(row)
        out[arch.name] = {"stage_layers": list(report.stage_layers), "ranks": _rank_rows(report), **row}
    print(f"{'model':<5} {'params (B)':>10} {'torch GB':>9} {'torch_dist GB':>13} {'paper GB':>9} "
          f"{'paper B/param':>13} {'max rank GB':>11}")
    for r in summary:
        print(f"{r['model']:<5} {r['unique_params'] / 1e9:>10.3f} {r['torch_gb']:>9.1f} {r['torch_dist_gb']:>13.1f} "
              f"{r['paper_gb']:>9.0f} {r['paper_bytes_per_param']:>13.2f} {r['max_rank_gb']:>11.2f}")
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.paper_models == bool(args.launch_args):
        print("error: give either --paper-models or -- <pretrain_gpt.py flags>", file=sys.stderr)
        return 2
    try:
        result = _paper(args) if args.paper_models else _launch(args)
    except SystemExit as stop:
        print(stop, file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
