"""Offline tokenizers usable by megatron-core's GPT datasets and by ``tools/preprocess_data.py``.

megatron-core's ``GPTDataset`` reads ``vocab_size``, ``eod``, ``pad`` and ``unique_identifiers``
from ``GPTDatasetConfig.tokenizer``; the preprocessing tool calls ``tokenize``. None needs the
network: NullTokenizer and ByteLevelTokenizer need no files, GPT2BPETokenizer reads the
``--vocab-file`` and ``--merge-file`` it is given (GPT-2's byte-level BPE, as Megatron-LM's), and
HuggingFaceTokenizer a local ``--tokenizer-model`` directory through Hugging Face transformers
(an optional dependency, never a download).
"""
from __future__ import annotations

import enum
import hashlib
import json
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Tuple


class TokenizerType(str, enum.Enum):
    """Tokenizer choices for ``--tokenizer-type`` (Megatron-LM spelling)."""

    NULL = "NullTokenizer"
    BYTE_LEVEL = "ByteLevelTokenizer"
    GPT2_BPE = "GPT2BPETokenizer"
    HUGGING_FACE = "HuggingFaceTokenizer"


# The dataset code fills padded label positions with ``pad`` and then masks them out of the loss.
# -1 is never a real token id, so padding can never be confused with eod or a byte.
_NO_PAD_ID = -1


class _OfflineTokenizer:
    """Common surface: what megatron-core's datasets and our preprocessing tool read."""

    vocab_size: int
    eod: int

    @property
    def pad(self) -> int:
        return _NO_PAD_ID

    @property
    def eos(self) -> int:
        # Megatron-LM GPT tokenizers use the same id for end-of-document and end-of-sequence.
        return self.eod

    @property
    def unique_identifiers(self) -> OrderedDict:
        """Part of the dataset cache key megatron-core hashes; changes when the vocabulary does."""
        return OrderedDict(
            [("class", type(self).__name__), ("vocab_size", self.vocab_size), ("eod", self.eod)]
        )

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids: Iterable[int]) -> str:
        raise NotImplementedError


class NullTokenizer(_OfflineTokenizer):
    """Megatron-LM's NullTokenizer: the text already holds space-separated integer ids.

    With ``--vocab-size V`` the ids ``0..V-1`` are the text's tokens, ``eod == V`` and the model's
    vocabulary is ``V + 1`` (before padding to a multiple of the TP size).
    """

    def __init__(self, vocab_size: int):
        if vocab_size is None or int(vocab_size) <= 0:
            raise ValueError(
                f"NullTokenizer needs --vocab-size > 0 (the number of ids in the text); got {vocab_size!r}"
            )
        self._ids_without_eod = int(vocab_size)
        self.eod = self._ids_without_eod
        self.vocab_size = self._ids_without_eod + 1

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            try:
                token = int(word)
            except ValueError:
                raise ValueError(
                    f"NullTokenizer expects space-separated integer ids, found {word[:40]!r}"
                ) from None
            if not 0 <= token < self._ids_without_eod:
                raise ValueError(
                    f"NullTokenizer: id {token} is outside 0..{self._ids_without_eod - 1} "
                    f"(--vocab-size {self._ids_without_eod})"
                )
            ids.append(token)
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class ByteLevelTokenizer(_OfflineTokenizer):
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 is end-of-document; vocabulary 257.

    Unlike megatron-core's byte-level tokenizer (eod 0, which collides with the NUL byte), eod here
    is a separate id, so documents containing any byte stay distinguishable from their boundaries.
    """

    NUM_BYTES = 256

    def __init__(self) -> None:
        self.eod = self.NUM_BYTES
        self.vocab_size = self.NUM_BYTES + 1

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        # eod marks document boundaries; render it as a newline so detokenized corpora stay readable.
        data = bytearray()
        for i in ids:
            i = int(i)
            if i == self.eod:
                data.extend(b"\n")
            elif 0 <= i < self.NUM_BYTES:
                data.append(i)
            else:
                raise ValueError(f"ByteLevelTokenizer: id {i} is outside 0..{self.eod}")
        return data.decode("utf-8", errors="replace")


#: GPT-2's pre-tokenization (OpenAI's encoder, Megatron-LM's GPT2BPETokenizer): English
#: contractions, a run of letters, of digits or of other symbols (each with one leading space),
#: whitespace. \p{L}/\p{N} are Unicode classes: the `regex` package reads them, `re` does not.
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _byte_symbols() -> Dict[int, str]:
    """GPT-2's byte -> symbol table: the printable Latin-1 bytes stand for themselves, the others
    (control bytes, space, ...) for the characters from U+0100 on, in byte order; so every byte
    string is a string of printable symbols that the vocabulary and merges spell."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(0x100 + shifted)
            shifted += 1
    return table


def merge_pair(symbols: List[str], pair: Tuple[str, str]) -> List[str]:
    """`symbols` with each adjacent occurrence of `pair` merged into one symbol, left to right
    (one step of byte-level BPE, in encoding and in learning merges alike)."""
    merged, i = [], 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            merged.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            merged.append(symbols[i])
            i += 1
    return merged


class GPT2BPETokenizer(_OfflineTokenizer):
    """Megatron-LM's GPT2BPETokenizer: GPT-2's byte-level BPE from a ``vocab.json`` (symbol ->
    id) and a ``merges.txt`` (one merge per line, best first); end of document is
    ``<|endoftext|>``, the vocabulary its ids (50257 for GPT-2's files). Training reads only the
    vocabulary (size and end of document); `tokenize` (preprocessing) also the merges."""

    END_OF_TEXT = "<|endoftext|>"

    def __init__(self, vocab_file: Optional[str], merge_file: Optional[str]):
        if vocab_file is None or merge_file is None:
            raise ValueError("GPT2BPETokenizer needs --vocab-file (GPT-2's vocab.json) and "
                             "--merge-file (its merges.txt); got "
                             f"--vocab-file {vocab_file!r} --merge-file {merge_file!r}")
        self.vocab_file, self.merge_file = vocab_file, merge_file
        self.encoder = self._read_vocab(vocab_file)
        if self.END_OF_TEXT not in self.encoder:
            raise ValueError(f"--vocab-file {vocab_file}: no {self.END_OF_TEXT} entry, which "
                             "GPT-2's vocabulary ends documents with")
        self.decoder = {i: symbol for symbol, i in self.encoder.items()}
        self.vocab_size = len(self.encoder)
        self.eod = self.encoder[self.END_OF_TEXT]
        try:  # read now: a wrong path fails at start, not in preprocessing's workers
            with open(merge_file, "rb") as f:
                self._merges_bytes = f.read()
        except OSError as err:
            raise ValueError(f"--merge-file {merge_file}: cannot read GPT-2's merges.txt: "
                             f"{err}") from None
        self._ranks: Optional[Dict[Tuple[str, str], int]] = None
        self._symbols = _byte_symbols()
        self._bytes_of = {symbol: byte for byte, symbol in self._symbols.items()}
        self._words: Dict[str, List[int]] = {}
        self._pattern = None

    @staticmethod
    def _read_vocab(path: str) -> Dict[str, int]:
        try:
            with open(path, encoding="utf-8") as f:
                vocab = json.load(f)
        except (OSError, ValueError) as err:
            raise ValueError(f"--vocab-file {path}: cannot read it as GPT-2's vocab.json (a JSON "
                             f"object of symbol -> id): {err}") from None
        if not isinstance(vocab, dict) or not all(
                isinstance(k, str) and isinstance(v, int) for k, v in vocab.items()):
            raise ValueError(f"--vocab-file {path}: expected a JSON object of symbol -> integer "
                             "id (GPT-2's vocab.json)")
        if sorted(vocab.values()) != list(range(len(vocab))):
            raise ValueError(f"--vocab-file {path}: its ids are not 0..{len(vocab) - 1}, each "
                             "once")
        return vocab

    @property
    def unique_identifiers(self) -> OrderedDict:
        """The dataset cache key part: the files' contents, not only their sizes."""
        ids = super().unique_identifiers
        digest = hashlib.sha256()
        with open(self.vocab_file, "rb") as f:
            digest.update(f.read())
        digest.update(self._merges_bytes)
        ids["files_sha256"] = digest.hexdigest()
        return ids

    def _merge_ranks(self) -> Dict[Tuple[str, str], int]:
        if self._ranks is None:
            ranks = {}
            lines = self._merges_bytes.decode("utf-8").splitlines()
            for number, line in enumerate(lines, 1):
                if not line.strip() or (number == 1 and line.startswith("#version")):
                    continue
                pair = line.split()
                if len(pair) != 2:
                    raise ValueError(f"--merge-file {self.merge_file}, line {number}: expected "
                                     f"two symbols separated by a space, found {line[:60]!r}")
                ranks.setdefault((pair[0], pair[1]), len(ranks))
            self._ranks = ranks
        return self._ranks

    def _bpe(self, word: str) -> List[str]:
        """GPT-2's merging of one pre-token's symbols: the pair of best (lowest) rank is merged
        wherever it occurs, left to right, until no pair of the merges remains."""
        ranks = self._merge_ranks()
        symbols = list(word)
        while len(symbols) > 1:
            ranked = [(ranks[pair], pair) for pair in zip(symbols, symbols[1:]) if pair in ranks]
            if not ranked:
                break
            symbols = merge_pair(symbols, min(ranked)[1])
        return symbols

    def tokenize(self, text: str) -> List[int]:
        if self._pattern is None:
            try:
                import regex
            except ImportError:
                raise ValueError("GPT2BPETokenizer's tokenize needs the `regex` package (GPT-2's "
                                 "pattern uses Unicode classes that `re` lacks): pip install "
                                 "regex") from None
            self._pattern = regex.compile(_GPT2_PATTERN)
        ids = []
        for piece in self._pattern.findall(text):
            word = "".join(self._symbols[b] for b in piece.encode("utf-8"))
            if word not in self._words:
                try:
                    self._words[word] = [self.encoder[s] for s in self._bpe(word)]
                except KeyError as err:
                    raise ValueError(f"GPT2BPETokenizer: the merges make {err.args[0]!r}, which "
                                     f"--vocab-file {self.vocab_file} lacks (the files are not a "
                                     "pair)") from None
            ids.extend(self._words[word])
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        try:
            symbols = "".join(self.decoder[int(i)] for i in ids)
        except KeyError as err:
            raise ValueError(f"GPT2BPETokenizer: id {err.args[0]} is outside "
                             f"0..{self.vocab_size - 1}") from None
        return bytes(self._bytes_of[c] for c in symbols).decode("utf-8", errors="replace")


class HuggingFaceTokenizer(_OfflineTokenizer):
    """Megatron-LM's HuggingFaceTokenizer: ``transformers.AutoTokenizer`` from a local directory
    (``--tokenizer-model``, e.g. a Llama 3 model's tokenizer files), read without the network
    and without running code from it (no ``trust_remote_code``). Vocabulary: every id it has
    (``len(tokenizer)``); end of document: its end-of-sequence id; `tokenize` adds what the
    tokenizer adds by default (Llama's begin-of-text), as Megatron-LM's does. Padding stays -1
    (never a real id) rather than the tokenizer's pad id, which is often its end of sequence."""

    def __init__(self, tokenizer_model: Optional[str]):
        if tokenizer_model is None:
            raise ValueError("HuggingFaceTokenizer needs --tokenizer-model DIR (a local directory "
                             "with the tokenizer's files, e.g. tokenizer.json)")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ValueError("HuggingFaceTokenizer needs Hugging Face transformers: pip install "
                             "transformers") from None
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(tokenizer_model, local_files_only=True,
                                                            trust_remote_code=False)
        except (OSError, ValueError) as err:
            raise ValueError(f"--tokenizer-model {tokenizer_model}: transformers cannot load a "
                             f"tokenizer from it without the network: {str(err)[:300]}") from None
        self.tokenizer_model = tokenizer_model
        self.vocab_size = len(self._tokenizer)
        if self._tokenizer.eos_token_id is None:
            raise ValueError(f"--tokenizer-model {tokenizer_model}: the tokenizer names no "
                             "end-of-sequence token, which ends documents")
        self.eod = int(self._tokenizer.eos_token_id)

    @property
    def unique_identifiers(self) -> OrderedDict:
        ids = super().unique_identifiers
        ids["tokenizer_model"] = self.tokenizer_model
        return ids

    def tokenize(self, text: str) -> List[int]:
        return list(self._tokenizer(text).input_ids)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids])


def build_tokenizer(
    tokenizer_type: str,
    vocab_size: Optional[int] = None,
    tokenizer_model: Optional[str] = None,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
) -> _OfflineTokenizer:
    """Build a tokenizer by its Megatron-LM ``--tokenizer-type`` name.

    ``vocab_size`` is required by NullTokenizer (ids in the text, eod excluded) and must be left
    unset or 256 for ByteLevelTokenizer; GPT2BPETokenizer reads ``vocab_file`` and
    ``merge_file`` and takes its size from them; HuggingFaceTokenizer loads ``tokenizer_model``
    (a local directory), which the others refuse.
    """
    choices = [t.value for t in TokenizerType]
    try:
        kind = TokenizerType(tokenizer_type)
    except ValueError:
        raise ValueError(
            f"unknown --tokenizer-type {tokenizer_type!r}; expected one of {', '.join(choices)}"
        ) from None
    if kind is TokenizerType.HUGGING_FACE:
        for flag, value in (("--vocab-size", vocab_size), ("--vocab-file", vocab_file),
                            ("--merge-file", merge_file)):
            if value is not None:
                raise ValueError(f"HuggingFaceTokenizer's vocabulary is --tokenizer-model's; "
                                 f"{flag} {value} does not apply (leave it unset)")
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_model is not None:
        raise ValueError(
            f"--tokenizer-model is not used by {kind.value} (it reads no model file); got "
            f"{tokenizer_model!r}"
        )
    if kind is TokenizerType.GPT2_BPE:
        if vocab_size is not None:
            raise ValueError(f"GPT2BPETokenizer's vocabulary is --vocab-file's; --vocab-size "
                             f"{vocab_size} does not apply (leave it unset)")
        return GPT2BPETokenizer(vocab_file, merge_file)
    for flag, value in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
        if value is not None:
            raise ValueError(f"{flag} is read by GPT2BPETokenizer, not by {kind.value}; got "
                             f"{value!r}")
    if kind is TokenizerType.NULL:
        return NullTokenizer(vocab_size)
    if vocab_size not in (None, ByteLevelTokenizer.NUM_BYTES):
        raise ValueError(
            f"ByteLevelTokenizer has a fixed vocabulary of 256 bytes (+ eod); "
            f"--vocab-size {vocab_size} does not apply (leave it unset)"
        )
    return ByteLevelTokenizer()
