"""Build a small JSONL training corpus from text already installed on this machine.

We ship no one else's text: the corpus is made at run time from the docstrings of the Python
standard library running this code (read with ``ast``, never imported: importing ``antigravity``
opens a browser) and/or the license texts under ``/usr/share/common-licenses``.

Invariant: for the same installed files and the same config the output is byte-identical
(sorted file walk, source-order traversal, ``sort_keys`` JSON); ``sha256`` in the result lets
two machines check that they hold the same corpus.
"""
from __future__ import annotations

import ast
import enum
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass, field
from typing import Iterator, Optional

from tools.errors import ToolInputError

# Test suites and vendored packages hold fixtures in other encodings or Python versions.
_SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


class CorpusSource(str, enum.Enum):
    """Where documents come from."""

    STDLIB_DOCSTRINGS = "stdlib"
    LICENSES = "licenses"


@dataclass(frozen=True)
class CorpusConfig:
    """What to collect and where to write it."""

    output_path: str
    """JSONL file to write (replaced atomically)."""
    sources: tuple[CorpusSource, ...] = (CorpusSource.STDLIB_DOCSTRINGS,)
    """Sources in output order."""
    min_chars: int = 200
    """Skip documents shorter than this (one-line docstrings teach little)."""
    max_documents: Optional[int] = None
    """Stop after this many documents (None: all)."""
    stdlib_dir: Optional[str] = None
    """Standard library root; None means this interpreter's."""
    licenses_dir: str = "/usr/share/common-licenses"
    """Directory of license texts, one document per file."""


@dataclass
class CorpusStats:
    """What was written."""

    documents: int = 0
    characters: int = 0
    skipped_files: list = field(default_factory=list)
    sha256: str = ""


def _walk_sorted(root: str) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for name in sorted(filenames):
            yield os.path.join(dirpath, name)


_DEFINITIONS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _docstrings(tree: ast.AST, qualname: str) -> Iterator[tuple[str, str]]:
    """Yields (qualified name, docstring) in source order."""
    if isinstance(tree, (ast.Module,) + _DEFINITIONS):
        doc = ast.get_docstring(tree, clean=True)
        if doc:
            yield qualname, doc
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, _DEFINITIONS):
            child = f"{qualname}.{node.name}" if qualname else node.name
            yield from _docstrings(node, child)
        elif isinstance(node, ast.stmt):
            # Definitions inside `if sys.platform ...:` / `try:` blocks keep the enclosing name.
            yield from _docstrings(node, qualname)


def _stdlib_documents(stdlib_dir: str, stats: CorpusStats) -> Iterator[tuple[str, str]]:
    for path in _walk_sorted(stdlib_dir):
        if not path.endswith(".py"):
            continue
        rel = os.path.relpath(path, stdlib_dir)
        try:
            with open(path, "rb") as f:
                tree = ast.parse(f.read(), filename=rel)
        except (SyntaxError, ValueError) as error:
            # A fixture for another Python version; record it so the skip is visible.
            stats.skipped_files.append(f"{rel}: {type(error).__name__}")
            continue
        for qualname, doc in _docstrings(tree, ""):
            yield f"stdlib:{rel}:{qualname or '<module>'}", doc


def _license_documents(licenses_dir: str, stats: CorpusStats) -> Iterator[tuple[str, str]]:
    if not os.path.isdir(licenses_dir):
        raise ToolInputError("license directory not found", path=licenses_dir)
    for path in _walk_sorted(licenses_dir):
        if os.path.islink(path):
            continue  # e.g. GPL -> GPL-3: the target is already in the walk
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            stats.skipped_files.append(f"{path}: not UTF-8")
            continue
        yield f"licenses:{os.path.relpath(path, licenses_dir)}", text.strip()


def build_corpus(config: CorpusConfig) -> CorpusStats:
    """Write the corpus to ``config.output_path``; returns counts and the file's sha256."""
    out_dir = os.path.dirname(os.path.abspath(config.output_path))
    if not os.path.isdir(out_dir):
        raise ToolInputError("output directory does not exist; create it first", path=out_dir)
    if not config.sources:
        raise ToolInputError("no corpus source selected")
    stats = CorpusStats()
    digest = hashlib.sha256()
    tmp_path = config.output_path + ".tmp"
    try:
        with open(tmp_path, "wb") as out:
            for source, text in _all_documents(config, stats):
                if len(text) < config.min_chars:
                    continue
                line = json.dumps({"source": source, "text": text}, sort_keys=True, ensure_ascii=False)
                data = (line + "\n").encode("utf-8")
                out.write(data)
                digest.update(data)
                stats.documents += 1
                stats.characters += len(text)
                if config.max_documents is not None and stats.documents >= config.max_documents:
                    break
        if stats.documents == 0:
            raise ToolInputError(f"no documents of at least {config.min_chars} characters found")
        os.replace(tmp_path, config.output_path)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
    stats.sha256 = digest.hexdigest()
    return stats


def _all_documents(config: CorpusConfig, stats: CorpusStats) -> Iterator[tuple[str, str]]:
    for source in config.sources:
        if source is CorpusSource.STDLIB_DOCSTRINGS:
            yield from _stdlib_documents(config.stdlib_dir or sysconfig.get_paths()["stdlib"], stats)
        elif source is CorpusSource.LICENSES:
            yield from _license_documents(config.licenses_dir, stats)
        else:  # an enum member added without a reader
            raise ToolInputError(f"corpus source {source!r} has no reader")
