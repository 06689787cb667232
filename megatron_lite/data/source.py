"""What the trainer gets from the data side: tokenizer and train/validation sample streams."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megatron_lite.config.schema import DataConfig
from megatron_lite.data.gpt_dataset import GlobalBatchSampler, StreamDataset, splits
from megatron_lite.data.tokenizers import Tokenizer, load_tokenizer


@dataclass
class DataSource:
    """Everything the trainer needs from the data side."""

    tokenizer: Tokenizer
    train: StreamDataset
    valid: StreamDataset
    num_workers: int
    pin_memory: bool

    def loader(self, dataset: StreamDataset, sampler: GlobalBatchSampler) -> Iterator[torch.Tensor]:
        """Endless iterator of (micro_batch, seq_length + 1) int64 token batches."""
        loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, num_workers=self.num_workers,
            pin_memory=self.pin_memory, persistent_workers=self.num_workers > 0,
            prefetch_factor=4 if self.num_workers > 0 else None,
        )
        return iter(loader)


def build_data(cfg: DataConfig, pin_memory: bool = False) -> DataSource:
    """Tokenizer and datasets for ``cfg`` (the dataset must exist: see ``ensure_dataset``)."""
    assert cfg.prefix is not None and cfg.tokenizer.model is not None
    tokenizer = load_tokenizer(cfg.tokenizer.type, cfg.tokenizer.model)
    train, valid = splits(cfg.prefix, cfg.seq_length, cfg.valid_fraction, cfg.seed)
    return DataSource(tokenizer, StreamDataset(train), StreamDataset(valid), cfg.num_workers,
                      pin_memory)

