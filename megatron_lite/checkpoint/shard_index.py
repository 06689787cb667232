"""What a resuming rank reads: the manifest lists every rank file's fragments (their name, cuts
and element range), and a rank opens only the files holding a fragment its own parameters need,
in whatever layout they were written."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from megatron_lite.distributed.shard_spec import Cut, spec, whole_shape
from megatron_lite.engine import internals as ds
from megatron_lite.model.fused import fusable

IndexEntry = tuple[str, tuple[Cut, ...], tuple[int, ...], int, int]
"""A fragment as a manifest lists it: (name, cuts, slice_shape, start, numel)."""


def fragment_index(fragments: Iterable[dict]) -> list[list]:
    """The manifest's list of a rank file's fragments (``Fragment.to_dict`` records), so that a
    resuming rank opens only the files that hold what it needs."""
    return [[f["name"], [list(c) for c in f["cuts"]], list(f["slice_shape"]), f["start"],
             f["tensors"]["param"].numel()] for f in fragments]


def _box(whole: Sequence[int], cuts: Iterable[Cut]) -> list[tuple[int, int]]:
    """The index ranges, one per dimension, of the piece ``cuts`` take from a tensor of shape
    ``whole`` (``torch.chunk``'s pieces)."""
    region = [(0, n) for n in whole]
    for dim, index, count in cuts:
        lo, hi = region[dim]
        size = -(-(hi - lo) // count)
        region[dim] = (min(lo + index * size, hi), min(lo + (index + 1) * size, hi))
    return region


@dataclass(frozen=True)
class Need:
    """What one of this rank's parameters needs from a checkpoint: elements ``lo``..``hi`` of
    its flattened piece (the whole piece, or its ZeRO-3 partition)."""

    name: str
    whole: tuple[int, ...]
    cuts: tuple[Cut, ...]
    lo: int
    hi: int


def held_range(p: nn.Parameter) -> tuple[int, int]:
    """The elements of ``p``'s flattened piece this rank holds: its ZeRO-3 partition, or all."""
    start, numel = ds.zero3_range(p) if ds.is_zero3(p) else (0, p.numel())
    return start, start + numel


def needs(module: nn.Module) -> list[Need]:
    return [Need(spec(p).name, tuple(spec(p).full_shape), tuple(spec(p).cuts), *held_range(p))
            for p in module.parameters()]


def serves(entry: Sequence, need: Need) -> bool:
    """Whether a listed fragment (``IndexEntry``) holds elements ``need`` asks for. Where the
    two layouts cut the tensor differently, pieces that overlap count whole; a tensor recorded
    with another shape (another vocabulary padding) always counts."""
    name, cuts, slice_shape, start, numel = entry
    cuts = tuple(tuple(c) for c in cuts)
    whole = whole_shape(slice_shape, cuts)
    if name != need.name:
        return False
    if whole != need.whole:
        return True
    if cuts == need.cuts:
        return start < need.hi and need.lo < start + numel
    mine, theirs = _box(need.whole, need.cuts), _box(whole, cuts)
    return all(a < d and c < b for (a, b), (c, d) in zip(mine, theirs, strict=True))


def has_fragment_index(files: list[dict]) -> bool:
    """Whether a manifest lists each file's fragments (not one written before the index
    existed: then every file is read)."""
    return all(isinstance(f.get("fragments"), list) for f in files)


def lists_unfused(files: list[dict]) -> bool:
    """Whether a manifest's index lists separate q/k/v or gate/up projections (a checkpoint
    written before they were fused: ``model/fused.py``)."""
    return bool(fusable(entry[0] for f in files for entry in f["fragments"]))


def needed_files(files: list[dict], module: nn.Module, always: Iterable[str]) -> list[dict]:
    """The manifest entries of the files holding a fragment this rank's parameters need, plus
    ``always`` (rank 0's trainer state, this rank's own RNG state)."""
    by_name: dict[str, list[Need]] = {}
    for need in needs(module):
        by_name.setdefault(need.name, []).append(need)
    always = set(always)
    return [f for f in files if f["name"] in always or any(
        serves(entry, need) for entry in f["fragments"] for need in by_name.get(entry[0], ()))]
