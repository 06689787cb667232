"""Megatron-LM compatible indexed datasets: ``PREFIX.bin`` (tokens) + ``PREFIX.idx`` (index).

The ``.idx`` layout (``MMIDIDX`` version 1, little-endian), as Megatron-LM reads it::

    b"MMIDIDX\\x00\\x00"  | u64 version=1 | u8 dtype code | u64 n_sequences | u64 n_doc_indices
    i32[n_sequences] sequence lengths (tokens)
    i64[n_sequences] sequence byte offsets into .bin
    i64[n_doc_indices] document boundaries as sequence indices (starts with 0)

The file format is the interchange contract with Megatron-LM tooling, which is why it is
written here rather than taken from a library: no maintained package writes it standalone.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
               7: np.float32, 8: np.uint16}
CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while ids fit (Megatron's choice), else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def dataset_exists(prefix: str | Path) -> bool:
    return Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file()


def datasets_under(prefix: str | Path) -> list[str]:
    """What a prefix naming no dataset most likely meant: the prefix without a ``.bin``/``.idx``
    given with it, or the datasets ``tools/preprocess_data.py --output-prefix PREFIX`` writes
    (``PREFIX_{key}_document``), those that exist."""
    text = str(prefix)
    if text.endswith((".bin", ".idx")) and dataset_exists(text[:-4]):
        return [text[:-4]]
    base = Path(prefix)
    return sorted(str(p)[:-len(".idx")] for p in base.parent.glob(f"{base.name}_*_document.idx")
                  if dataset_exists(str(p)[:-len(".idx")]))


class IndexedDatasetWriter:
    """Streams documents to ``PREFIX.bin.tmp``/``.idx.tmp``; ``finalize`` renames both into place,
    so an interrupted write never leaves a pair that looks valid."""

    def __init__(self, prefix: str | Path, dtype: np.dtype):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(f"{self.prefix}.bin.tmp", "wb")
        self._lengths: list[np.ndarray] = []
        self.n_tokens = 0

    def add_documents(self, docs: Iterable[Iterable[int] | np.ndarray]) -> None:
        """Append documents (one sequence each) in order."""
        arrays = [np.asarray(d, dtype=self.dtype) for d in docs]
        if not arrays:
            return
        self._bin.write(np.concatenate(arrays).tobytes(order="C"))
        lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
        self._lengths.append(lengths)
        self.n_tokens += int(lengths.sum())

    def add_flat(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as one flat token array and their lengths (no copies)."""
        if lengths.size == 0:
            return
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes(order="C"))
        self._lengths.append(np.asarray(lengths, dtype=np.int64))
        self.n_tokens += int(tokens.size)

    def finalize(self, doc_idx: np.ndarray | None = None) -> None:
        """Write the index and move both files into place. ``doc_idx``: document boundaries as
        sequence indices (Megatron's ``--split-sentences`` datasets hold several sequences per
        document); default: every sequence is a document."""
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError("a document longer than 2^31 tokens cannot be indexed")
        pointers = np.zeros(lengths.size, dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        if doc_idx is None:
            doc_idx = np.arange(lengths.size + 1, dtype=np.int64)
        doc_idx = np.asarray(doc_idx, dtype=np.int64)
        if problem := _doc_idx_problem(doc_idx, lengths.size):
            self.abort()
            raise ValueError(f"document boundaries for {self.prefix}: {problem}")
        with open(f"{self.prefix}.idx.tmp", "wb") as f:
            f.write(HEADER)
            f.write(struct.pack("<Q", 1))
            f.write(struct.pack("<B", CODE_OF[self.dtype]))
            f.write(struct.pack("<Q", lengths.size))
            f.write(struct.pack("<Q", doc_idx.size))
            f.write(lengths.astype(np.int32).tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(doc_idx.tobytes(order="C"))
        # .bin first: a .idx in place always describes a complete .bin.
        os.replace(f"{self.prefix}.bin.tmp", f"{self.prefix}.bin")
        os.replace(f"{self.prefix}.idx.tmp", f"{self.prefix}.idx")

    def abort(self) -> None:
        self._bin.close()
        for suffix in (".bin.tmp", ".idx.tmp"):
            Path(self.prefix + suffix).unlink(missing_ok=True)


def _doc_idx_problem(doc_idx: np.ndarray, n_seq: int) -> str | None:
    if doc_idx.size == 0 or doc_idx[0] != 0 or doc_idx[-1] != n_seq:
        ends = (doc_idx[0], doc_idx[-1]) if doc_idx.size else ()
        return f"they must run from 0 to the {n_seq} sequences, not {ends}"
    if np.any(np.diff(doc_idx) < 0):
        return "they must not decrease"
    return None


class IndexedDataset:
    """Read-only, memory-mapped view of a ``PREFIX.bin/.idx`` pair."""

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        if not dataset_exists(prefix):
            meant = datasets_under(prefix)
            raise FileNotFoundError(
                f"indexed dataset '{prefix}.bin/.idx' not found; "
                + (f"did you mean {' or '.join(meant[:3])}?" if meant
                   else "build it with tools/preprocess_data.py (or set data.build_from)"))
        idx = np.memmap(f"{prefix}.idx", dtype=np.uint8, mode="r")
        if bytes(idx[:9]) != HEADER:
            raise ValueError(f"'{prefix}.idx' is not an MMIDIDX index (bad header)")
        if idx.size < 34:
            raise ValueError(f"'{prefix}.idx' is truncated ({idx.size} bytes, shorter than its header): "
                             "rebuild it")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", bytes(idx[9:34]))
        if version != 1 or code not in DTYPE_CODES:
            raise ValueError(f"'{prefix}.idx': unsupported version {version} or dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        offset = 34
        if idx.size < offset + 12 * n_seq + 8 * n_doc:
            raise ValueError(f"'{prefix}.idx' is truncated ({idx.size} bytes; its header describes "
                             f"{n_seq} sequences and {n_doc - 1 if n_doc else 0} documents, "
                             f"{offset + 12 * n_seq + 8 * n_doc} bytes): rebuild it")
        self.lengths = np.frombuffer(idx, np.int32, n_seq, offset)
        offset += 4 * n_seq
        self.pointers = np.frombuffer(idx, np.int64, n_seq, offset)
        offset += 8 * n_seq
        self.doc_idx = np.frombuffer(idx, np.int64, n_doc, offset)
        """Document boundaries as sequence indices: document d is sequences doc_idx[d]..doc_idx[d+1]-1
        (one sequence per document unless made with Megatron's ``--split-sentences``)."""
        if problem := _doc_idx_problem(self.doc_idx, n_seq):
            raise ValueError(f"'{prefix}.idx': its document boundaries are inconsistent ({problem}); "
                             "rebuild it")
        # An empty .bin (a dataset of no documents, e.g. a preprocessing rank's empty share)
        # cannot be memory-mapped.
        self.tokens = (np.memmap(f"{prefix}.bin", dtype=self.dtype, mode="r")
                       if os.path.getsize(f"{prefix}.bin") else np.zeros(0, self.dtype))
        expected = int(self.pointers[-1]) // self.dtype.itemsize + int(self.lengths[-1]) if n_seq else 0
        if self.tokens.size != expected:
            raise ValueError(f"'{prefix}.bin' holds {self.tokens.size} tokens but its index "
                             f"describes {expected}: the pair is inconsistent, rebuild it")

    def __len__(self) -> int:
        """Sequences (the unit samples are drawn from, as in Megatron-LM's GPT datasets)."""
        return self.lengths.size

    @property
    def n_documents(self) -> int:
        return self.doc_idx.size - 1

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize
        return np.asarray(self.tokens[start:start + int(self.lengths[i])])

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.size)

    def sampled_max_id(self, windows: int = 16, window_tokens: int = 1 << 16) -> int | None:
        """The largest token id in ``windows`` evenly spaced stretches of the tokens (a few MB
        read whatever the corpus's size), None for an empty dataset: a dataset built with a
        larger tokenizer than the run's shows ids beyond its vocabulary in any such sample."""
        n = self.n_tokens
        if n == 0:
            return None
        # (A set, not np.unique: that imports numpy.ma, slow, on every start.)
        starts = {int(s) for s in np.linspace(0, max(n - window_tokens, 0), windows)}
        return max(int(np.asarray(self.tokens[s:s + window_tokens]).max()) for s in starts)


def merge(prefixes: list[str], output_prefix: str, chunk_tokens: int = 1 << 24) -> tuple[int, int]:
    """Concatenate datasets into ``output_prefix`` (streamed in chunks; same token dtype required).
    Returns (documents, tokens)."""
    datasets = [IndexedDataset(p) for p in prefixes]
    dtypes = {str(d.dtype) for d in datasets}
    if len(dtypes) != 1:
        raise ValueError(f"datasets have different token dtypes {sorted(dtypes)}: they come from "
                         "different tokenizers and cannot be merged")
    writer = IndexedDatasetWriter(output_prefix, datasets[0].dtype)
    # Document boundaries carry over (shifted), so sentence-split datasets keep their documents.
    offsets = np.cumsum([0, *(len(d) for d in datasets)])
    doc_idx = np.concatenate([[0], *(d.doc_idx[1:].astype(np.int64) + off
                                     for d, off in zip(datasets, offsets, strict=False))])
    try:
        for d in datasets:
            lengths = d.lengths.astype(np.int64)
            # Whole documents per chunk, so each write carries its own lengths.
            ends = np.cumsum(lengths)
            first = 0
            while first < lengths.size:
                start_tok = int(ends[first - 1]) if first else 0
                last = max(int(np.searchsorted(ends, start_tok + chunk_tokens, side="right")), first + 1)
                writer.add_flat(np.asarray(d.tokens[start_tok:int(ends[last - 1])]), lengths[first:last])
                first = last
        writer.finalize(doc_idx)
    except BaseException:
        writer.abort()
        raise
    return sum(d.n_documents for d in datasets), writer.n_tokens
