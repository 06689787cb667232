#!/usr/bin/env python
"""Resume-time checkpoint verification: rank 0 hashing every file vs. every rank its own share.

A checkpoint of ``--ranks`` files (one per rank, ``--gib`` GiB in all) is written with the
store's own writer; then, in the same invocation, its SHA-256 verification runs (a) serially in
one process, as rank 0 did while the others waited, and (b) split as ``Checkpointer`` splits it
(rank r hashes files r, r + W, ...), one process per rank. Prints both times, the ratio and what
they imply for a 7B checkpoint (Llama-2 7B: fp32 weights + two Adam moments, 12 bytes per
parameter, as the checkpoints store them).

The files were just written, so they are read from the page cache: the figures are the hashing
rate (CPU), the bound when storage is fast. On a parallel filesystem read from many nodes the
split also divides the I/O.

    python bench/checkpoint_verify.py [--ranks 2] [--gib 2] [--dir /tmp/verifybench]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LLAMA2_7B_PARAMETERS = 6_738_415_616  # python pretrain.py recipes/llama2-7b.yaml --dry-run
BYTES_PER_PARAMETER = 12  # fp32 weight + Adam's two moments


def _warm(_: int) -> None:
    from megatron_lite.checkpoint import manifest  # noqa: F401


def _verify_share(args: tuple[str, int, int]) -> float:
    from megatron_lite.checkpoint.manifest import read_manifest, verify

    path, rank, world = args
    start = time.perf_counter()
    manifest = read_manifest(Path(path))
    verify(Path(path), manifest, manifest["files"][rank::world])
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="ranks (files, and verifying processes)")
    p.add_argument("--gib", type=float, default=2.0, help="checkpoint size in GiB")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    a = p.parse_args()

    import os

    from megatron_lite.checkpoint import store

    root = Path(a.dir or tempfile.mkdtemp(prefix="verifybench-"))
    shutil.rmtree(root, ignore_errors=True)
    tmp = root / ".tmp-step_00000001"
    tmp.mkdir(parents=True)
    per_file = int(a.gib * (1 << 30)) // a.ranks
    block = os.urandom(1 << 24)
    files = []
    for rank in range(a.ranks):
        data = (block * (per_file // len(block) + 1))[:per_file]
        files.append(store.write_rank_bytes(tmp, rank, data))
        del data
    path = store.commit(root, tmp, {"format": store.FORMAT_VERSION, "step": 1, "files": files})
    total = sum(f["bytes"] for f in files)

    serial = _verify_share((str(path), 0, 1))
    ctx = mp.get_context("spawn")
    with ctx.Pool(a.ranks) as pool:
        pool.map(_warm, range(a.ranks))  # processes started and imports done before the clock
        start = time.perf_counter()
        pool.map(_verify_share, [(str(path), r, a.ranks) for r in range(a.ranks)])
        split = time.perf_counter() - start
    shutil.rmtree(root, ignore_errors=True)

    rate = total / serial  # bytes/s one process hashes
    seven_b = LLAMA2_7B_PARAMETERS * BYTES_PER_PARAMETER
    print(f"checkpoint: {a.ranks} files, {total / 2**30:.2f} GiB")
    print(f"rank 0 verifies all:       {serial:.2f} s ({rate / 2**20:.0f} MiB/s)")
    print(f"each rank its own share:   {split:.2f} s")
    print(f"ratio serial / split: {serial / split:.2f} (ideal {a.ranks})")
    print(f"7B checkpoint ({seven_b / 1e9:.1f} GB) at this rate: rank 0 alone {seven_b / rate:.0f} s; "
          f"split over 8 ranks {seven_b / rate / 8:.0f} s, over 32 ranks {seven_b / rate / 32:.0f} s")


if __name__ == "__main__":
    main()
