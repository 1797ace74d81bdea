#!/usr/bin/env python
"""Convert and inspect checkpoints (universal, DataStates, Megatron torch_dist, Hugging Face).

    python tools/convert_checkpoint.py merge           SRC DST   # --async-lazy-save ckpt -> universal
                                                  [--workers K]  # K processes, one part each
    python tools/convert_checkpoint.py from-torch-dist SRC DST   # Megatron torch_dist -> universal
    python tools/convert_checkpoint.py to-torch-dist   SRC DST   # universal or DataStates -> torch_dist
    python tools/convert_checkpoint.py to-hf           SRC DST   # any of ours -> HF Llama or GPT-2
    python tools/convert_checkpoint.py from-hf         SRC DST   # HF Llama or GPT-2 -> universal
    python tools/convert_checkpoint.py inspect         PATH [--json]
    python tools/convert_checkpoint.py upgrade-universal PATH    # older universal: no pickles,
                                                                 # checksums added
    python tools/convert_checkpoint.py ds-to-torch     SRC DST   # DeepSpeed tag saved with
                                                  # DataStates -> DeepSpeed's torch.save files

Reading a checkpoint never runs code from it: a file whose pickle names anything but tensors,
containers, numbers, strings and numpy RNG states is refused, naming the file and the object.
``--allow-unsafe-pickle`` (every subcommand) reads such files with plain pickle: only for legacy
files you trust.

SRC is what ``pretrain_gpt.py --load`` takes: an ``iter_XXXXXXX`` directory, or a root with a
tracker (a --save root, a universal root such as ``SAVE/universal``; the tracker picks the
iteration). to-hf also takes a --save root or checkpoint whose universal copy the background merge
wrote (``SAVE/universal/iter_XXXXXXX``); when there is none, the error names what is missing and
the command that makes it; the directory read is said on stdout. Every tensor read from a universal checkpoint is verified against its
checksums. Universal outputs are committed atomically; rerunning a finished merge does nothing
(--overwrite rewrites it); a failed conversion leaves nothing in its output. Files are written
with the permissions the umask gives (0644 under 0022). Errors end with one line on stderr and
exit status 2.
"""
import argparse
import json
import os
import sys
import time


class Progress:
    """A progress bar on stderr (a line per 10% when stderr is not a terminal)."""

    def __init__(self, what: str, unit_bytes: bool):
        self.what, self.unit_bytes = what, unit_bytes
        self.t0, self.last_tenth = time.perf_counter(), -1
        self.tty = sys.stderr.isatty()

    def _fmt(self, n: int) -> str:
        return f"{n / 2**20:.1f} MiB" if self.unit_bytes else str(n)

    def __call__(self, done: int, total: int, name: str) -> None:
        frac = done / total if total else 1.0
        tenth = int(frac * 10)
        if not self.tty and tenth == self.last_tenth and done != total:
            return
        self.last_tenth = tenth
        bar = "#" * int(frac * 30)
        line = (f"{self.what} [{bar:<30}] {frac:6.1%} {self._fmt(done)}/{self._fmt(total)} "
                f"{time.perf_counter() - self.t0:6.1f}s {name[:50]}")
        sys.stderr.write(("\r" + line + ("\n" if done == total else "")) if self.tty
                         else line + "\n")
        sys.stderr.flush()


def _warn(message: str) -> None:
    print(f"convert_checkpoint.py: warning: {message}", file=sys.stderr, flush=True)


def _located(found) -> str:
    """The directory a converter reads, said on stdout when the path given was a root (stderr
    keeps its one line for an error)."""
    if found.note:
        print(f"reading {found.directory} ({found.note})", flush=True)
    return found.directory


def _merge(args, kind):
    from datastates import CheckpointError
    from datastates.megatron_adapter import locate, merge_with_workers, open_source
    from datastates.universal import write_universal

    if args.workers < 1:
        raise CheckpointError(f"--workers must be at least 1, found {args.workers}")
    found = locate(args.src)
    if found.kind == "universal":
        raise CheckpointError("this is already a universal checkpoint; to-hf, to-torch-dist and "
                              "pretrain_gpt.py --load read it as it is", file=found.directory)
    source = open_source(_located(found), allow_unsafe_pickle=args.allow_unsafe_pickle)
    try:
        if source.kind != kind:
            other = "merge" if source.kind == "datastates" else "from-torch-dist"
            raise CheckpointError(f"this is a {source.kind} checkpoint, expected {kind}; use the "
                                  f"{other} subcommand", file=source.directory)
        opts = dict(max_file_bytes=args.max_file_size_mb << 20, overwrite=args.overwrite,
                    progress=Progress("merge", True))
        if args.workers > 1:
            result = merge_with_workers(source, args.dst, args.workers,
                                        allow_unsafe_pickle=args.allow_unsafe_pickle, **opts)
        else:
            result = write_universal(source, args.dst, **opts)
    finally:
        source.close()
    if result.skipped:
        print(f"{result.directory} is already a committed universal checkpoint of iteration "
              f"{result.iteration}; nothing to do (--overwrite rewrites it)")
    else:
        print(f"universal checkpoint of iteration {result.iteration} committed to "
              f"{result.directory}: {result.bytes} bytes in {result.seconds:.2f} s "
              f"({result.gbps:.3f} GB/s)")
    print(json.dumps(result.to_json()))


def _to_torch_dist(args):
    from megatron.training.startup import import_megatron_core

    import_megatron_core()  # its dist_checkpointing writes the output
    from datastates import CheckpointError
    from datastates.megatron_adapter import locate
    from datastates.megatron_adapter.merge.run import advance_tracker

    found = locate(args.src)
    if found.kind not in ("datastates", "universal"):
        raise CheckpointError(f"expected a DataStates checkpoint (--async-lazy-save) or a "
                              f"universal one, found {found.kind}", file=found.directory)
    if os.path.isdir(args.dst) and os.listdir(args.dst):
        raise CheckpointError("output directory is not empty; choose a new one", file=args.dst)
    if found.kind == "datastates":  # converted directly, without a universal merge
        from megatron.training.checkpointing.to_torch_dist import datastates_to_torch_dist as convert
    else:
        from megatron.training.checkpointing.from_universal import universal_to_torch_dist as convert
    opts = {"warn": _warn} if found.kind == "universal" else {}
    it = convert(_located(found), args.dst, progress=Progress("to-torch-dist", False),
                 allow_unsafe_pickle=args.allow_unsafe_pickle, **opts)
    parent, name = os.path.split(os.path.abspath(args.dst))
    if name == f"iter_{it:07d}":  # a Megatron save root: make it loadable with --load parent
        advance_tracker(parent, it)  # never backwards: newer checkpoints there stay the latest
        print(f"torch_dist checkpoint of iteration {it} written to {args.dst}; --load {parent}")
    else:
        print(f"torch_dist checkpoint of iteration {it} written to {args.dst} (name it "
              f"iter_{it:07d} under a --load root with a tracker to resume from it)")


def _to_hf(args):
    import shutil

    from datastates import CheckpointError
    from datastates.megatron_adapter import (export_hf, locate, locate_universal, open_source,
                                             UNIVERSAL_KIND)
    from datastates.universal import write_universal

    scratch = None
    try:
        src = _located(locate_universal(args.src))
    except CheckpointError:
        found = locate(args.src)  # raises itself when the path names no checkpoint at all
        if found.kind == UNIVERSAL_KIND or found.kind == "torch":
            raise
        # A DataStates or torch_dist checkpoint without a universal copy: merged to a scratch
        # universal beside the output first, removed afterwards.
        scratch = os.path.abspath(args.dst).rstrip("/") + ".tmp-universal"
        shutil.rmtree(scratch, ignore_errors=True)
        print(f"{found.directory} has no universal copy: merging it to {scratch} first",
              flush=True)
        source = open_source(found.directory, allow_unsafe_pickle=args.allow_unsafe_pickle)
        try:
            src = write_universal(source, scratch, progress=Progress("merge", True)).directory
        finally:
            source.close()
    try:
        cfg = export_hf(src, args.dst, progress=Progress("to-hf", False),
                        allow_unsafe_pickle=args.allow_unsafe_pickle, warn=_warn)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    layers, hidden = (cfg.get("num_hidden_layers", cfg.get("n_layer")),
                      cfg.get("hidden_size", cfg.get("n_embd")))
    print(f"Hugging Face {cfg['architectures'][0]} ({layers} layers, hidden {hidden}) written to "
          f"{args.dst}")


def _from_hf(args):
    import shlex

    from datastates.megatron_adapter.hf.importer import import_hf, launch_flags

    result, model = import_hf(args.src, args.dst, progress=Progress("from-hf", True),
                              max_file_bytes=args.max_file_size_mb << 20,
                              approximate_gelu_ok=args.allow_approximate_gelu)
    print(f"universal checkpoint (release: iteration 0, no optimizer state) committed to "
          f"{result.directory}: {result.bytes} bytes in {result.seconds:.2f} s "
          f"({result.gbps:.3f} GB/s)")
    print("resume it at any TP/PP/DP with these model flags (NullTokenizer's --vocab-size counts "
          "the ids before the end-of-document id, the model's last):")
    print("  pretrain_gpt.py " + " ".join(shlex.quote(f) for f in launch_flags(model))
          + f" --load {shlex.quote(result.directory)} ...")


def _inspect(args):
    from datastates.megatron_adapter import describe, render

    info = describe(args.path, allow_unsafe_pickle=args.allow_unsafe_pickle)
    print(json.dumps(info, indent=1) if args.json else render(info))


def _upgrade(args):
    from datastates import CheckpointError
    from datastates.megatron_adapter import locate
    from datastates.universal import add_checksums, upgrade_universal

    found = locate(args.path)
    if found.kind != "universal":
        raise CheckpointError(f"this is a {found.kind} checkpoint; upgrade-universal rewrites "
                              "universal ones", file=found.directory)
    path = _located(found)
    n = upgrade_universal(path, allow_unsafe_pickle=args.allow_unsafe_pickle)
    print(f"{path}: rewrote {n} pickled object(s) without pickles" if n else
          f"{path}: holds no pickles; nothing to do")
    n = add_checksums(path, allow_unsafe_pickle=args.allow_unsafe_pickle)
    print(f"{path}: added the checksums of {n} tensor(s), as their files are now" if n else
          f"{path}: has checksums; nothing to do")


def _ds_to_torch(args):
    from datastates import CheckpointError
    import importlib
    try:  # DeepSpeed's loss scaler and slice mappings are rebuilt as its own classes
        for module in ("deepspeed", "deepspeed.runtime.fp16.loss_scaler",
                       "deepspeed.utils.tensor_fragment", "deepspeed.runtime.zero.config"):
            importlib.import_module(module)
    except ImportError as e:
        raise CheckpointError(f"ds-to-torch needs deepspeed installed ({e})") from None
    from datastates.deepspeed_tags import export_torch

    tag, names = export_torch(args.src, args.dst, allow_pickle=args.allow_unsafe_pickle)
    print(f"wrote {len(names)} file(s) of tag {tag} to {os.path.join(args.dst, tag)} and "
          f"{os.path.join(args.dst, 'latest')}; DeepSpeed's tools read it, e.g. python "
          f"zero_to_fp32.py {args.dst} OUTPUT_DIR")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("merge", "DataStates (--async-lazy-save) checkpoint -> universal"),
                        ("from-torch-dist", "Megatron torch_dist checkpoint -> universal")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("src")
        s.add_argument("dst")
        s.add_argument("--max-file-size-mb", type=int, default=2048,
                       help="split the safetensors files at this size (default 2048)")
        s.add_argument("--overwrite", action="store_true",
                       help="rewrite a destination that is already committed")
        s.add_argument("--workers", type=int, default=1,
                       help="merge worker processes, each writing its share of the tensors; "
                            "the manifest is committed once every part is durable (default 1)")
    s = sub.add_parser("to-torch-dist", help="universal or DataStates -> Megatron torch_dist "
                                             "(iter_XXXXXXX dir)")
    s.add_argument("src")
    s.add_argument("dst")
    s = sub.add_parser("to-hf", help="universal, DataStates or torch_dist -> Hugging Face "
                       "LlamaForCausalLM or GPT2LMHeadModel (safetensors + config.json)")
    s.add_argument("src")
    s.add_argument("dst")
    s = sub.add_parser("from-hf", help="Hugging Face LlamaForCausalLM or GPT2LMHeadModel "
                       "(config.json + safetensors) -> universal (iteration 0, no optimizer)")
    s.add_argument("src")
    s.add_argument("dst")
    s.add_argument("--max-file-size-mb", type=int, default=2048,
                   help="split the safetensors files at this size (default 2048)")
    s.add_argument("--allow-approximate-gelu", action="store_true",
                   help="convert a GPT-2 with a tanh-approximate GELU (the original GPT-2's "
                        "gelu_new) although megatron's GPT computes the exact one")
    s = sub.add_parser("ds-to-torch", help="a DeepSpeed tag saved with DataStates (its save "
                       "directory: `latest` picks the tag; or the tag directory) -> DeepSpeed's "
                       "own torch.save files in DST/<tag>, for zero_to_fp32.py and ds_to_universal")
    s.add_argument("src")
    s.add_argument("dst")
    s = sub.add_parser("inspect", help="iteration, tensors, shapes, dtypes, sizes, layout")
    s.add_argument("path")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s = sub.add_parser("upgrade-universal",
                       help="rewrite an older universal checkpoint: pickled objects as JSON, "
                            "checksums added for the files as they are now")
    s.add_argument("path")
    for s in sub.choices.values():
        s.add_argument("--allow-unsafe-pickle", action="store_true",
                       help="read pickles that name arbitrary code (legacy files you trust only)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from megatron.training import warning_filters
    from megatron.training.startup import compile_deferred, unused_imports_skipped

    warning_filters.install()  # megatron-core, if a subcommand imports it, stays quiet
    from datastates import CheckpointError

    try:
        with compile_deferred(), unused_imports_skipped():  # reading a saved `args` imports megatron-core
            return _run(args)
    except CheckpointError as err:
        print(f"convert_checkpoint.py: error: {err}", file=sys.stderr)
        return 2


def _run(args) -> int:
    if args.command == "merge":
        _merge(args, "datastates")
    elif args.command == "from-torch-dist":
        _merge(args, "torch_dist")
    elif args.command == "to-torch-dist":
        _to_torch_dist(args)
    elif args.command == "to-hf":
        _to_hf(args)
    elif args.command == "from-hf":
        _from_hf(args)
    elif args.command == "upgrade-universal":
        _upgrade(args)
    elif args.command == "ds-to-torch":
        _ds_to_torch(args)
    else:
        _inspect(args)
    return 0


if __name__ == "__main__":  # the torch_dist writer's spawn-context Manager re-imports __main__
    from megatron.training.startup import exit_without_final_gc

    exit_without_final_gc(main())
