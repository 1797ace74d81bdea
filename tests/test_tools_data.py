"""Data tools: JSONL -> megatron-core indexed dataset -> GPT dataset samples; corpus builder."""
import json
import os
import subprocess
import sys

import numpy
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.training.tokenizer import build_tokenizer
from tools import preprocess_data
from tools.corpus import CorpusConfig, CorpusSource, build_corpus
from tools.errors import ToolInputError
from tools.jsonl_to_indexed import PreprocessConfig, preprocess_jsonl

DOCS = [
    "Hello, world.",
    "Ünïcödé ✓ and a tab\there",
    "x",
    'quotes " and \\ backslashes',
]


def _write_jsonl(path, records, blank_lines_after=()):
    with open(path, "w", encoding="utf-8") as f:
        for i, record in enumerate(records):
            f.write(json.dumps(record) + "\n")
            if i in blank_lines_after:
                f.write("\n")


def _preprocess(tmp_path, docs, **overrides):
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"text": d, "other": 1} for d in docs], blank_lines_after={1})
    cfg = dict(input_path=str(src), output_prefix=str(tmp_path / "out"),
               tokenizer_type="ByteLevelTokenizer", append_eod=True)
    cfg.update(overrides)
    return preprocess_jsonl(PreprocessConfig(**cfg))


def test_round_trip_byte_level_tokens_plus_eod(tmp_path):
    result = _preprocess(tmp_path, DOCS)
    prefix = result.output_prefixes["text"]
    assert prefix == str(tmp_path / "out_text_document")
    ds = IndexedDataset(prefix)
    tok = build_tokenizer("ByteLevelTokenizer")
    assert len(ds) == len(DOCS)
    assert ds.index.dtype == numpy.uint16  # vocabulary 257 fits 16 bits
    for i, doc in enumerate(DOCS):
        assert ds[i].tolist() == list(doc.encode("utf-8")) + [tok.eod]
    assert ds.document_indices.tolist() == list(range(len(DOCS) + 1))
    assert result.progress.documents == len(DOCS)
    assert result.progress.tokens["text"] == sum(len(d.encode()) + 1 for d in DOCS)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_workers_produce_identical_files_and_no_eod_without_flag(tmp_path):
    docs = [f"document {i} " * (i % 7 + 1) for i in range(300)]
    for sub in ("a", "b", "c"):
        os.makedirs(tmp_path / sub)
    one = _preprocess(tmp_path / "a", docs, workers=1)
    two = _preprocess(tmp_path / "b", docs, workers=2)
    for ext in (".bin", ".idx"):
        a = open(one.output_prefixes["text"] + ext, "rb").read()
        b = open(two.output_prefixes["text"] + ext, "rb").read()
        assert a == b
    no_eod = _preprocess(tmp_path / "c", docs[:3], append_eod=False)
    ds = IndexedDataset(no_eod.output_prefixes["text"])
    assert [ds[i].tolist() for i in range(3)] == [list(d.encode()) for d in docs[:3]]


def test_null_tokenizer_ids_and_wide_dtype(tmp_path):
    docs = ["0 69999 5", "12 13"]
    result = _preprocess(tmp_path, docs, tokenizer_type="NullTokenizer", vocab_size=70000)
    ds = IndexedDataset(result.output_prefixes["text"])
    assert ds.index.dtype == numpy.int32  # 70001 ids do not fit uint16
    assert ds[0].tolist() == [0, 69999, 5, 70000]
    assert ds[1].tolist() == [12, 13, 70000]


def test_multiple_json_keys_write_one_dataset_each(tmp_path):
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"text": "ab", "title": "T"}, {"text": "c", "title": "UV"}])
    result = preprocess_jsonl(PreprocessConfig(
        input_path=str(src), output_prefix=str(tmp_path / "o"), tokenizer_type="ByteLevelTokenizer",
        json_keys=("text", "title")))
    # Keep the datasets referenced: their __del__ unmaps the buffer the returned arrays view.
    titles, texts = (IndexedDataset(result.output_prefixes[k]) for k in ("title", "text"))
    assert titles[1].tolist() == list(b"UV") and texts[0].tolist() == list(b"ab")


def _expect_error(tmp_path, lines, match, **overrides):
    src = tmp_path / "bad.jsonl"
    src.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    cfg = dict(input_path=str(src), output_prefix=str(tmp_path / "out"),
               tokenizer_type="ByteLevelTokenizer")
    cfg.update(overrides)
    with pytest.raises(ToolInputError, match=match) as info:
        preprocess_jsonl(PreprocessConfig(**cfg))
    # A failed run leaves nothing a training run could mistake for a dataset.
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]
    return info.value


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_json_line_is_reported_with_file_and_line(tmp_path, workers):
    error = _expect_error(tmp_path, ['{"text": "ok"}', "", '{"text": "broken'], r"bad\.jsonl:3: invalid JSON",
                          workers=workers)
    assert error.line == 3 and error.path.endswith("bad.jsonl")


def test_missing_key_non_string_and_non_object_are_reported(tmp_path):
    _expect_error(tmp_path, ['{"text": "a"}', '{"body": "b"}'], r"bad\.jsonl:2: missing key 'text' \(keys found: 'body'\)")
    _expect_error(tmp_path, ['{"text": 5}'], r":1: key 'text' must hold a string, found a JSON int")
    _expect_error(tmp_path, ['["text"]'], r":1: expected a JSON object, found a JSON list")
    _expect_error(tmp_path, ['{"text": "1 2 x"}'], r":1: NullTokenizer expects space-separated integer ids",
                  tokenizer_type="NullTokenizer", vocab_size=10)
    _expect_error(tmp_path, ['{"text": ""}'], r"no non-empty documents")


def test_cli_prints_data_path_and_reports_errors(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"text": "abc"}])
    rc = preprocess_data.main(["--input", str(src), "--output-prefix", str(tmp_path / "d"),
                               "--tokenizer-type", "ByteLevelTokenizer", "--append-eod"])
    out, err = capsys.readouterr()
    assert rc == 0 and out.strip() == str(tmp_path / "d_text_document")
    assert "Processed 1 lines: 1 documents, 4 tokens" in err
    rc = preprocess_data.main(["--input", str(tmp_path / "missing.jsonl"), "--output-prefix",
                               str(tmp_path / "d"), "--tokenizer-type", "ByteLevelTokenizer"])
    out, err = capsys.readouterr()
    assert rc == 2 and "missing.jsonl: input file not found" in err and out == ""
    rc = preprocess_data.main(["--input", str(src), "--output-prefix", str(tmp_path / "d"),
                               "--tokenizer-type", "SentencePieceTokenizer"])
    assert rc == 2 and "unknown --tokenizer-type 'SentencePieceTokenizer'" in capsys.readouterr().err


def test_gpt_dataset_builder_reads_the_output(tmp_path):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    # 100 distinguishable documents; split 98,2,0 gives the last two to validation.
    docs = [f"<doc{i:03d}>" + "abcdefghij"[i % 10] * (20 + i % 13) for i in range(100)]
    result = _preprocess(tmp_path, docs)
    tok = build_tokenizer("ByteLevelTokenizer")
    seq_length = 32
    config = GPTDatasetConfig(
        random_seed=1234, sequence_length=seq_length, blend=([result.output_prefixes["text"]], None),
        split="98,2,0", tokenizer=tok, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, path_to_cache=str(tmp_path / "cache"))
    train, valid, test = BlendedMegatronDatasetBuilder(
        GPTDataset, [40, 8, None], lambda: True, config).build()
    assert test is None and len(train) >= 40 and len(valid) >= 8
    doc_bytes = [d.encode() for d in docs]
    for dataset, allowed in ((train, doc_bytes[:98]), (valid, doc_bytes[98:])):
        for i in range(len(dataset)):
            sample = dataset[i]
            tokens, labels = sample["tokens"], sample["labels"]
            assert tokens.shape == labels.shape == (seq_length,)
            window = tokens.tolist() + labels[-1:].tolist()  # the seq_length + 1 tokens read
            assert window[1:] == labels.tolist()
            for piece in bytes_pieces(window, tok.eod):
                assert any(piece in d for d in allowed), (i, piece)


def bytes_pieces(window, eod):
    """The eod-free runs of a window, as bytes: each must come from one document."""
    pieces, current = [], []
    for t in window:
        if t == eod:
            pieces.append(bytes(current))
            current = []
        else:
            current.append(t)
    pieces.append(bytes(current))
    return [p for p in pieces if p]


FAKE_MODULE = '''"""Module docstring that is long enough to keep."""
import sys
if sys.platform == "win32":
    def hidden():
        """Docstring of a function defined under an if block."""
else:
    class Shown:
        """Class docstring."""
        def method(self):
            """Method docstring."""
'''


def _fake_install(tmp_path):
    lib = tmp_path / "lib"
    os.makedirs(lib / "pkg")
    os.makedirs(lib / "test")
    (lib / "pkg" / "__init__.py").write_text(FAKE_MODULE)
    (lib / "test" / "test_x.py").write_text('"""Test suites are skipped entirely, docstrings too."""')
    (lib / "zz_broken.py").write_text('"""Valid docstring."""\nprint "py2 syntax"\n')
    lic = tmp_path / "licenses"
    os.makedirs(lic / "sub")
    (lic / "B").write_text("second license text")
    (lic / "A").write_text("first license text")
    (lic / "sub" / "C").write_text("short")
    os.symlink(lic / "A", lic / "A-link")
    return lib, lic


def test_corpus_is_deterministic_in_source_order(tmp_path):
    lib, lic = _fake_install(tmp_path)
    cfg = dict(sources=(CorpusSource.STDLIB_DOCSTRINGS, CorpusSource.LICENSES), stdlib_dir=str(lib),
               licenses_dir=str(lic), min_chars=10)
    first = build_corpus(CorpusConfig(output_path=str(tmp_path / "c1.jsonl"), **cfg))
    second = build_corpus(CorpusConfig(output_path=str(tmp_path / "c2.jsonl"), **cfg))
    assert open(tmp_path / "c1.jsonl", "rb").read() == open(tmp_path / "c2.jsonl", "rb").read()
    assert first.sha256 == second.sha256
    records = [json.loads(line) for line in open(tmp_path / "c1.jsonl", encoding="utf-8")]
    assert [r["source"] for r in records] == [
        "stdlib:pkg/__init__.py:<module>", "stdlib:pkg/__init__.py:hidden", "stdlib:pkg/__init__.py:Shown",
        "stdlib:pkg/__init__.py:Shown.method", "licenses:A", "licenses:B"]  # sorted; link and short skipped
    assert records[2]["text"] == "Class docstring."
    assert first.skipped_files == ["zz_broken.py: SyntaxError"]


def test_real_stdlib_corpus_feeds_the_preprocessor(tmp_path):
    stats = build_corpus(CorpusConfig(output_path=str(tmp_path / "s.jsonl"), max_documents=20, min_chars=50))
    assert stats.documents == 20
    texts = [json.loads(line)["text"] for line in open(tmp_path / "s.jsonl", encoding="utf-8")]
    assert all(len(t) >= 50 for t in texts)
    result = preprocess_jsonl(PreprocessConfig(
        input_path=str(tmp_path / "s.jsonl"), output_prefix=str(tmp_path / "s"),
        tokenizer_type="ByteLevelTokenizer", append_eod=True))
    ds = IndexedDataset(result.output_prefixes["text"])
    assert [bytes(ds[i][:-1].tolist()).decode() for i in range(20)] == texts


def test_corpus_errors_are_clear(tmp_path):
    with pytest.raises(ToolInputError, match="license directory not found"):
        build_corpus(CorpusConfig(output_path=str(tmp_path / "c.jsonl"), sources=(CorpusSource.LICENSES,),
                                  licenses_dir=str(tmp_path / "nope")))
    with pytest.raises(ToolInputError, match="output directory does not exist"):
        build_corpus(CorpusConfig(output_path=str(tmp_path / "no" / "c.jsonl")))
    assert not os.path.exists(tmp_path / "c.jsonl")


def test_prepare_data_example_prints_a_usable_data_path(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(["bash", os.path.join(root, "examples", "prepare_data_cpu.sh"), str(tmp_path), "30"],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    data_path = proc.stdout.strip().splitlines()[-1]
    assert data_path == str(tmp_path / "corpus_text_document")
    ds = IndexedDataset(data_path)
    assert len(ds) == 30 and int(ds[0][-1]) == build_tokenizer("ByteLevelTokenizer").eod
