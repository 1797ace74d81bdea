"""Tokenize a JSONL corpus into megatron-core indexed datasets for ``pretrain_gpt.py --data-path``.

Usage:
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type ByteLevelTokenizer --append-eod --workers 2

Writes ``data/corpus_text_document.{bin,idx}`` (one pair per ``--json-keys`` entry) and prints the
``--data-path`` value to pass to training.
"""
from __future__ import annotations

import argparse
import sys

from tools.errors import ToolInputError
from tools.jsonl_to_indexed import PreprocessConfig, Progress, preprocess_jsonl


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="fields to tokenize (default: text)")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True,
                       help="NullTokenizer, ByteLevelTokenizer or GPT2BPETokenizer")
    group.add_argument("--vocab-size", type=int, default=None, help="ids in the text (NullTokenizer)")
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: GPT-2's vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: GPT-2's merges.txt")
    group.add_argument("--tokenizer-model", default=None, help="unused by the offline tokenizers")
    group.add_argument("--append-eod", action="store_true", help="append end-of-document after each document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="path prefix of the .bin/.idx outputs")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    group.add_argument("--log-interval", type=int, default=1000, help="progress every N lines")
    return parser


def _print_progress(progress: Progress) -> None:
    tokens = sum(progress.tokens.values())
    rate = progress.documents / progress.seconds if progress.seconds > 0 else 0.0
    print(
        f"Processed {progress.lines} lines: {progress.documents} documents, {tokens} tokens "
        f"({rate:.0f} docs/s, {progress.megabytes_per_second:.2f} MB/s)",
        file=sys.stderr,
        flush=True,
    )


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from megatron.training.startup import import_megatron_core

    import_megatron_core()  # quietly, without compiling what it may never call
    config = PreprocessConfig(
        input_path=args.input,
        output_prefix=args.output_prefix,
        tokenizer_type=args.tokenizer_type,
        json_keys=tuple(args.json_keys),
        vocab_size=args.vocab_size,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        append_eod=args.append_eod,
        workers=args.workers,
        log_interval=args.log_interval,
    )
    try:
        result = preprocess_jsonl(config, on_progress=_print_progress)
    except ToolInputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if result.progress.empty_documents:
        print(f"Skipped {result.progress.empty_documents} empty documents", file=sys.stderr)
    for key, prefix in result.output_prefixes.items():
        print(f"Wrote {prefix}.bin/.idx ({result.progress.tokens[key]} tokens, {result.token_dtype.__name__})",
              file=sys.stderr)
    # stdout carries only the --data-path value(s), so scripts can capture them.
    print(" ".join(result.output_prefixes.values()))
    return 0


if __name__ == "__main__":
    from megatron.training.startup import exit_without_final_gc

    exit_without_final_gc(main())
