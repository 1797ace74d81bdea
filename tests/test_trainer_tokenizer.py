"""Unit tests of the offline tokenizers (no process group)."""
import json

import pytest

from megatron.training.tokenizer import ByteLevelTokenizer, NullTokenizer, build_tokenizer


def test_null_tokenizer_follows_megatron_lm_semantics():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(tok, NullTokenizer)
    assert tok.eod == 100 and tok.vocab_size == 101
    assert tok.tokenize("3 14 15  92\n65") == [3, 14, 15, 92, 65]
    assert tok.detokenize([3, 14, 15]) == "3 14 15"


def test_null_tokenizer_rejects_bad_text_and_missing_vocab():
    tok = build_tokenizer("NullTokenizer", vocab_size=10)
    with pytest.raises(ValueError, match="outside 0..9"):
        tok.tokenize("1 10")
    with pytest.raises(ValueError, match="integer ids"):
        tok.tokenize("1 two")
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")


def test_byte_level_round_trips_utf8_and_keeps_eod_apart_from_bytes():
    tok = build_tokenizer("ByteLevelTokenizer")
    assert isinstance(tok, ByteLevelTokenizer)
    assert tok.vocab_size == 257 and tok.eod == 256
    text = "naïve \x00 café ✓"
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert 0 in ids and tok.eod not in ids
    assert tok.detokenize(ids) == text
    assert tok.detokenize(ids + [tok.eod]) == text + "\n"


def test_unknown_type_lists_the_choices():
    with pytest.raises(ValueError) as err:
        build_tokenizer("SentencePieceTokenizer")
    assert "NullTokenizer" in str(err.value) and "ByteLevelTokenizer" in str(err.value)


def test_pad_is_never_a_real_token_and_identifiers_are_hashable_for_the_dataset_cache():
    import json

    for tok in (build_tokenizer("NullTokenizer", vocab_size=5), build_tokenizer("ByteLevelTokenizer")):
        assert tok.pad < 0
        assert tok.pad != tok.eod
        json.dumps(tok.unique_identifiers)


GPT2_TEXTS = ["The quick brown fox jumps over the lazy dog.", "It's the dog's day, isn't it?  ",
              "café naïve 東京 🙂 ½ ² Ⅻ", "Numbers 12345 and 3.14159", "tabs\tand   spaces\n\n end",
              "they'll we've I'm you'd", "ABC xyz!!! ??? ...", "  leading and trailing  ", ""]


def test_gpt2_bpe_encodes_as_transformers_gpt2_tokenizer_does(tmp_path):
    """Megatron-LM's GPT2BPETokenizer (GPT-2's byte-level BPE) from a vocab.json and merges.txt:
    every text (contractions, Unicode letters and numbers, emojis, whitespace runs) gets the ids
    Hugging Face's GPT2Tokenizer gives on the same files, and decodes back to itself."""
    from transformers import GPT2Tokenizer

    from bpe_files import write_bpe_files
    from megatron.training.tokenizer import build_tokenizer

    vocab, merges = write_bpe_files(tmp_path)
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))
    theirs = GPT2Tokenizer(str(vocab), str(merges))
    assert (ours.vocab_size, ours.eod) == (len(theirs), theirs.eos_token_id)
    merged = 0
    for text in GPT2_TEXTS:
        ids = ours.tokenize(text)
        assert ids == theirs.encode(text), text
        assert ours.detokenize(ids) == text
        merged += sum(i >= 256 for i in ids)
    assert merged > 20  # the merges were used, not only byte symbols


def test_gpt2_bpe_files_are_checked(tmp_path):
    from bpe_files import write_bpe_files
    from megatron.training.tokenizer import build_tokenizer

    vocab, merges = write_bpe_files(tmp_path)
    with pytest.raises(ValueError, match="GPT2BPETokenizer needs --vocab-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab))
    with pytest.raises(ValueError, match="--vocab-size 100 does not apply"):
        build_tokenizer("GPT2BPETokenizer", 100, vocab_file=str(vocab), merge_file=str(merges))
    with pytest.raises(ValueError, match="--merge-file is read by GPT2BPETokenizer, not by "
                                         "ByteLevelTokenizer"):
        build_tokenizer("ByteLevelTokenizer", merge_file=str(merges))
    with pytest.raises(ValueError, match="cannot read GPT-2's merges.txt"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(tmp_path / "x"))
    no_end = tmp_path / "no_end.json"
    no_end.write_text(json.dumps({"a": 0, "b": 1}))
    with pytest.raises(ValueError, match="no <\\|endoftext\\|> entry"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(no_end), merge_file=str(merges))
    short = tmp_path / "short.json"  # the merges make symbols this vocabulary lacks
    short.write_text(json.dumps({**{chr(c): c - 33 for c in range(33, 127)},
                                 "<|endoftext|>": 94}))
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=str(short), merge_file=str(merges))
    with pytest.raises(ValueError, match="which --vocab-file .* lacks"):
        tokenizer.tokenize("the dog")


def test_hugging_face_tokenizer_loads_a_local_directory_offline(tmp_path):
    """Megatron-LM's HuggingFaceTokenizer: transformers' AutoTokenizer from a local directory
    (here GPT-2-format files saved by transformers), never the network: the same ids as
    GPT2BPETokenizer on the files it was saved from; what it cannot load is one clear error."""
    from transformers import GPT2Tokenizer

    from bpe_files import write_bpe_files
    from megatron.training.tokenizer import build_tokenizer

    vocab, merges = write_bpe_files(tmp_path / "files")
    GPT2Tokenizer(str(vocab), str(merges)).save_pretrained(str(tmp_path / "hf"))
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "hf"))
    bpe = build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))
    assert (hf.vocab_size, hf.eod) == (bpe.vocab_size, bpe.eod)
    for text in GPT2_TEXTS:
        assert hf.tokenize(text) == bpe.tokenize(text), text
        assert hf.detokenize(hf.tokenize(text)) == text
    assert hf.unique_identifiers["tokenizer_model"] == str(tmp_path / "hf")
    with pytest.raises(ValueError, match="needs --tokenizer-model DIR"):
        build_tokenizer("HuggingFaceTokenizer")
    with pytest.raises(ValueError, match="transformers cannot load a tokenizer from it without "
                                         "the network"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="--vocab-size 100 does not apply"):
        build_tokenizer("HuggingFaceTokenizer", 100, str(tmp_path / "hf"))


def test_vocab_and_merge_files_without_a_type_mean_gpt2_bpe(tmp_path):
    """Megatron-LM's pretrain_gpt.py defaults to GPT2BPETokenizer; here the two files choose it
    (without them NullTokenizer stays the default). Its vocabulary pads to TP * 128."""
    from bpe_files import write_bpe_files
    from megatron.training.arguments import build_run_config, parse_args

    vocab, merges = write_bpe_files(tmp_path)
    argv = ("--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 32 "
            "--micro-batch-size 2 --train-iters 2 --mock-data").split()
    config = build_run_config(parse_args(argv + ["--vocab-file", str(vocab), "--merge-file",
                                                 str(merges)]))
    assert config.data.tokenizer_type == "GPT2BPETokenizer"
    assert (config.model.vocab_size, config.model.padded_vocab_size) == (370, 384)
    assert build_run_config(parse_args(argv + ["--vocab-size", "50"])).data.tokenizer_type == \
        "NullTokenizer"
