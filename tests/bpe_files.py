"""Small GPT-2-format tokenizer files (vocab.json, merges.txt) for tests: the 256 byte symbols,
merges learned from a corpus the way BPE training does (the most frequent adjacent pair, ties by
the pair itself), and <|endoftext|> last. Real GPT-2 files are 1.5 MB and not on this machine."""
import collections
import json
from pathlib import Path

CORPUS = ("The quick brown fox jumps over the lazy dog. It's the dog's day, isn't it? Numbers "
          "12345 and 3.14159; café, naïve, Ünïcödé, 東京 and emojis 🙂🙃!\n\n  tabs\tand   "
          "spaces  ") * 3


def write_bpe_files(directory: Path, merges: int = 120, corpus: str = CORPUS):
    """(vocab.json, merges.txt) under `directory`."""
    import regex

    from megatron.training.tokenizer import _GPT2_PATTERN, _byte_symbols, merge_pair

    symbols = _byte_symbols()
    words = collections.Counter("".join(symbols[b] for b in piece.encode("utf-8"))
                                for piece in regex.findall(_GPT2_PATTERN, corpus))
    split = {word: list(word) for word in words}
    vocab = {symbols[b]: b for b in range(256)}
    learned = []
    for _ in range(merges):
        pairs = collections.Counter()
        for word, count in words.items():
            for pair in zip(split[word], split[word][1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = max(pairs, key=lambda pair: (pairs[pair], pair))
        learned.append(best)
        vocab[best[0] + best[1]] = len(vocab)
        for word, parts in split.items():
            split[word] = merge_pair(parts, best)
    vocab["<|endoftext|>"] = len(vocab)
    directory.mkdir(parents=True, exist_ok=True)
    vocab_file, merge_file = directory / "vocab.json", directory / "merges.txt"
    vocab_file.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merge_file.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in learned),
                          encoding="utf-8")
    return vocab_file, merge_file
