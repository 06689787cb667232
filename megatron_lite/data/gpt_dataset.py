"""Training samples: fixed-length windows of the concatenated token stream.

The ``.bin`` file holds all documents back to back (with their separators), so the flat memory
map *is* the token stream and samples run across document boundaries with no extra index.
The stream's head is for training and its tail for validation (``data.valid_fraction``): a
token split, so even a single-document corpus (tinyshakespeare) splits.

Sample ``g`` (a global index that only grows: consumed samples) is found without state:
epoch ``e = g // n``, a per-epoch permutation of the ``n`` windows, and a per-epoch offset of
the window grid (so each epoch cuts the text at new places). Resuming at any consumed-sample
count therefore reproduces the same batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from megatron_lite.data.indexed import IndexedDataset


@dataclass(frozen=True)
class StreamSplit:
    """Token range [start, end) of a dataset, cut into windows of ``seq_length + 1`` tokens."""

    prefix: str
    start: int
    end: int
    seq_length: int
    shuffle: bool
    seed: int

    @property
    def windows_per_epoch(self) -> int:
        # One window fewer than fits, so any grid offset in [0, seq_length) still fits n windows.
        return max((self.end - self.start - self.seq_length) // self.seq_length, 0)


class StreamDataset(torch.utils.data.Dataset):
    """Map-style dataset: global sample index -> int64 tensor of ``seq_length + 1`` tokens."""

    def __init__(self, split: StreamSplit):
        self.split = split
        self._data: IndexedDataset | None = None  # opened lazily: workers open their own map
        self._epoch_cache: tuple[int, np.ndarray, int] | None = None
        if split.windows_per_epoch == 0:
            raise ValueError(
                f"'{split.prefix}' has {split.end - split.start} tokens in this split, fewer than "
                f"two samples of data.seq_length={split.seq_length}; use more data or a shorter "
                "seq_length")

    def __len__(self) -> int:
        return self.split.windows_per_epoch

    def _epoch(self, epoch: int) -> tuple[np.ndarray, int]:
        """Window order and grid offset of an epoch (the last one is kept: epochs run in order)."""
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            n, s = self.split.windows_per_epoch, self.split
            if not s.shuffle:
                order, offset = np.arange(n), 0
            else:
                rng = np.random.default_rng([s.seed, epoch])
                offset = int(rng.integers(0, s.seq_length)) if epoch > 0 else 0
                order = rng.permutation(n)
            self._epoch_cache = (epoch, order, offset)
        return self._epoch_cache[1], self._epoch_cache[2]

    def start_of(self, index: int) -> int:
        n = self.split.windows_per_epoch
        order, offset = self._epoch(index // n)
        return self.split.start + offset + int(order[index % n]) * self.split.seq_length

    def __getitem__(self, index: int) -> torch.Tensor:
        if self._data is None:
            self._data = IndexedDataset(self.split.prefix)
        start = self.start_of(index)
        window = self._data.tokens[start:start + self.split.seq_length + 1]
        return torch.from_numpy(window.astype(np.int64))


def splits(prefix: str, seq_length: int, valid_fraction: float, seed: int
           ) -> tuple[StreamSplit, StreamSplit]:
    """Train (head, shuffled) and validation (tail, in order) splits of a dataset."""
    n = IndexedDataset(prefix).n_tokens
    cut = int(round(n * (1.0 - valid_fraction)))
    return (StreamSplit(prefix, 0, cut, seq_length, True, seed),
            StreamSplit(prefix, cut, n, seq_length, False, seed))


class GlobalBatchSampler:
    """Yields this data-parallel rank's micro-batches of global sample indices.

    Step ``s`` consumes global samples ``[s·G, (s+1)·G)``; rank ``r`` takes the ``r``-th of ``dp``
    equal slices and splits it into micro-batches. With the same ``G`` the set of samples per
    step is the same whatever ``dp`` and micro-batch size are, which is what makes a
    data-parallel run reproduce a single-process one.
    """

    def __init__(self, consumed_samples: int, global_batch: int, micro_batch: int, dp_rank: int,
                 dp_size: int, wrap: int | None = None):
        if global_batch % (micro_batch * dp_size):
            raise ValueError(f"global batch {global_batch} is not a multiple of micro batch "
                             f"{micro_batch} × data-parallel size {dp_size}")
        self.consumed = consumed_samples
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.wrap = wrap  # validation repeats its windows modulo this

    def __iter__(self) -> Iterator[list[int]]:
        per_rank = self.global_batch // self.dp_size
        step_start = self.consumed
        while True:
            first = step_start + self.dp_rank * per_rank
            for m in range(0, per_rank, self.micro_batch):
                idx = list(range(first + m, first + m + self.micro_batch))
                yield [i % self.wrap for i in idx] if self.wrap else idx
            step_start += self.global_batch
