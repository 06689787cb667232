"""Megatron-style sample indices, built vectorised and cached on disk.

For a split (a range of documents) and a number of samples, three arrays say where every
sample comes from, with Megatron-LM's GPTDataset semantics:

- document index: the split's document ids, shuffled anew each epoch, epochs concatenated
  (enough epochs to cover the samples; every document is seen once per epoch);
- sample index ``(planned + 1, 2)`` (whole blocks, below): for sample ``i``, the position in
  the document index and the token offset where it starts; a sample reads ``seq_length + 1``
  tokens up to the next sample's start (+1), across document boundaries;
- shuffle index: the order in which samples are served, shuffled within blocks of one epoch's
  worth of samples, each block by its own seed: the first ``k`` samples served are the same
  whatever the number of samples asked for, so a run resumed with more steps (``training.iters``),
  another batch size or another rollback budget goes on reading where it stopped (Megatron-LM
  shuffles over all the epochs it plans: a run that needs one epoch more reads another order
  from its start).

Built with numpy in one pass (cumulative sums and a binary search instead of Megatron's
per-document loop), so 10M documents take seconds. The cache entry is keyed by a hash of
everything that determines the arrays; its manifest (written last, atomically) records each
file's size and SHA-256, so a stale, truncated or tampered entry is rebuilt, never used.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

CACHE_VERSION = 3
SAMPLE_ORDER = 2
"""How the served order is made, recorded with each checkpoint's data phases. 1: one permutation
of all the samples planned (it changed with the run's length); 2: a permutation per block."""


@dataclass(frozen=True)
class IndexSpec:
    """Everything that determines a sample index."""

    prefix: str
    doc_begin: int
    doc_end: int
    seq_length: int
    num_samples: int
    seed: int

    def key(self, lengths_fingerprint: str) -> str:
        blob = json.dumps({"v": CACHE_VERSION, **asdict(self), "data": lengths_fingerprint}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]


def data_fingerprint(prefix: str) -> str:
    """Identity of a dataset's files: path, sizes and modification times of .bin and .idx."""
    parts = []
    for suffix in (".bin", ".idx"):
        st = os.stat(prefix + suffix)
        parts.append(f"{os.path.abspath(prefix + suffix)}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts)


def epochs_needed(split_tokens: int, seq_length: int, num_samples: int) -> int:
    """Epochs whose tokens cover ``num_samples`` samples (each needs one token beyond its end)."""
    if split_tokens <= 0:
        raise ValueError("the split has no tokens")
    return max(1, -(-(num_samples * seq_length + 1) // split_tokens))


def _per_block(lengths: np.ndarray, spec: IndexSpec) -> int:
    """Samples in a block: the whole samples of one epoch of the split."""
    return max(1, int(lengths[spec.doc_begin:spec.doc_end].sum()) // spec.seq_length)


def planned_samples(lengths: np.ndarray, spec: IndexSpec) -> int:
    """``spec.num_samples`` rounded up to whole blocks: what the index covers, and what its
    cache entry is keyed on (every run shorter than an epoch of the same data shares one entry;
    a resume with more steps in the same epoch reuses it)."""
    per_block = _per_block(lengths, spec)
    return -(-spec.num_samples // per_block) * per_block


def build_indices(lengths: np.ndarray, spec: IndexSpec) -> dict[str, np.ndarray]:
    """Document, sample and shuffle indices for ``spec`` from per-document token ``lengths``.

    The sample and shuffle indices cover whole blocks (``planned_samples``): the shuffle index
    holds the served order of all of them, of which a run reads the first ``num_samples``."""
    docs = np.arange(spec.doc_begin, spec.doc_end, dtype=np.int32)
    split_tokens = int(lengths[spec.doc_begin:spec.doc_end].sum())
    per_block, planned = _per_block(lengths, spec), planned_samples(lengths, spec)
    epochs = epochs_needed(split_tokens, spec.seq_length, planned)
    # Separate streams: epoch e's document order depends only on (seed, e), block b's sample
    # order only on (seed, b): nothing depends on the number of samples asked for.
    doc_index = np.concatenate([np.random.default_rng([spec.seed, 1, e]).permutation(docs)
                                for e in range(epochs)])
    doc_ends = np.cumsum(lengths[doc_index], dtype=np.int64)  # token end of each position
    starts = np.arange(planned + 1, dtype=np.int64) * spec.seq_length
    pos = np.searchsorted(doc_ends, starts, side="right")
    offsets = starts - (doc_ends[pos] - lengths[doc_index[pos]])
    del starts, doc_ends
    # Megatron's int32 where it fits: 8 bytes a sample instead of 16.
    narrow = max(int(pos[-1]), int(offsets.max())) < 2**31
    sample_index = np.stack([pos, offsets], axis=1).astype(np.int32 if narrow else np.int64, copy=False)
    shuffle_index = np.empty(planned, dtype=np.uint32 if planned < 2**32 else np.int64)
    for b in range(planned // per_block):
        block = np.random.default_rng([spec.seed, 2, b]).permutation(per_block)
        shuffle_index[b * per_block:(b + 1) * per_block] = block + b * per_block
    return {"document": doc_index, "sample": sample_index, "shuffle": shuffle_index[:spec.num_samples]}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def load_cached(cache_dir: Path, key: str, verify_hash: bool = True) -> dict[str, np.ndarray] | None:
    """The cached indices for ``key`` (memory-mapped), or None if absent or not intact.
    ``verify_hash=False`` checks sizes only: the building rank has just verified the contents,
    and thousands of ranks re-hashing the same files on a shared filesystem would be costly."""
    manifest = cache_dir / f"{key}.json"
    if not manifest.is_file():
        return None
    try:
        meta = json.loads(manifest.read_text())
        out = {}
        for name, info in meta["files"].items():
            path = cache_dir / info["file"]
            if path.stat().st_size != info["size"] or (verify_hash and _sha256(path) != info["sha256"]):
                return None
            out[name] = np.load(path, mmap_mode="r")
        return out
    except (OSError, ValueError, KeyError):
        return None


def save_cached(cache_dir: Path, key: str, arrays: dict[str, np.ndarray], description: dict) -> None:
    """Write arrays then the manifest, each to a temporary name renamed into place."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, arr in arrays.items():
        final = cache_dir / f"{key}-{name}.npy"
        tmp = cache_dir / f".{key}-{name}.npy.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            np.save(f, arr)
        os.replace(tmp, final)
        files[name] = {"file": final.name, "size": final.stat().st_size, "sha256": _sha256(final)}
    tmp = cache_dir / f".{key}.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps({"spec": description, "files": files}, indent=1))
    os.replace(tmp, cache_dir / f"{key}.json")


def get_indices(lengths: np.ndarray, spec: IndexSpec, cache_dir: Path,
                fingerprint: str | None = None, build: bool = True) -> tuple[dict[str, np.ndarray], bool]:
    """Cached indices for ``spec``, built and cached when missing or damaged (only where
    ``build``: other ranks must find what a builder rank wrote). Returns (arrays, built_now)."""
    whole = replace(spec, num_samples=planned_samples(lengths, spec))
    key = whole.key(fingerprint if fingerprint is not None else data_fingerprint(spec.prefix))
    arrays = load_cached(cache_dir, key, verify_hash=build)
    built = arrays is None
    if built and not build:
        raise FileNotFoundError(
            f"sample index {cache_dir}/{key}.json is missing or damaged on this rank although the "
            "building rank wrote it: if data.cache_dir is not on a filesystem all nodes share, set "
            "data.cache_shared=false")
    if built:
        arrays = build_indices(lengths, whole)
        save_cached(cache_dir, key, arrays, asdict(whole))
    return {**arrays, "shuffle": arrays["shuffle"][:spec.num_samples]}, built


def sample_tokens(tokens: np.ndarray, pointers_tok: np.ndarray, lengths: np.ndarray,
                  idx: dict[str, np.ndarray], i: int, seq_length: int) -> np.ndarray:
    """The ``seq_length + 1`` tokens of served sample ``i`` (through the shuffle index).

    ``pointers_tok`` holds each document's first token position in the flat ``tokens`` array.
    """
    j = int(idx["shuffle"][i])
    (p0, o0), (p1, o1) = idx["sample"][j], idx["sample"][j + 1]
    doc_index = idx["document"]
    if p0 == p1:
        d = int(doc_index[p0])
        start = int(pointers_tok[d]) + int(o0)
        return np.asarray(tokens[start:start + seq_length + 1])
    pieces = []
    for p in range(int(p0), int(p1) + 1):
        d = int(doc_index[p])
        lo = int(o0) if p == p0 else 0
        hi = int(o1) + 1 if p == p1 else int(lengths[d])
        pieces.append(tokens[int(pointers_tok[d]) + lo:int(pointers_tok[d]) + hi])
    return np.concatenate(pieces)[:seq_length + 1]
