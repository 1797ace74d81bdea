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
