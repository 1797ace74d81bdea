"""Unit tests of the offline tokenizers (no process group)."""
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
        build_tokenizer("GPT2BPETokenizer")
    assert "NullTokenizer" in str(err.value) and "ByteLevelTokenizer" in str(err.value)


def test_pad_is_never_a_real_token_and_identifiers_are_hashable_for_the_dataset_cache():
    import json

    for tok in (build_tokenizer("NullTokenizer", vocab_size=5), build_tokenizer("ByteLevelTokenizer")):
        assert tok.pad < 0
        assert tok.pad != tok.eod
        json.dumps(tok.unique_identifiers)
