"""Fault injection for the spike tests: bad training samples on demand.

``MEGATRON_LITE_BAD_SAMPLES=START:END[,START:END...]`` in the environment turns training
samples ``START..END-1`` (global indices, as ``spikes.jsonl`` names them) into uniformly random
tokens, as a corrupt shard would. Nothing changes without the variable.
"""

from __future__ import annotations

import os

import torch


class NoisySamples(torch.utils.data.Dataset):
    """``dataset`` with samples in the [start, end) ranges replaced by random tokens (seeded
    by index)."""

    def __init__(self, dataset, ranges: list[tuple[int, int]], vocab_size: int):
        self.dataset, self.ranges, self.vocab_size = dataset, ranges, vocab_size

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> torch.Tensor:
        sample = self.dataset[i]
        if not any(start <= i < end for start, end in self.ranges):
            return sample
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, self.vocab_size, sample.shape, generator=g, dtype=sample.dtype)

    def locate(self, i: int) -> dict:
        return self.dataset.locate(i)


def with_injected_faults(dataset, vocab_size: int):
    wanted = os.environ.get("MEGATRON_LITE_BAD_SAMPLES")
    if not wanted:
        return dataset
    ranges = [tuple(int(x) for x in part.split(":")) for part in wanted.split(",")]
    return NoisySamples(dataset, ranges, vocab_size)
