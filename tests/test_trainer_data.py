"""Real indexed data (.bin/.idx) through megatron-core's GPTDataset with our offline tokenizer."""
import numpy as np
import pytest
import torch

from trainer_launch import NO_DROPOUT, launch

from megatron.training.config import DataConfig, ModelConfig, TrainingConfig
from megatron.training.data import MicroBatchIterator, build_datasets
from megatron.training.tokenizer import build_tokenizer

DOCS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i % 5 + 1)
        for i in range(200)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path_factory.mktemp("corpus") / "docs_text_document")
    tok = build_tokenizer("ByteLevelTokenizer")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in DOCS:
        ids = tok.tokenize(doc) + [tok.eod]
        builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
    builder.finalize(prefix + ".idx")
    return prefix


def test_gpt_dataset_serves_corpus_tokens_in_dp_independent_order(corpus):
    data = DataConfig(data_path=(corpus,), split="90,10,0", tokenizer_type="ByteLevelTokenizer")
    model = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=1, ffn_hidden_size=32,
                        seq_length=32, max_position_embeddings=32, vocab_size=257,
                        padded_vocab_size=384)
    training = TrainingConfig(micro_batch_size=2, global_batch_size=4, train_iters=3,
                              eval_interval=3, eval_iters=1)
    ds = build_datasets(data, model, training)
    sample = ds.train[0]
    assert sample["tokens"].shape == (32,)
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    # Every stretch between end-of-document ids is a piece of some document of the corpus.
    ids = [int(t) for t in sample["tokens"]]
    stretches = [p for p in bytes(i if i < 256 else 0 for i in ids).split(b"\x00") if p]
    assert stretches and all(any(p.decode() in doc for doc in DOCS) for p in stretches)
    # The global batch is the same samples for DP=1 and DP=2 (rank 0 then rank 1).
    one = next(MicroBatchIterator(ds.train, 4, 2, 0, 1))["tokens"]
    dp0 = next(MicroBatchIterator(ds.train, 4, 1, 0, 2))["tokens"]
    dp1 = next(MicroBatchIterator(ds.train, 4, 1, 1, 2))["tokens"]
    assert torch.equal(one, torch.cat([dp0, dp1]))


def test_per_split_data_paths_give_each_split_its_own_data(corpus, tmp_path):
    """Megatron-LM's --train-data-path/--valid-data-path/--test-data-path: each split reads its
    own blend whole (no --split); a split without data is absent; the other splits' paths without
    a train path, or a prefix without its files, are refused naming the flag."""
    from megatron.training.arguments import ArgumentError, build_run_config, parse_args

    base = ("--num-layers 1 --hidden-size 8 --num-attention-heads 1 --seq-length 32 "
            "--micro-batch-size 2 --global-batch-size 4 --train-iters 3 --eval-interval 3 "
            "--eval-iters 1 --tokenizer-type ByteLevelTokenizer").split()
    config = build_run_config(parse_args(base + ["--train-data-path", corpus,
                                                 "--valid-data-path", "1", corpus]))
    assert (config.data.train_data_path, config.data.valid_data_path) == ((corpus,), ("1", corpus))
    ds = build_datasets(config.data, config.model, config.training)
    assert ds.train is not None and ds.valid is not None and ds.test is None
    assert torch.equal(ds.train[0]["tokens"], ds.valid[0]["tokens"])  # one corpus, read whole
    with pytest.raises(ArgumentError, match="--valid-data-path name the other splits' data; add "
                                            "--train-data-path"):
        build_run_config(parse_args(base + ["--valid-data-path", corpus]))
    with pytest.raises(ArgumentError, match="--test-data-path '/none': expected /none.bin"):
        build_run_config(parse_args(base + ["--train-data-path", corpus, "--test-data-path",
                                            "/none"]))


def test_training_on_indexed_data_with_byte_level_tokenizer(corpus):
    run = launch(1, ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
                     "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
                     "--train-iters", "3", "--lr", "1e-3", "--log-interval", "1",
                     "--eval-interval", "3", "--eval-iters", "1", "--data-path", corpus,
                     "--split", "90,10,0", "--tokenizer-type", "ByteLevelTokenizer"] + NO_DROPOUT)
    assert run.returncode == 0, run.describe()
    losses = run.losses()
    assert sorted(losses) == [1, 2, 3]
    # Byte-level vocab is padded to 384: the first loss is near ln(384) = 5.95.
    assert 5.0 < float(losses[1]) < 6.5
    assert sorted(run.validation()) == [3]


def test_training_on_gpt2_bpe_data_with_megatron_lms_gpt_flags(tmp_path):
    """GPT-2 BPE data as Megatron-LM's GPT examples give it: tools/preprocess_data.py with
    --tokenizer-type GPT2BPETokenizer --vocab-file --merge-file (2 workers), then a launch that
    names the two files and no --tokenizer-type, which then means GPT2BPETokenizer (Megatron-LM's
    pretrain_gpt.py default, which those examples rely on). Each document is its BPE ids and
    <|endoftext|>; the 370-id vocabulary pads to 384 (the first loss is near ln 384 = 5.95), and
    the checkpoint records the files. Megatron-LM's HuggingFaceTokenizer on a directory of the
    same tokenizer trains the same."""
    import json

    from bpe_files import write_bpe_files
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tools import preprocess_data

    vocab, merges = write_bpe_files(tmp_path / "gpt2")
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS), encoding="utf-8")
    files = ["--vocab-file", str(vocab), "--merge-file", str(merges)]
    assert preprocess_data.main(["--input", str(src), "--output-prefix", str(tmp_path / "bpe"),
                                 "--tokenizer-type", "GPT2BPETokenizer", "--append-eod",
                                 "--workers", "2"] + files) == 0
    prefix = str(tmp_path / "bpe_text_document")
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))
    stored = IndexedDataset(prefix)
    assert [stored[i].tolist() for i in (0, 199)] == [tok.tokenize(DOCS[i]) + [tok.eod]
                                                      for i in (0, 199)]
    save = tmp_path / "ckpt"
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
             "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--train-iters", "3", "--lr", "1e-3", "--log-interval", "1", "--eval-interval", "3",
             "--eval-iters", "1", "--data-path", prefix, "--split", "90,10,0"] + NO_DROPOUT
    run = launch(1, flags + files + ["--save", str(save), "--save-interval", "3"])
    assert run.returncode == 0, run.describe()
    assert sorted(run.losses()) == [1, 2, 3] and 5.0 < float(run.losses()[1]) < 6.5
    saved = json.loads((save / "run_config.json").read_text())
    assert saved["data"]["tokenizer_type"] == "GPT2BPETokenizer"
    assert saved["data"]["vocab_file"] == str(vocab) and saved["model"]["padded_vocab_size"] == 384
    # --use-checkpoint-args takes the tokenizer and its files from the checkpoint, as Megatron-LM
    # 0.16 takes its tokenizer (unless --no-use-tokenizer-model-from-checkpoint-args).
    from megatron.training.arguments import parse_args
    from megatron.training.checkpointing.checkpoint_args import apply_checkpoint_args

    bare = ["--micro-batch-size", "2", "--train-iters", "3", "--mock-data"]
    args = parse_args(bare + ["--use-checkpoint-args", "--load", str(save)])
    (line,) = apply_checkpoint_args(args)
    assert f"--tokenizer-type GPT2BPETokenizer --vocab-file {vocab} --merge-file {merges}" in line
    kept = parse_args(bare + ["--use-checkpoint-args", "--load", str(save), "--vocab-size", "9",
                              "--no-use-tokenizer-model-from-checkpoint-args"])
    apply_checkpoint_args(kept)
    assert (kept.tokenizer_type, kept.vocab_size, kept.vocab_file) == (None, 9, None)
    # The same data through Megatron-LM's HuggingFaceTokenizer (a local directory of the same
    # tokenizer, saved by transformers): the same vocabulary, so the same model and losses.
    from transformers import GPT2Tokenizer

    GPT2Tokenizer(str(vocab), str(merges)).save_pretrained(str(tmp_path / "hf"))
    hf = launch(1, flags + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                            str(tmp_path / "hf")])
    assert hf.returncode == 0, hf.describe()
    assert hf.losses() == run.losses()
