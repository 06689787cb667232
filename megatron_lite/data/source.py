"""What the trainer gets from the data side: tokenizer and train/validation/test sample streams."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from megatron_lite.config.schema import DataConfig
from megatron_lite.config.validate import split_shares
from megatron_lite.data.blend import BlendedSamples, cached_blend_order
from megatron_lite.data.gpt_dataset import (
    DocumentSamples,
    GlobalBatchSampler,
    StreamDataset,
    split_bounds,
    token_splits,
)
from megatron_lite.data.indexed import IndexedDataset
from megatron_lite.data.tokenizers import Tokenizer, load_tokenizer

SPLIT_NAMES = ("training", "validation", "test")


@dataclass
class DataSource:
    """Everything the trainer needs from the data side."""

    tokenizer: Tokenizer
    train: torch.utils.data.Dataset
    valid: torch.utils.data.Dataset
    num_workers: int
    pin_memory: bool
    valid_sets: dict[str, torch.utils.data.Dataset] = field(default_factory=dict)
    """Each blend entry's own validation split, by name (empty without a blend)."""
    test: torch.utils.data.Dataset | None = None
    """The test split (of the blend), where ``data.split`` gives it a share."""

    def loader(self, dataset, sampler: GlobalBatchSampler) -> Iterator[torch.Tensor]:
        """Endless iterator of (micro_batch, seq_length + 1) int64 token batches."""
        loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, num_workers=self.num_workers,
            pin_memory=self.pin_memory, persistent_workers=self.num_workers > 0,
            prefetch_factor=4 if self.num_workers > 0 else None,
        )
        return iter(loader)


def _cache_dir(cfg: DataConfig, prefix: str) -> Path:
    return Path(cfg.cache_dir) if cfg.cache_dir else Path(prefix).parent / "index-cache"


def _one_dataset(cfg: DataConfig, prefix: str, split: int, num_samples: int, build: bool):
    shares = split_shares(cfg.split)
    if cfg.split_by == "tokens":
        return StreamDataset(token_splits(prefix, cfg.seq_length, shares, cfg.seed)[split])
    n_docs = len(IndexedDataset(prefix))
    bounds = split_bounds(n_docs, shares)
    lo, hi = bounds[split], bounds[split + 1]
    if hi <= lo:
        raise ValueError(f"'{prefix}' has {n_docs} document(s): data.split={cfg.split!r} leaves its "
                         f"{SPLIT_NAMES[split]} split empty (use data.split_by=tokens for a corpus of "
                         "one or few documents)")
    return DocumentSamples(prefix, lo, hi, cfg.seq_length, num_samples, cfg.seed, _cache_dir(cfg, prefix),
                           shuffle=split == 0, build=build)


def _split_dataset(cfg: DataConfig, split: int, num_samples: int, build: bool):
    entries = [(cfg.prefix, 1.0)] if cfg.prefix else [(e.prefix, e.weight) for e in cfg.blend]
    if len(entries) == 1:
        return _one_dataset(cfg, entries[0][0], split, num_samples, build)
    which, nth = cached_blend_order([w for _, w in entries], num_samples,
                                    _cache_dir(cfg, entries[0][0]), build)
    counts = np.bincount(which, minlength=len(entries))
    parts = [_one_dataset(cfg, prefix, split, max(int(c), 1), build)
             for (prefix, _), c in zip(entries, counts, strict=True)]
    return BlendedSamples(parts, which, nth)


def blend_names(cfg: DataConfig) -> list[str]:
    """The name each blend entry's validation loss is reported under: its ``name``, else its
    prefix's file name (numbered where two would be the same)."""
    names = [e.name or Path(e.prefix).name for e in cfg.blend]
    return [f"{n}.{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def check_token_ids(prefix: str, vocab_size: int, tokenizer: str) -> None:
    """Refuse a dataset built with another tokenizer than the run's: its ids beyond the
    vocabulary would index past the embedding (an IndexError on CPU, a device-side assert on a
    GPU) steps into the run."""
    top = IndexedDataset(prefix).sampled_max_id()
    if top is not None and top >= vocab_size:
        raise ValueError(f"'{prefix}' holds token id {top}, but the tokenizer ({tokenizer}) has "
                         f"{vocab_size} ids: the dataset was built with another tokenizer; rebuild it "
                         "with this one (tools/preprocess_data.py) or set data.tokenizer to the one "
                         "it was built with")


def build_data(cfg: DataConfig, train_samples: int, valid_samples: int,
               pin_memory: bool = False, build: bool = True) -> DataSource:
    """Tokenizer and the train/validation datasets sized for the run. Sample indices are loaded
    from the cache, or built into it where ``build`` (else a missing index is an error). The
    datasets must exist: see ``ensure_dataset``."""
    assert cfg.tokenizer.model is not None
    tokenizer = load_tokenizer(cfg.tokenizer.type, cfg.tokenizer.model)
    if build:  # once per run (the rank that builds the indices), before any sample is read
        for prefix in [cfg.prefix] if cfg.prefix else [e.prefix for e in cfg.blend]:
            check_token_ids(prefix, tokenizer.vocab_size, f"{cfg.tokenizer.type} {cfg.tokenizer.model}")
    valid_sets = {}
    if len(cfg.blend) > 1:  # the validation samples of each entry alone, as many as of the blend
        valid_sets = {name: _one_dataset(cfg, entry.prefix, 1, valid_samples, build)
                      for name, entry in zip(blend_names(cfg), cfg.blend, strict=True)}
    test = _split_dataset(cfg, 2, valid_samples, build) if split_shares(cfg.split)[2] > 0 else None
    return DataSource(tokenizer, _split_dataset(cfg, 0, train_samples, build),
                      _split_dataset(cfg, 1, valid_samples, build), cfg.num_workers, pin_memory,
                      valid_sets, test)
