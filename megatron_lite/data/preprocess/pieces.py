"""A rank's share of the input: the input files laid end to end and cut into ``world`` equal byte
ranges; an uncompressed jsonl file is split inside (a line belongs to the rank whose range holds
its first byte), other files are whole units."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path


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
        # The bytes of the lines this rank reads (the line it skips is the previous rank's):
        # the ranks' counts add up to the file's size.
        reported = pos
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
