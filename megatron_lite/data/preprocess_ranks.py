"""Preprocessing on many ranks (nodes): each rank tokenizes a contiguous part of the input and
writes it as a dataset of its own; the last rank to finish concatenates the parts, in rank
order, into the dataset one process would have written, byte for byte.

The input files are laid end to end and cut into ``world`` equal byte ranges. An uncompressed
jsonl file is split inside: a line belongs to the rank whose range holds its first byte. Other
files (compressed, parquet, plain text) are whole units, given to the rank whose range holds
their first byte. Ranks need no network between them, only the output's (shared) filesystem:
each rank's part is committed by a marker file that carries a signature of the inputs and
options, and the rank that sees every part's marker and wins an exclusive create of the merge
lock writes the result. The output is a function of the inputs and options alone, so a part
left by an earlier attempt with the same signature is the same part.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_lite.data.indexed import merge


@dataclass(frozen=True)
class Piece:
    """Bytes ``start`` to ``end`` of an uncompressed jsonl file: the lines that begin there."""

    path: Path
    start: int
    end: int


def splittable(path: Path) -> bool:
    return path.name.endswith((".jsonl", ".json"))


def rank_inputs(paths: Sequence[Path], rank: int, world: int) -> list[Path | Piece]:
    """This rank's contiguous share of ``paths`` (whole files as paths, parts of files as pieces)."""
    sizes = [p.stat().st_size for p in paths]
    total = sum(sizes)
    lo, hi = total * rank // world, total * (rank + 1) // world
    last = rank == world - 1
    mine: list[Path | Piece] = []
    begin = 0
    for path, size in zip(paths, sizes, strict=True):
        end = begin + size
        if splittable(path) and size > 0:
            s, e = max(begin, lo), min(end, hi)
            if s < e:
                mine.append(path if (s, e) == (begin, end) else Piece(path, s - begin, e - begin))
        elif lo <= begin < hi or (last and begin == total):
            mine.append(path)
        begin = end
    return mine


def piece_blocks(piece: Piece, block_bytes: int,
                 progress: Callable[[int], None]) -> Iterator[tuple[bytes, int]]:
    """(block of whole lines, number of its first line counted from the piece's start)."""
    with open(piece.path, "rb") as f:
        pos = piece.start
        if pos > 0:
            f.seek(pos - 1)
            if f.read(1) != b"\n":  # the line under way belongs to the previous rank
                pos += len(f.readline())
        f.seek(pos)
        line = 1
        reported = piece.start
        while pos < piece.end:
            block = f.read(min(block_bytes, piece.end - pos))
            if not block:
                break
            if not block.endswith(b"\n"):
                block += f.readline()  # the last line begun before the end is ours, whole
            pos += len(block)
            yield block, line
            line += block.count(b"\n")
            progress(pos - reported)
            reported = pos


def signature(paths: Sequence[Path], world: int, options: dict) -> str:
    """Hash of the inputs (names, sizes, modification times), the options and the rank count."""
    files = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in paths]
    text = json.dumps({"files": files, "world": world, "options": options}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def part_prefix(output_prefix: str, key: str, rank: int, world: int) -> str:
    return f"{output_prefix}_{key}_document.part-{rank:05d}-of-{world:05d}"


def marker(output_prefix: str, rank: int, world: int) -> Path:
    return Path(f"{output_prefix}.part-{rank:05d}-of-{world:05d}.done.json")


def commit_part(output_prefix: str, rank: int, world: int, sig: str, summary: dict) -> None:
    """Written after the part's datasets are in place: the part is complete."""
    path = marker(output_prefix, rank, world)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"signature": sig, "summary": summary}))
    os.replace(tmp, path)


def parts_done(output_prefix: str, world: int, sig: str) -> list[dict] | None:
    """Every part's summary when all ``world`` parts are committed with this signature."""
    out = []
    for rank in range(world):
        try:
            data = json.loads(marker(output_prefix, rank, world).read_text())
        except (OSError, ValueError):
            return None
        if data.get("signature") != sig:
            return None
        out.append(data["summary"])
    return out


def merge_parts(output_prefix: str, keys: Sequence[str], world: int, sig: str,
                log: Callable[[str], None]) -> list[dict] | None:
    """If every part is committed and this rank wins the merge lock: concatenate the parts in
    rank order into ``{output_prefix}_{key}_document``, remove them, and return the parts'
    summaries; None when another rank merges or parts are missing."""
    summaries = parts_done(output_prefix, world, sig)
    if summaries is None:
        return None
    lock = Path(f"{output_prefix}.merging")
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        log(f"another rank is merging the parts ({lock} exists; if no rank is, remove it and rerun)")
        return None
    os.close(fd)
    try:
        for key in keys:
            parts = [part_prefix(output_prefix, key, r, world) for r in range(world)]
            merge(parts, f"{output_prefix}_{key}_document")
        for rank in range(world):
            for key in keys:
                for suffix in (".bin", ".idx"):
                    Path(part_prefix(output_prefix, key, rank, world) + suffix).unlink(missing_ok=True)
            marker(output_prefix, rank, world).unlink(missing_ok=True)
    finally:
        lock.unlink(missing_ok=True)
    return summaries

