"""Offline tokenizers usable by megatron-core's GPT datasets and by ``tools/preprocess_data.py``.

megatron-core's ``GPTDataset`` reads ``vocab_size``, ``eod``, ``pad`` and ``unique_identifiers``
from ``GPTDatasetConfig.tokenizer``; the preprocessing tool calls ``tokenize``. Both tokenizers here
need no files and no network, so a fresh machine can build data and train without downloads.
"""
from __future__ import annotations

import enum
from collections import OrderedDict
from typing import Iterable, Optional


class TokenizerType(str, enum.Enum):
    """Tokenizer choices for ``--tokenizer-type`` (Megatron-LM spelling)."""

    NULL = "NullTokenizer"
    BYTE_LEVEL = "ByteLevelTokenizer"


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


def build_tokenizer(
    tokenizer_type: str,
    vocab_size: Optional[int] = None,
    tokenizer_model: Optional[str] = None,
) -> _OfflineTokenizer:
    """Build one of the offline tokenizers by its Megatron-LM ``--tokenizer-type`` name.

    ``vocab_size`` is required by NullTokenizer (ids in the text, eod excluded) and must be left
    unset or 256 for ByteLevelTokenizer; ``tokenizer_model`` is accepted for interface parity with
    Megatron-LM but no offline tokenizer needs a model file.
    """
    choices = [t.value for t in TokenizerType]
    try:
        kind = TokenizerType(tokenizer_type)
    except ValueError:
        raise ValueError(
            f"unknown --tokenizer-type {tokenizer_type!r}; expected one of {', '.join(choices)}"
        ) from None
    if tokenizer_model is not None:
        raise ValueError(
            f"--tokenizer-model is not used by {kind.value} (it needs no files); got {tokenizer_model!r}"
        )
    if kind is TokenizerType.NULL:
        return NullTokenizer(vocab_size)
    if vocab_size not in (None, ByteLevelTokenizer.NUM_BYTES):
        raise ValueError(
            f"ByteLevelTokenizer has a fixed vocabulary of 256 bytes (+ eod); "
            f"--vocab-size {vocab_size} does not apply (leave it unset)"
        )
    return ByteLevelTokenizer()
