"""Build a deterministic JSONL corpus from text installed on this machine (no downloads).

Usage:
    python tools/make_corpus.py --output data/corpus.jsonl [--source stdlib licenses] \
        [--max-documents 5000] [--min-chars 200]

Each line is {"source": "<where>", "text": "<document>"}; feed it to tools/preprocess_data.py.
"""
from __future__ import annotations

import argparse
import sys

from tools.corpus import CorpusConfig, CorpusSource, build_corpus
from tools.errors import ToolInputError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="JSONL file to write")
    parser.add_argument("--source", nargs="+", default=[CorpusSource.STDLIB_DOCSTRINGS.value],
                        choices=[s.value for s in CorpusSource],
                        help="stdlib: Python standard library docstrings; licenses: /usr/share/common-licenses")
    parser.add_argument("--min-chars", type=int, default=200, help="skip shorter documents")
    parser.add_argument("--max-documents", type=int, default=None, help="stop after N documents")
    parser.add_argument("--stdlib-dir", default=None, help="standard library root (default: this Python's)")
    parser.add_argument("--licenses-dir", default="/usr/share/common-licenses")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    config = CorpusConfig(
        output_path=args.output,
        sources=tuple(CorpusSource(s) for s in args.source),
        min_chars=args.min_chars,
        max_documents=args.max_documents,
        stdlib_dir=args.stdlib_dir,
        licenses_dir=args.licenses_dir,
    )
    try:
        stats = build_corpus(config)
    except ToolInputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for skipped in stats.skipped_files:
        print(f"skipped {skipped}", file=sys.stderr)
    print(f"Wrote {args.output}: {stats.documents} documents, {stats.characters} characters, "
          f"sha256 {stats.sha256}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
