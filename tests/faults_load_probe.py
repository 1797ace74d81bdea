"""Try `load_checkpoint` on several --load directories in one process (world size 1), so the
corruption tests pay megatron-core's start-up once instead of once per case.

Usage: python tests/faults_load_probe.py CASES.json -- [pretrain_gpt.py model flags]
CASES.json: [{"name": ..., "load": DIR, "fallback": bool, "allow_unsafe_pickle": bool}, ...]
Prints one JSON line per case: {"name", "ok", "iteration", "error"} (error: the message the
entry point would print).
"""
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv) -> int:
    sep = argv.index("--")
    cases = json.load(open(argv[sep - 1]))
    flags = argv[sep + 1:]
    from datastates import CheckpointError as EngineError
    from megatron.training.arguments import build_run_config, parse_args
    from megatron.training.checkpointing.loading import load_checkpoint
    from megatron.training.checkpointing.contents import CheckpointError
    from megatron.training.training import setup

    trainer = setup(build_run_config(parse_args(flags)))
    for case in cases:
        ckpt = dataclasses.replace(trainer.config.checkpoint, load=case["load"],
                                   ckpt_fallback_to_previous=bool(case.get("fallback")),
                                   allow_unsafe_pickle=bool(case.get("allow_unsafe_pickle")))
        config = dataclasses.replace(trainer.config, checkpoint=ckpt)
        trainer.state.iteration = 0
        out = {"name": case["name"], "ok": False, "iteration": None, "error": None}
        try:
            out["ok"] = load_checkpoint(trainer.state, config)
            out["iteration"] = trainer.state.iteration
        except (CheckpointError, EngineError) as err:
            out["error"] = f"{type(err).__name__}: {err}"
        except BaseException as err:  # noqa: BLE001 - reported: an unclear error is a finding
            if isinstance(err, KeyboardInterrupt):
                raise
            out["error"] = f"UNEXPECTED {type(err).__name__}: {err}"
        print("PROBE " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
