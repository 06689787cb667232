#!/usr/bin/env python
"""Sample-index build time for a large corpus (only document lengths matter).

Synthetic document lengths (log-normal, mean ~500 tokens) for 10M documents / ~5B tokens;
builds the document, sample and shuffle indices for one epoch of seq-2048 samples, then writes
and re-reads the cache entry. Prints the seconds of each part and the arrays' size.

    python bench/index_build.py [--docs 10000000] [--seq 2048]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from megatron_lite.data.gpt_index import IndexSpec, build_indices, load_cached, save_cached  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=10_000_000)
    p.add_argument("--seq", type=int, default=2048)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.9, 0.8, a.docs), 1, 200_000).astype(np.int32)
    tokens = int(lengths.sum(dtype=np.int64))
    samples = (tokens - 1) // a.seq
    spec = IndexSpec("synthetic", 0, a.docs, a.seq, samples, seed=1234)
    t = time.perf_counter()
    arrays = build_indices(lengths, spec)
    build_s = time.perf_counter() - t
    nbytes = sum(x.nbytes for x in arrays.values())
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        save_cached(Path(tmp), "k", arrays, {"bench": True})
        save_s = time.perf_counter() - t
        t = time.perf_counter()
        assert load_cached(Path(tmp), "k") is not None
        load_s = time.perf_counter() - t
    print(f"{a.docs:,} documents, {tokens:,} tokens, {samples:,} samples of {a.seq}: "
          f"build {build_s:.1f} s, cache write {save_s:.1f} s, verified load {load_s:.1f} s, "
          f"indices {nbytes / 2**20:,.0f} MiB")


if __name__ == "__main__":
    main()
