"""``ShardSpec``: how one of this rank's parameters relates to the plain single-device model.

Parallelism swaps modules (a tensor-parallel linear holds a slice of the plain one; a pipeline
stage keeps some blocks), so a parameter's module path depends on the layout. Initialisation,
checkpoints, gradient clipping and gradient reduction need the layout-free address instead:
the plain-model name and shape, which slice of it this rank holds, and the group its gradient
is summed over. That is one typed record per parameter, set when the plain model is built
(``tag``) and replaced, never edited, by the parallelize step (``ShardSpec.sliced``,
``ShardSpec.tiled``, ``ShardSpec.summed_over``).

Where a parameter sits in the plain tensor is a list of *cuts*, applied in order: ``(dim, index,
count)`` keeps piece ``index`` of ``count`` equal pieces along ``dim``. A tensor-parallel slice is
one cut; a tile of memory-centric tiling adds two (rows, then columns). ``piece`` and ``joined``
go from the whole to a piece and back, for checkpoints and tests alike.

It lives here, below ``parallel/``, because ``checkpoint/`` and ``training/`` read it too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

_ATTRIBUTE = "shard_spec"

Cut = tuple[int, int, int]
"""(dim, index, count): piece ``index`` of ``count`` equal pieces along ``dim``."""


def piece(whole: torch.Tensor, cuts: Iterable[Cut]) -> torch.Tensor:
    """The piece of ``whole`` that ``cuts`` describe (a view)."""
    for dim, index, count in cuts:
        whole = whole.chunk(count, dim)[index]
    return whole


def whole_shape(piece_shape: Iterable[int], cuts: Iterable[Cut]) -> tuple[int, ...]:
    """The shape of the tensor that ``cuts`` of equal pieces were taken from."""
    shape = list(piece_shape)
    for dim, _, count in cuts:
        shape[dim] *= count
    return tuple(shape)


def joined(pieces: Iterable[tuple[Iterable[Cut], torch.Tensor]]) -> torch.Tensor:
    """The whole tensor from its pieces, each ``(cuts, value)``; what no piece covers is NaN."""
    whole = None
    for cuts, value in pieces:
        cuts = [tuple(c) for c in cuts]
        if whole is None:
            whole = torch.full(whole_shape(value.shape, cuts), torch.nan, dtype=value.dtype)
        piece(whole, cuts).copy_(value)
    if whole is None:
        raise ValueError("no pieces to join")
    return whole


@dataclass(frozen=True)
class ShardSpec:
    name: str
    """The parameter's name in the plain model (``blocks.0.attn.qkv_proj.weight``)."""
    full_shape: tuple[int, ...]
    """Its shape in the plain model."""
    dim: int | None = None
    """The dimension split over the tensor-parallel ranks; None: this rank holds all of it."""
    rank: int = 0
    """Which of the ``size`` equal slices this rank holds."""
    size: int = 1
    """How many slices there are."""
    tile: tuple[int, int] | None = None
    """Memory-centric tiling: (factor, factor)-grid position ``(row, column)`` of this tile in
    the (tensor-parallel slice of the) weight matrix; None: not tiled."""
    tiles: int = 1
    """The tiling factor: the matrix is cut into ``tiles`` × ``tiles`` equal tiles."""
    grad_sum_group: Any = None
    """A process group over which the gradient is summed before anything else reads it (a
    replicated parameter that sees only this rank's part of the activations: a norm under
    sequence parallelism, a per-head norm inside a tensor-parallel region); None: no sum."""

    @property
    def sharded(self) -> bool:
        """Sliced over the tensor-parallel ranks (each holds different values)."""
        return self.dim is not None

    @property
    def cuts(self) -> tuple[Cut, ...]:
        """Where this parameter sits in the plain tensor (the form checkpoints record)."""
        out: tuple[Cut, ...] = ()
        if self.dim is not None:
            out += ((self.dim, self.rank, self.size),)
        if self.tile is not None:
            out += ((0, self.tile[0], self.tiles), (1, self.tile[1], self.tiles))
        return out

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``full`` (a tensor of ``full_shape``)."""
        return piece(full, self.cuts)

    def sliced(self, dim: int, rank: int, size: int) -> ShardSpec:
        return dataclasses.replace(self, dim=dim, rank=rank, size=size)

    def tiled(self, row: int, column: int, factor: int) -> ShardSpec:
        return dataclasses.replace(self, tile=(row, column), tiles=factor)

    def summed_over(self, group) -> ShardSpec:
        return dataclasses.replace(self, grad_sum_group=group)


def spec(param: nn.Parameter) -> ShardSpec:
    try:
        return getattr(param, _ATTRIBUTE)
    except AttributeError:
        raise AttributeError(f"parameter of shape {tuple(param.shape)} has no ShardSpec: models are "
                             "built by parallel.build_parallel_model, which tags every "
                             "parameter") from None


def set_spec(param: nn.Parameter, value: ShardSpec) -> nn.Parameter:
    setattr(param, _ATTRIBUTE, value)
    return param


def tag(module: nn.Module, prefix: str = "") -> None:
    """Give every parameter of the plain ``module`` its whole-tensor ShardSpec."""
    for name, param in module.named_parameters():
        set_spec(param, ShardSpec(prefix + name, tuple(param.shape)))
