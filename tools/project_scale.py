"""Project checkpoint stall, checkpoint throughput and end-to-end time at the paper's scales.

Usage:
    python tools/project_scale.py                          # paper platform, 5 models, DP=1
    python tools/project_scale.py --compare-paper          # + ratios vs the paper, with tolerances
    python tools/project_scale.py --models 13B 30B --dp 1 2 4 8 16 --experiment throughput
    python tools/project_scale.py --inputs my_node.json --d2h-gbps 12 --json out.json
    python tools/project_scale.py --merge-bench bench.json    # + universal merge time per model

Inputs: a JSON file (format in tools/scale/inputs.py; default tools/scale/paper_polaris.json),
then flags override it. Experiments: "throughput" = a checkpoint every iteration over 5
iterations; "e2e" = --iterations (50) with each --checkpoint-interval (10 and 1).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from tools.errors import ToolInputError
from tools.scale.architecture import PAPER_MODELS, WeightsWriter, paper_model
from tools.scale.compare import dp_scaling_rows, end_to_end_checks, format_checks, throughput_checks
from tools.scale.inputs import load_inputs
from tools.scale.merge import format_merge_table, merge_table
from tools.scale.paper import paper_case
from tools.scale.projection import PAPER_VARIANTS, Phases, Platform, ScaleCase, Variant, predict

DEFAULT_INPUTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scale", "paper_polaris.json")
_PLATFORM_FLAGS = [f.name for f in dataclasses.fields(Platform)]
TIME_MARGIN = 1.25
"""A job's time limit is its projected run time times this (the projection is calibrated on one
platform; a run killed at its limit loses every variant not yet recorded)."""
STARTUP_S = 300.0
"""Per launch: torchrun rendezvous, NCCL set-up, model build, the first iteration's warm-up."""


def slurm_time_limit(run_seconds: list[float]) -> str:
    """HH:MM:SS covering runs of these projected lengths, one after another, rounded up to 15 min."""
    total = sum(s * TIME_MARGIN + STARTUP_S for s in run_seconds)
    quarters = max(2, -(-int(total) // 900))
    minutes = quarters * 15
    return f"{minutes // 60:02d}:{minutes % 60:02d}:00"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", default=DEFAULT_INPUTS, help="JSON inputs (platform, phases, cases)")
    parser.add_argument("--models", nargs="*", default=[a.name for a in PAPER_MODELS],
                        help="paper models to project (none: only the inputs file's own cases)")
    parser.add_argument("--dp", nargs="+", type=int, default=[1], help="data-parallel sizes")
    parser.add_argument("--experiment", choices=["throughput", "e2e"], default="throughput")
    parser.add_argument("--iterations", type=int, default=50, help="e2e iterations")
    parser.add_argument("--checkpoint-interval", nargs="+", type=int, default=[10, 1], help="e2e intervals")
    parser.add_argument("--variants", nargs="+", choices=[v.value for v in Variant],
                        default=[v.value for v in PAPER_VARIANTS],
                        help="how checkpoints are taken (default: the paper's four; "
                             "datastates_memory: the in-memory level, see --persistent-every)")
    parser.add_argument("--persistent-every", type=int, default=10,
                        help="datastates_memory: in-memory versions per save to storage "
                             "(examples/slurm's PERSISTENT_EVERY)")
    parser.add_argument("--bytes", choices=["formula", "paper"], default="formula",
                        help="checkpoint size: our GPT's formula (default) or scaled to the paper's sizes")
    parser.add_argument("--weights-writer", choices=[w.value for w in WeightsWriter],
                        default=WeightsWriter.FIRST_REPLICA.value,
                        help="with DP > 1: DP rank 0 writes the weights (paper, default) or replicas share them")
    parser.add_argument("--compare-paper", action="store_true", help="print ratios vs the paper")
    parser.add_argument("--json", default=None, help="also write the predictions here")
    parser.add_argument("--slurm-time", action="store_true",
                        help="end with a Slurm time limit for running every case and variant one "
                             f"after another: x{TIME_MARGIN} + {STARTUP_S:.0f} s of start-up per run")
    group = parser.add_argument_group("universal merge (tools/scale/merge.py)")
    group.add_argument("--merge-gbps-per-worker", type=float, default=None,
                       help="measured merge rate of one worker (GB/s of universal bytes)")
    group.add_argument("--merge-bench", default=None,
                       help="or: the --json of benchmarks/universal_merge_bench.py (its median "
                            "one-worker rate)")
    group.add_argument("--merge-workers-per-node", type=int, default=1)
    group = parser.add_argument_group("platform overrides")
    for name in _PLATFORM_FLAGS:
        kind = int if name in ("gpus_per_node", "dist_streams") else float
        group.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    group = parser.add_argument_group("phase overrides (seconds, all models)")
    for name in ("forward", "backward", "update"):
        group.add_argument(f"--{name}", type=float, default=None)
    return parser


def _cases(args, inputs) -> list[ScaleCase]:
    if args.experiment == "throughput":
        runs = [(5, 1)]
    else:
        runs = [(args.iterations, interval) for interval in args.checkpoint_interval]
    cases = []
    for name in args.models:
        try:
            arch = paper_model(name)
        except KeyError as error:
            raise ToolInputError(str(error.args[0])) from None
        if name not in inputs.phases:
            raise ToolInputError(f"no phase times for {name!r} in the inputs", path=args.inputs)
        phases = _override_phases(args, inputs.phases[name])
        for dp in args.dp:
            for iterations, interval in runs:
                case = paper_case(arch, phases, iterations, interval, dp, paper_sized=args.bytes == "paper",
                                  writer=WeightsWriter(args.weights_writer))
                cases.append(dataclasses.replace(case, name=f"{name} dp{dp} every{interval}"))
    for custom in inputs.cases:
        for iterations, interval in runs:
            cases.append(ScaleCase(f"{custom.name} every{interval}",
                                   tuple(int(b * 1e9) for b in custom.bytes_per_rank_gb), custom.mp_ranks,
                                   _override_phases(args, custom.phases), iterations, interval))
    return cases


def _override_phases(args, phases: Phases) -> Phases:
    changes = {k: getattr(args, k) for k in ("forward", "backward", "update") if getattr(args, k) is not None}
    return dataclasses.replace(phases, **changes)


def _merge_rate(args):
    """GB/s of one merge worker: the flag, or the benchmark's JSON (None: no merge table)."""
    if args.merge_bench is None:
        return args.merge_gbps_per_worker
    try:
        with open(args.merge_bench, encoding="utf-8") as f:
            rate = json.load(f)["summary"]["merge_vs_dd"]["merge_gbps_1w"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ToolInputError(f"expected the --json output of benchmarks/universal_merge_bench.py "
                             f"with summary.merge_vs_dd.merge_gbps_1w: {error!r}",
                             path=args.merge_bench) from None
    if not isinstance(rate, (int, float)) or rate <= 0:
        raise ToolInputError(f"expected a positive merge rate, found {rate!r}",
                             path=args.merge_bench)
    return float(rate)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.persistent_every < 1:
        parser.error(f"--persistent-every must be >= 1, got {args.persistent_every}")
    try:
        inputs = load_inputs(args.inputs)
        overrides = {k: getattr(args, k) for k in _PLATFORM_FLAGS if getattr(args, k) is not None}
        platform = dataclasses.replace(inputs.platform, **overrides)
        cases = _cases(args, inputs)
        merge_rate = _merge_rate(args)
    except ToolInputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    rows = []
    print(f"{'case':<22} {'variant':<17} {'GB/ckpt':>8} {'stall s':>8} {'GB/s':>8} {'e2e s':>8} {'no-ckpt s':>9}")
    for case in cases:
        for variant in map(Variant, args.variants):
            p = predict(case, platform, variant, args.persistent_every)
            rows.append({"case": case.name, "variant": variant.value, "checkpoint_gb": case.checkpoint_bytes / 1e9,
                         "max_rank_gb": max(case.bytes_per_rank) / 1e9, "ranks": case.ranks,
                         "stall_per_checkpoint_s": p.stall_per_checkpoint_s,
                         "checkpoint_throughput_gbps": p.checkpoint_throughput_gbps,
                         "end_to_end_s": p.end_to_end_s, "end_to_end_no_checkpoint_s": p.end_to_end_no_checkpoint_s,
                         "final_drain_s": p.final_drain_s, "breakdown_s": p.breakdown,
                         "storage_saves": p.storage_saves})
            print(f"{case.name:<22} {variant.value:<17} {case.checkpoint_bytes / 1e9:>8.1f} "
                  f"{p.stall_per_checkpoint_s:>8.2f} {p.checkpoint_throughput_gbps:>8.1f} "
                  f"{p.end_to_end_s:>8.1f} {p.end_to_end_no_checkpoint_s:>9.1f}")
    result = {"platform": dataclasses.asdict(platform), "predictions": rows}
    if args.slurm_time:
        result["slurm_time_limit"] = slurm_time_limit([r["end_to_end_s"] for r in rows])
        print(f"slurm time limit: {result['slurm_time_limit']}")
    if args.compare_paper:
        checks = throughput_checks(platform, inputs.phases) + end_to_end_checks(platform, inputs.phases)
        checks.extend(dp_scaling_rows(platform, inputs.phases))
        print()
        print(format_checks(checks))
        result["paper_checks"] = [dataclasses.asdict(c) for c in checks]
    if merge_rate is not None:
        archs = [paper_model(name) for name in args.models]
        merges = merge_table(archs, {a.name: _override_phases(args, inputs.phases[a.name])
                                     for a in archs}, platform, merge_rate,
                             args.merge_workers_per_node)
        print()
        print(format_merge_table(merges, merge_rate))
        result["universal_merge"] = [dataclasses.asdict(m) for m in merges]
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
