"""JSONL documents -> megatron-core indexed datasets (``.bin`` + ``.idx``), one per JSON key.

Invariant: a document's tokens land in the output in input order, one megatron-core *document*
(a single sequence) per JSONL line, followed by ``tokenizer.eod`` when ``append_eod`` is set.
Outputs appear under their final names only when the whole input was processed: a failed run
leaves no half-written dataset that a later training run could pick up.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import numpy

from tools.errors import ToolInputError

# Megatron-LM names outputs ``<prefix>_<key>_<level>``; "document" is the level without sentence
# splitting, so ``--data-path`` values look the same as with Megatron-LM's tool.
OUTPUT_LEVEL = "document"


@dataclass(frozen=True)
class PreprocessConfig:
    """What to read, how to tokenize it and where to write it."""

    input_path: str
    """JSONL file: one JSON object per line; blank lines are skipped."""
    output_prefix: str
    """Outputs are ``<output_prefix>_<key>_document.{bin,idx}`` for each key."""
    tokenizer_type: str
    """Megatron-LM ``--tokenizer-type`` name understood by ``megatron.training.tokenizer``."""
    json_keys: tuple[str, ...] = ("text",)
    """Fields of each object to tokenize; each key gets its own dataset."""
    vocab_size: Optional[int] = None
    """Passed to the tokenizer (NullTokenizer needs it)."""
    tokenizer_model: Optional[str] = None
    """Passed to the tokenizer (none of the offline tokenizers uses one)."""
    vocab_file: Optional[str] = None
    """GPT2BPETokenizer's vocab.json."""
    merge_file: Optional[str] = None
    """GPT2BPETokenizer's merges.txt."""
    append_eod: bool = False
    """Append the tokenizer's end-of-document id after every document."""
    workers: int = 1
    """Tokenizer processes; 1 tokenizes in this process."""
    log_interval: int = 1000
    """Report progress every this many input lines."""
    chunk_size: int = 64
    """Lines handed to a worker at a time (amortizes inter-process traffic)."""


@dataclass
class Progress:
    """Counters reported while running and returned at the end."""

    lines: int = 0
    documents: int = 0
    empty_documents: int = 0
    tokens: dict = field(default_factory=dict)
    bytes_read: int = 0
    seconds: float = 0.0

    @property
    def megabytes_per_second(self) -> float:
        return self.bytes_read / 1e6 / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class PreprocessResult:
    """Final counters and the dataset prefix written for each JSON key."""

    progress: Progress
    output_prefixes: dict
    token_dtype: type


def output_prefix_for(output_prefix: str, key: str) -> str:
    """The ``--data-path`` prefix of the dataset written for ``key``."""
    return f"{output_prefix}_{key}_{OUTPUT_LEVEL}"


class _LineEncoder:
    """Turns one raw JSONL line into token ids per key, or an error message; no I/O of its own."""

    def __init__(self, config: PreprocessConfig):
        from megatron.training.tokenizer import build_tokenizer

        self.keys = config.json_keys
        self.append_eod = config.append_eod
        self.tokenizer = build_tokenizer(
            config.tokenizer_type, vocab_size=config.vocab_size,
            tokenizer_model=config.tokenizer_model, vocab_file=config.vocab_file,
            merge_file=config.merge_file,
        )

    def encode(self, numbered_line: tuple[int, bytes]):
        """Returns ``(line_number, ids_per_key or None for a blank line, n_bytes, error or None)``."""
        line_number, raw = numbered_line
        try:
            return line_number, self._encode(raw), len(raw), None
        except ValueError as error:  # JSON, UTF-8 and tokenizer errors are all ValueErrors
            return line_number, None, len(raw), str(error)

    def _encode(self, raw: bytes) -> Optional[dict]:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"invalid UTF-8 at byte {error.start} of the line") from None
        if not text.strip():
            return None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as error:
            # Some json messages end in " at" (they expect a position after them).
            reason = error.msg.removesuffix(" at")
            raise ValueError(
                f"invalid JSON at column {error.colno} ({reason}); expected one JSON object per line"
            ) from None
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object, found a JSON {type(obj).__name__}")
        ids = {}
        for key in self.keys:
            if key not in obj:
                found = ", ".join(repr(k) for k in list(obj)[:10]) or "none"
                raise ValueError(f"missing key {key!r} (keys found: {found}); choose fields with --json-keys")
            value = obj[key]
            if not isinstance(value, str):
                raise ValueError(f"key {key!r} must hold a string, found a JSON {type(value).__name__}")
            tokens = self.tokenizer.tokenize(value)
            if tokens and self.append_eod:
                tokens.append(self.tokenizer.eod)
            ids[key] = tokens
        return ids


_WORKER_ENCODER: Optional[_LineEncoder] = None


def _init_worker(config: PreprocessConfig) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = _LineEncoder(config)


def _encode_in_worker(numbered_line):
    return _WORKER_ENCODER.encode(numbered_line)


def _numbered_lines(path: str) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            yield number, raw


def _check_config(config: PreprocessConfig) -> None:
    if not os.path.isfile(config.input_path):
        raise ToolInputError("input file not found (expected a JSONL file)", path=config.input_path)
    if not config.json_keys:
        raise ToolInputError("--json-keys needs at least one key")
    if config.workers < 1:
        raise ToolInputError(f"--workers must be >= 1, got {config.workers}")
    out_dir = os.path.dirname(os.path.abspath(config.output_prefix))
    if not os.path.isdir(out_dir):
        raise ToolInputError("output directory does not exist; create it first", path=out_dir)


def preprocess_jsonl(
    config: PreprocessConfig, on_progress: Optional[Callable[[Progress], None]] = None
) -> PreprocessResult:
    """Tokenize ``config.input_path`` and write one indexed dataset per JSON key.

    Raises ``ToolInputError`` naming ``file:line`` for the first bad line; ``on_progress`` is called
    every ``log_interval`` lines and once at the end.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    _check_config(config)
    try:
        encoder = _LineEncoder(config)  # also validates the tokenizer options before any worker starts
    except ValueError as error:
        raise ToolInputError(str(error)) from None
    vocab_size = encoder.tokenizer.vocab_size
    dtype = DType.optimal_dtype(vocab_size)
    prefixes = {key: output_prefix_for(config.output_prefix, key) for key in config.json_keys}
    tmp = {key: (f"{p}.bin.tmp", f"{p}.idx.tmp") for key, p in prefixes.items()}
    builders = {key: IndexedDatasetBuilder(tmp[key][0], dtype=dtype) for key in config.json_keys}
    progress = Progress(tokens={key: 0 for key in config.json_keys})
    start = time.monotonic()
    pool = None
    try:
        if config.workers == 1:
            encoded = map(encoder.encode, _numbered_lines(config.input_path))
        else:
            pool = multiprocessing.get_context("fork").Pool(
                config.workers, initializer=_init_worker, initargs=(config,)
            )
            encoded = pool.imap(_encode_in_worker, _numbered_lines(config.input_path), config.chunk_size)
        for line_number, ids, n_bytes, error in encoded:
            if error is not None:
                raise ToolInputError(error, path=config.input_path, line=line_number)
            progress.lines = line_number
            progress.bytes_read += n_bytes
            if ids is not None:
                _add_document(builders, ids, progress, vocab_size, config.input_path, line_number)
            if on_progress and line_number % config.log_interval == 0:
                progress.seconds = time.monotonic() - start
                on_progress(progress)
        if progress.documents == 0:
            raise ToolInputError("no non-empty documents found", path=config.input_path)
        for key, builder in builders.items():
            builder.finalize(tmp[key][1])
    except BaseException:
        for key, builder in builders.items():
            builder.data_file.close()
            for path in tmp[key]:
                if os.path.exists(path):
                    os.remove(path)
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    for key, prefix in prefixes.items():
        # .bin first: a reader checks for the .idx, so the pair is complete once the .idx exists.
        os.replace(tmp[key][0], f"{prefix}.bin")
        os.replace(tmp[key][1], f"{prefix}.idx")
    progress.seconds = time.monotonic() - start
    if on_progress:
        on_progress(progress)
    return PreprocessResult(progress=progress, output_prefixes=prefixes, token_dtype=dtype)


def _add_document(builders, ids: dict, progress: Progress, vocab_size: int, path: str, line: int):
    if all(len(tokens) == 0 for tokens in ids.values()):
        # megatron-core's GPTDataset cannot sample from a zero-length document; skip and count it.
        progress.empty_documents += 1
        return
    for key, tokens in ids.items():
        if tokens and not 0 <= min(tokens) <= max(tokens) < vocab_size:
            raise ToolInputError(
                f"tokenizer produced id {max(tokens)} outside its vocabulary of {vocab_size}", path, line
            )
        builders[key].add_document(numpy.asarray(tokens, dtype=numpy.int64), [len(tokens)])
        progress.tokens[key] += len(tokens)
    progress.documents += 1
