"""Validate a launch without GPUs: parse pretrain_gpt.py's flags, build each (stage, TP rank) on the
meta device, print the layer split, per-rank parameter counts, per-rank checkpoint bytes and an
estimate of each rank's GPU memory (tools/scale/memory.py states the formula); with
--non-persistent-ckpt-type in_memory, what each node's shared memory must hold (--ranks-per-node).

Usage:
    python tools/dry_run.py --world-size 8 -- --num-layers 32 --hidden-size 4096 \
        --num-attention-heads 32 --seq-length 2048 --micro-batch-size 16 --train-iters 5 \
        --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --bf16 \
        --use-distributed-optimizer --mock-data --vocab-size 50256
    python tools/dry_run.py --paper-models        # the five paper models (Llama) beside the paper's sizes

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
    parser.add_argument("--ranks-per-node", type=int, default=8,
                        help="ranks (GPUs) per node, for what the in-memory level holds on each node "
                             "(--non-persistent-ckpt-type in_memory; default 8)")
    parser.add_argument("launch_args", nargs=argparse.REMAINDER, help="-- pretrain_gpt.py flags")
    return parser


def activation_shape(config):
    """What the activation estimate needs from a resolved RunConfig."""
    from tools.scale.memory import ActivationShape

    m, p = config.model, config.parallel
    return ActivationShape(
        seq_length=m.seq_length, micro_batch_size=config.training.micro_batch_size, hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size, num_attention_heads=m.num_attention_heads,
        kv_width=m.query_groups * (m.hidden_size // m.num_attention_heads), swiglu=m.swiglu,
        dropout=max(m.hidden_dropout, m.attention_dropout) > 0, padded_vocab_size=m.padded_vocab_size,
        tp=p.tensor_model_parallel_size, sequence_parallel=p.sequence_parallel,
        recompute_granularity=m.recompute_granularity.value if m.recompute_granularity else None,
        recompute_method=m.recompute_method.value if m.recompute_method else None,
        recompute_num_layers=m.recompute_num_layers)


def rank_memory(report, config) -> list:
    """GpuMemory of each (stage, TP rank) of the report, at the run's micro-batches per iteration."""
    from tools.scale.memory import gpu_memory

    shape = activation_shape(config)
    microbatches = config.training.num_microbatches(report.dp)
    pp = len(report.stage_layers)
    return [gpu_memory(c.params, report.precision != "fp32", report.dp, shape, c.layers, c.stage, pp, microbatches)
            for c in report.ranks]


def _rank_rows(report, memory: list) -> list[dict]:
    rows = []
    for c, mem in zip(report.ranks, memory):
        held = report.rank_bytes(c)
        unique = report.rank_bytes(c, unique_only=True)
        rows.append({"stage": c.stage, "tp_rank": c.tp_rank, "layers": c.layers, "params": c.params,
                     "tp_replicated": c.tp_replicated, "embedding_copy": c.embedding_copy,
                     "weights_bytes": held.weights, "main_params_bytes": held.main_params,
                     "adam_moments_bytes": held.adam_moments, "held_bytes": held.total,
                     "unique_bytes_dp0": unique.total, "gpu_state_bytes": mem.total - mem.activations,
                     "gpu_activation_bytes": mem.activations, "gpu_bytes": mem.total})
    return rows


def print_report(report, memory: list, name: str = "") -> None:
    from tools.scale.memory import A100_40GB_BYTES, RESERVE_FRACTION

    print(f"{name} layer split per stage: {list(report.stage_layers)}  (TP={report.tp}, DP={report.dp}, "
          f"{'fp32' if report.precision == 'fp32' else report.precision + ' + fp32 main params'}"
          " + Adam)")
    print(f"{'stage':>5} {'tp':>5} {'layers':>6} {'params':>14} {'replicated':>11} {'emb copy':>11} "
          f"{'weights GB':>10} {'main GB':>8} {'adam GB':>8} {'rank GB':>8} {'GPU: state':>10} {'act':>6} "
          f"{'GB':>6}")
    rows = _rank_rows(report, memory)

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
              f"{row['held_bytes'] / GB:>8.3f} {row['gpu_state_bytes'] / GB:>10.2f} "
              f"{row['gpu_activation_bytes'] / GB:>6.2f} {row['gpu_bytes'] / GB:>6.2f}")
    print(f"unique parameters {report.unique_parameters():,}; checkpoint {report.total_bytes(False) / GB:.1f} GB "
          f"as written per rank (torch format), {report.total_bytes(True) / GB:.1f} GB de-duplicated (torch_dist)")
    most = max(m.total for m in memory)
    budget = A100_40GB_BYTES * (1 - RESERVE_FRACTION)
    print(f"GPU memory per rank at most {most / GB:.2f} GB (weights + fp32 grads + optimizer state + activations); "
          f"{'fits' if most <= budget else 'does NOT fit'} a 40 GB A100 with {RESERVE_FRACTION:.0%} kept free "
          f"({budget / GB:.2f} GB)")


def memory_level(report, config, ranks_per_node: int):
    """--non-persistent-ckpt-type in_memory: the shared memory (/dev/shm) each node needs, counted by
    the trainer's start-up check's own rule (`node_needs`), from each rank's checkpoint bytes as it
    writes them; None without the level. Ranks are numbered in megatron-core's default order
    (TP fastest, then DP, then PP), and a node runs `ranks_per_node` consecutive ones."""
    ckpt = config.checkpoint
    if ckpt.non_persistent_ckpt_type != "in_memory":
        return None
    from datastates.megatron_adapter.levels.in_memory import node_needs

    held = {(c.stage, c.tp_rank): report.rank_bytes(c, config.parallel.use_distributed_optimizer).total
            for c in report.ranks}
    ranks = [held[stage, tp] for stage in range(len(report.stage_layers))
             for _ in range(report.dp) for tp in range(report.tp)]
    if ranks_per_node < 1 or len(ranks) % ranks_per_node:
        raise SystemExit(f"error: --ranks-per-node {ranks_per_node} does not divide the {len(ranks)} "
                         "ranks into whole nodes")
    own = [sum(ranks[i:i + ranks_per_node]) for i in range(0, len(ranks), ranks_per_node)]
    versions, peer_versions, needs = node_needs(own, ckpt.keep_last_n_non_persistent,
                                                ckpt.lazy_save_peer_replica)
    return {"ranks_per_node": ranks_per_node, "versions": versions, "peer_versions": peer_versions,
            "node_bytes": needs}


def print_memory_level(level: dict) -> None:
    need = level["node_bytes"]
    node = need.index(max(need))
    peers = f" and {level['peer_versions']} of the previous node's" if level["peer_versions"] else ""
    print(f"in-memory level: node {node} needs the most shared memory (/dev/shm), {max(need) / 2**20:,.0f} MiB "
          f"= {max(need) / GB:.2f} GB ({level['versions']} versions of its {level['ranks_per_node']} ranks' "
          f"checkpoints{peers}); the trainer checks at start-up that every node has that much free there")


def lazy_cache_mb(rank_bytes: int, multiple: int = 64) -> int:
    """--lazy-save-cache-mb for a rank that writes `rank_bytes`: the whole snapshot fits, so the
    copy never waits for the flush of the same checkpoint (MiB, rounded up to `multiple`)."""
    mib = -(-rank_bytes // 2**20)
    return max(multiple, -(-mib // multiple) * multiple)


def _config(launch: list, world_size=None):
    """pretrain_gpt.py's parser and checks on ``launch``; a refused launch is one-line SystemExit."""
    from megatron.training.arguments import ArgumentError, build_run_config, parse_args
    from megatron.training.checkpointing.checkpoint_args import apply_checkpoint_args

    from datastates import CheckpointError

    try:
        namespace = parse_args(launch)
        apply_checkpoint_args(namespace)  # --use-checkpoint-args, as pretrain_gpt.py
        world = world_size or namespace.tensor_model_parallel_size * namespace.pipeline_model_parallel_size
        return build_run_config(namespace, world_size=world)
    except (ArgumentError, ValueError, CheckpointError) as error:
        raise SystemExit(f"error: the launch arguments do not parse: {error}")


def _build(config):
    from tools.scale.dry_run import dry_run

    try:
        report = dry_run(config.model, config.parallel, config.parallel.stage_layers(config.model.num_layers))
    except ValueError as error:  # megatron-core's own checks of the layout, as one line
        raise SystemExit(f"error: megatron-core refuses this layout: {error}")
    return report, rank_memory(report, config)


def _launch(args) -> dict:
    launch = args.launch_args[1:] if args.launch_args[:1] == ["--"] else args.launch_args
    config = _config(launch, args.world_size)
    report, memory = _build(config)
    level = memory_level(report, config, args.ranks_per_node)
    print_report(report, memory)
    if level is not None:
        print_memory_level(level)
    if args.lazy_cache_mb:
        print(f"lazy cache per rank (MiB): {lazy_cache_mb(max(report.rank_bytes(c).total for c in report.ranks))}")
    return {"stage_layers": list(report.stage_layers), "ranks": _rank_rows(report, memory),
            "checkpoint_bytes_torch": report.total_bytes(False), "checkpoint_bytes_torch_dist": report.total_bytes(True),
            "max_gpu_bytes": max(m.total for m in memory), "memory_level": level}


def paper_launch(arch) -> list:
    """pretrain_gpt.py's flags for one paper model at the paper's layout (TP=4, PP=nodes, DP=1,
    micro-batch 16 and one micro-batch per iteration, bf16, distributed optimizer), as the Slurm
    examples launch it."""
    from tools.scale.architecture import architecture_args, memory_args

    tp, pp = 4, arch.nodes
    uneven = [] if arch.first_stage_layers is None else [
        "--decoder-first-pipeline-num-layers", str(arch.first_stage_layers),
        "--decoder-last-pipeline-num-layers", str(arch.last_stage_layers)]
    return (architecture_args(arch) + ["--seq-length", str(arch.seq_length)] + uneven
            + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
               "--use-distributed-optimizer"] + memory_args(arch, tp)
            + ["--micro-batch-size", str(arch.micro_batch_size), "--global-batch-size", str(arch.micro_batch_size),
               "--train-iters", "1", "--bf16", "--mock-data", "--tokenizer-type", "NullTokenizer",
               "--vocab-size", str(arch.vocab_size - 1)])


def _paper(args) -> dict:
    from tools.scale.architecture import PAPER_MODELS

    out = {}
    summary = []
    for arch in PAPER_MODELS:
        report, memory = _build(_config(paper_launch(arch)))
        print_report(report, memory, arch.name)
        print()
        n = report.unique_parameters()
        torch_gb = report.total_bytes(False) / GB
        row = {"model": arch.name, "unique_params": n, "torch_gb": torch_gb,
               "torch_dist_gb": report.total_bytes(True) / GB, "paper_gb": arch.paper_checkpoint_gb,
               "ours_over_paper": torch_gb / arch.paper_checkpoint_gb,
               "paper_bytes_per_param": arch.paper_checkpoint_gb * GB / n,
               "max_rank_gb": max(report.rank_bytes(c).total for c in report.ranks) / GB,
               "max_gpu_gb": max(m.total for m in memory) / GB}
        summary.append(row)
        out[arch.name] = {"stage_layers": list(report.stage_layers), "ranks": _rank_rows(report, memory),
                          "launch": paper_launch(arch), **row}
    print(f"{'model':<5} {'params (B)':>10} {'torch GB':>9} {'torch_dist GB':>13} {'paper GB':>9} {'ours/paper':>10} "
          f"{'paper B/param':>13} {'max rank GB':>11} {'max GPU GB':>10}")
    for r in summary:
        print(f"{r['model']:<5} {r['unique_params'] / 1e9:>10.3f} {r['torch_gb']:>9.1f} {r['torch_dist_gb']:>13.1f} "
              f"{r['paper_gb']:>9.0f} {r['ours_over_paper']:>10.2f} {r['paper_bytes_per_param']:>13.2f} "
              f"{r['max_rank_gb']:>11.2f} {r['max_gpu_gb']:>10.2f}")
    print("checkpoint: bf16 weights + fp32 main params + fp32 Adam moments (14 B/param) as every rank writes "
          "them (torch) or de-duplicated (torch_dist); GPU: + fp32 grads + activations (tools/scale/memory.py)")
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from megatron.training.startup import import_megatron_core

    import_megatron_core()  # quietly, without compiling what it may never call
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
    from megatron.training.startup import exit_without_final_gc

    exit_without_final_gc(main())
