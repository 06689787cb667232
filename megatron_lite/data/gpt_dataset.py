"""Training samples: fixed-length windows of the concatenated token stream.

The ``.bin`` file holds all documents back to back (with their separators), so the flat memory
map *is* the token stream and samples run across document boundaries with no extra index.
With ``data.split_by: tokens`` the stream's head is for training and the next range for
validation: a token split, so even a single-document corpus (tinyshakespeare) splits. With
``documents`` (``DocumentSamples``), Megatron's document-level semantics apply instead.

Sample ``g`` (a global index that only grows: consumed samples) is found without state:
epoch ``e = g // n``, then the ``g % n``-th of the epoch's ``n`` windows, which are the cells of
a ``seq_length`` grid in a per-epoch random order, each started at a random point of its cell
(so each epoch cuts the text at new places). Resuming at any consumed-sample count therefore
reproduces the same batches.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megatron_lite.data.gpt_index import IndexSpec, get_indices, sample_tokens
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
        # One window fewer than fits, so a start anywhere in the last cell still fits.
        return max((self.end - self.start - self.seq_length) // self.seq_length, 0)


class StreamDataset(torch.utils.data.Dataset):
    """Map-style dataset: global sample index -> int64 tensor of ``seq_length + 1`` tokens."""

    def __init__(self, split: StreamSplit):
        self.split = split
        self._data: IndexedDataset | None = None  # opened lazily: workers open their own map
        self._epoch_cache: tuple[int, np.ndarray] | None = None
        if split.windows_per_epoch == 0:
            raise ValueError(
                f"'{split.prefix}' has {split.end - split.start} tokens in this split, fewer than "
                f"two samples of data.seq_length={split.seq_length}; use more data or a shorter "
                "seq_length")

    def __len__(self) -> int:
        return self.split.windows_per_epoch

    def _epoch(self, epoch: int) -> np.ndarray:
        """Window start offsets of an epoch, in visiting order (the last epoch's are kept:
        epochs are consumed in order)."""
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            n, s = self.split.windows_per_epoch, self.split
            cells = np.arange(n, dtype=np.int64) * s.seq_length
            if s.shuffle:
                rng = np.random.default_rng([s.seed, epoch])
                # Each window starts at a random point of its own grid cell: no two overlap by
                # more than a cell, yet text is seen at ever-new positions in the context.
                cells = rng.permutation(cells) + rng.integers(0, s.seq_length, n)
            self._epoch_cache = (epoch, cells)
        return self._epoch_cache[1]

    def start_of(self, index: int) -> int:
        n = self.split.windows_per_epoch
        return self.split.start + int(self._epoch(index // n)[index % n])

    def _opened(self) -> IndexedDataset:
        if self._data is None:
            self._data = IndexedDataset(self.split.prefix)
        return self._data

    def locate(self, index: int) -> dict:
        """Where sample ``index`` comes from: ``{"dataset": prefix, "pieces": [[document, first
        token, end token), ...]}`` (token offsets within each document)."""
        start = self.start_of(index)
        return {"dataset": self.split.prefix,
                "pieces": stream_pieces(self._opened(), start, start + self.split.seq_length + 1)}

    def __getitem__(self, index: int) -> torch.Tensor:
        self._opened()
        start = self.start_of(index)
        window = self._data.tokens[start:start + self.split.seq_length + 1]
        return torch.from_numpy(window.astype(np.int64))


def stream_pieces(data: IndexedDataset, start: int, end: int) -> list[list[int]]:
    """The documents a token range [start, end) of the flat stream covers, as
    ``[document, first token, end token)`` within each."""
    first_token = data.pointers // data.dtype.itemsize  # (n_docs,) stream position of each doc
    doc = int(np.searchsorted(first_token, start, side="right")) - 1
    pieces = []
    while start < end and doc < len(data):
        doc_end = int(first_token[doc]) + int(data.lengths[doc])
        if doc_end > start:
            hi = min(end, doc_end)
            pieces.append([doc, start - int(first_token[doc]), hi - int(first_token[doc])])
            start = hi
        doc += 1
    return pieces


def split_bounds(n: int, shares: tuple[float, float, float]) -> list[int]:
    """Boundaries [0, train_end, valid_end, n] of ``n`` items cut by ``shares`` (Megatron's
    rounding: each share rounded, the last boundary forced to ``n``)."""
    bounds = [0]
    for share in shares:
        bounds.append(bounds[-1] + int(round(share * n)))
    diff = bounds[-1] - n
    return [0] + [b - diff for b in bounds[1:]]


def token_splits(prefix: str, seq_length: int, shares: tuple[float, float, float], seed: int
                 ) -> tuple[StreamSplit, StreamSplit, StreamSplit]:
    """Train (shuffled windows), validation and test (windows in order) token ranges of a
    dataset."""
    n = IndexedDataset(prefix).n_tokens
    b = split_bounds(n, shares)
    return (StreamSplit(prefix, b[0], b[1], seq_length, True, seed),
            StreamSplit(prefix, b[1], b[2], seq_length, False, seed),
            StreamSplit(prefix, b[2], b[3], seq_length, False, seed))


class DocumentSamples(torch.utils.data.Dataset):
    """Samples of a document range with Megatron's semantics (``gpt_index``): documents
    reshuffled each epoch, samples across document boundaries, sample order shuffled."""

    def __init__(self, prefix: str, doc_begin: int, doc_end: int, seq_length: int, num_samples: int,
                 seed: int, cache_dir: Path, shuffle: bool = True, build: bool = True):
        data = IndexedDataset(prefix)
        if data.lengths[doc_begin:doc_end].sum() <= seq_length:
            raise ValueError(f"'{prefix}': documents {doc_begin}..{doc_end} of this split hold fewer "
                             f"tokens than one sample of data.seq_length={seq_length}; change "
                             "data.split or use more data")
        self.prefix, self.seq_length = prefix, seq_length
        spec = IndexSpec(prefix, doc_begin, doc_end, seq_length, num_samples, seed)
        self.index, self.built = get_indices(data.lengths, spec, cache_dir, build=build)
        if not shuffle:
            self.index = {**self.index, "shuffle": np.arange(num_samples)}
        self.num_samples = num_samples
        self._data: IndexedDataset | None = None

    def __len__(self) -> int:
        return self.num_samples

    def locate(self, i: int) -> dict:
        """Where sample ``i`` comes from: ``{"dataset": prefix, "pieces": [[document, first
        token, end token), ...]}`` (token offsets within each document)."""
        j = int(self.index["shuffle"][i])
        (p0, o0), (p1, o1) = self.index["sample"][j], self.index["sample"][j + 1]
        lengths, doc_index = self._opened().lengths, self.index["document"]
        pieces, remaining = [], self.seq_length + 1
        for p in range(int(p0), int(p1) + 1):
            d = int(doc_index[p])
            lo = int(o0) if p == p0 else 0
            hi = min(int(o1) + 1 if p == p1 else int(lengths[d]), lo + remaining)
            if hi > lo:
                pieces.append([d, lo, hi])
                remaining -= hi - lo
        return {"dataset": self.prefix, "pieces": pieces}

    def _opened(self) -> IndexedDataset:
        if self._data is None:
            self._data = IndexedDataset(self.prefix)
            self._pointers = self._data.pointers // self._data.dtype.itemsize
        return self._data

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} is beyond the {self.num_samples} planned for '{self.prefix}'")
        d = self._opened()
        tokens = sample_tokens(d.tokens, self._pointers, d.lengths, self.index, i, self.seq_length)
        return torch.from_numpy(tokens.astype(np.int64))


def past_skipped(position: int, skip: list[tuple[int, int]]) -> int:
    """The first sample position at or after ``position`` outside every skipped range."""
    moved = True
    while moved:
        moved = False
        for start, end in skip:
            if start <= position < end:
                position, moved = end, True
    return position


class GlobalBatchSampler:
    """Yields this data-parallel rank's micro-batches of global sample indices.

    Step ``s`` consumes global samples ``[s·G, (s+1)·G)``; rank ``r`` takes the ``r``-th of ``dp``
    equal slices and splits it into micro-batches. With the same ``G`` the set of samples per
    step is the same whatever ``dp`` and micro-batch size are, which is what makes a
    data-parallel run reproduce a single-process one.
    """

    def __init__(self, consumed_samples: int, global_batch: int, micro_batch: int, dp_rank: int,
                 dp_size: int, wrap: int | None = None, skip: list[tuple[int, int]] = (),
                 batches: Callable[[int], int] | None = None):
        """``batches``: the global batch of the ``k``-th step from here (a batch ramp-up);
        default: ``global_batch`` for every step."""
        if global_batch % (micro_batch * dp_size):
            raise ValueError(f"global batch {global_batch} is not a multiple of micro batch "
                             f"{micro_batch} × data-parallel size {dp_size}")
        self.consumed = consumed_samples
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.wrap = wrap  # validation repeats its windows modulo this
        self.skip = list(skip)  # [start, end) sample ranges never served (rolled-back data)
        self.batches = batches or (lambda k: global_batch)

    def __iter__(self) -> Iterator[list[int]]:
        step_start = self.consumed
        for k in itertools.count():
            step_start = past_skipped(step_start, self.skip)
            batch = self.batches(k)
            per_rank = batch // self.dp_size
            first = step_start + self.dp_rank * per_rank
            for m in range(0, per_rank, self.micro_batch):
                idx = list(range(first + m, first + m + self.micro_batch))
                yield [i % self.wrap for i in idx] if self.wrap else idx
            step_start += batch
