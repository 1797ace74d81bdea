"""Pretrain a GPT model with megatron-core (Megatron-LM flag names).

    torchrun --standalone --nproc_per_node N pretrain_gpt.py [Megatron-LM flags]

Bad input (flags, checkpoints) ends with one clear message and exit status 2 (1 for other
errors); our traceback is printed only with DEBUG_TRACEBACK=1 (torchrun still prints its own
summary of failed workers).
"""
import os
import sys
import time

#: When this process started: --exit-duration-in-mins counts from here (the earliest rank's), as
#: Megatron-LM counts from before its imports.
STARTED_AT = time.time()

#: How long a rank other than 0 waits, after a flag error, for rank 0 to print it and exit.
RANK0_REPORTS_WITHIN_S = 60


def main(argv=None) -> int:
    from megatron.training.startup import import_megatron_core

    import_megatron_core()  # quietly, without compiling what it may never call
    from megatron.training.arguments import ArgumentError, build_run_config, parse_args

    from datastates import CheckpointError  # the trainer's checkpoint errors subclass it
    from megatron.training.checkpointing.checkpoint_args import apply_checkpoint_args

    try:
        args = parse_args(argv)
        for line in apply_checkpoint_args(args):  # --use-checkpoint-args: before the checks
            if os.environ.get("RANK", "0") == "0":
                print(line, flush=True)
        config = build_run_config(args)
    except (ArgumentError, ValueError, CheckpointError) as err:
        # Every rank finds the same mistake; one copy of the message is enough. The other ranks
        # must not end first: the launcher (torchrun, srun) would stop rank 0 before its line is
        # out, and rank 0 may reach the same error seconds later on a loaded machine (its
        # imports). The launcher stops them once rank 0 has exited; a rank still running after
        # the wait has a mistake of its own (e.g. its node's memory) and says it itself.
        rank = os.environ.get("RANK", "0")
        if rank != "0":
            time.sleep(RANK0_REPORTS_WITHIN_S)
        _error_line(f"{'' if rank == '0' else f'[rank {rank}] '}{err}")
        return 2
    from megatron.training.initialize import destroy_distributed, shutdown_after_error
    from megatron.training.training import setup, train

    try:
        trainer = setup(config, started_at=STARTED_AT)  # creates and checks --save on every rank
        train(trainer)
    except CheckpointError as err:
        _report(err)
        shutdown_after_error()
        return 2
    except Exception as err:  # noqa: BLE001 - the entry point reports, the library raises
        _report(err)
        shutdown_after_error()
        return 1
    destroy_distributed()
    return 0


def _report(err: BaseException) -> None:
    """The error, once per job where every rank raised the same agreed one (rank 0 prints it,
    naming the failing ranks), else on each rank that has it."""
    if os.environ.get("DEBUG_TRACEBACK"):
        import traceback

        traceback.print_exc()
    if getattr(err, "agreed", False) and os.environ.get("RANK", "0") != "0":
        return
    _error_line(f"{type(err).__name__}: {err}")


def _error_line(text: str) -> None:
    """One line on stderr, in one write: the ranks of a node share it."""
    from megatron.training.log import say  # imported by then (megatron-core, torch)

    say(f"pretrain_gpt.py: error: {text}", sys.stderr)


if __name__ == "__main__":
    from megatron.training.startup import exit_without_final_gc

    exit_without_final_gc(main())  # ~1 s sooner: no final collection over torch's objects
