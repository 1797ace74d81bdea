"""Datasets (megatron-core GPTDataset / MockGPTDataset) and deterministic micro-batch iterators.

Every rank builds the same datasets and reads its data-parallel slice of each global batch
directly, so TP and PP peers see identical samples without a broadcast. The global batch at a
given ``consumed_samples`` is the same whatever the DP size, which keeps losses comparable across
layouts and makes resume exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from megatron.training.config import DataConfig, ModelConfig, TrainingConfig
from megatron.training.tokenizer import build_tokenizer


@dataclass
class Datasets:
    train: object
    valid: Optional[object]
    test: Optional[object]


def _blend(data_path: tuple):
    from megatron.core.datasets.utils import get_blend_from_list

    return get_blend_from_list(list(data_path)) if data_path else None


def build_datasets(data: DataConfig, model: ModelConfig, training: TrainingConfig) -> Datasets:
    """Build train/valid/test with megatron-core's BlendedMegatronDatasetBuilder (prebuilt
    helpers_cpp; we never call compile_helpers(), which exits the process when it fails)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    tokenizer = build_tokenizer(data.tokenizer_type, data.vocab_size, data.tokenizer_model,
                                vocab_file=data.vocab_file, merge_file=data.merge_file)
    gbs = training.global_batch_size
    evals = (training.train_iters // training.eval_interval + 1) if training.eval_interval else 0
    # As Megatron-LM asks (get_train_valid_test_num_samples): the sizes decide how
    # megatron-core's datasets shuffle, so the same ones give the same samples in the same order.
    train = training.train_samples or training.train_iters * gbs
    sizes = [train, evals * training.eval_iters * gbs, training.eval_iters * gbs]
    config = GPTDatasetConfig(
        random_seed=training.seed,
        sequence_length=model.seq_length,
        blend=_blend(data.data_path),
        blend_per_split=([_blend(data.train_data_path), _blend(data.valid_data_path),
                          _blend(data.test_data_path)] if data.train_data_path else None),
        split=data.split if data.data_path else None,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        # The local layer spec builds its own causal mask; skipping it saves memory and time.
        create_attention_mask=False,
        path_to_cache=data.data_cache_path,
        mmap_bin_files=data.mmap_bin_files,
    )
    cls = MockGPTDataset if data.mock_data else GPTDataset
    train, valid, test = BlendedMegatronDatasetBuilder(
        cls, sizes, lambda: True, config).build()
    return Datasets(train=train, valid=valid, test=test)


class MicroBatchIterator:
    """Yields this data-parallel rank's micro-batches, starting at ``consumed_samples``.

    Micro-batch k of a global batch starting at sample s covers samples
    ``s + k*mbs*dp .. s + (k+1)*mbs*dp``; rank r takes the r-th ``mbs`` of them (Megatron's
    MegatronPretrainingSampler order).
    """

    def __init__(self, dataset, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        self.dataset = dataset
        self.next_sample = consumed_samples
        self.mbs = micro_batch_size
        self.dp_rank = data_parallel_rank
        self.dp = data_parallel_size

    def __iter__(self) -> Iterator[dict]:
        return self

    def skip(self, samples: int) -> None:
        """Read past `samples` samples of the global order (whole micro-batches of every
        data-parallel rank), as if their micro-batches had been taken."""
        self.next_sample += samples

    def __next__(self) -> dict:
        stride = self.mbs * self.dp
        if self.next_sample + stride > len(self.dataset):
            raise StopIteration
        start = self.next_sample + self.dp_rank * self.mbs
        samples = [self.dataset[i] for i in range(start, start + self.mbs)]
        self.next_sample += stride
        return {key: torch.stack([torch.as_tensor(s[key]) for s in samples])
                for key in samples[0]}


def get_batch(data_iterator, device) -> dict:
    """Next micro-batch on ``device``; None-safe for stages that do not consume data."""
    batch = next(data_iterator)
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
