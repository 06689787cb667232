"""Memory-centric tiling (``parallel.tile_factor``, from ZeRO-Infinity): every linear of a block
cut into factor × factor tiles, each its own parameter.

ZeRO-3 gathers a module's parameters just before the module runs and frees them after, so the
largest thing it ever materializes is one parameter with its gradient. For a layer too large for
a device's free memory (a wide MLP), tiles bring that down by factor²: each tile is a separate
``nn.Linear`` that ZeRO-3 gathers, uses and frees in turn. DeepSpeed's ``TiledLinear`` runs the
tiles (partial products summed over the input tiles, output tiles concatenated); this step gives
every tile its ``ShardSpec`` (its place in the plain weight), so initialisation, checkpoints and
tests see the plain layer, and a tiled run's checkpoint loads into an untiled layout and back.

It applies after the tensor-parallel step (a rank tiles its own slice) and keeps the bias whole:
a column-parallel or plain linear adds it to the joined output, a row-parallel one leaves it to
its region (``TensorParallelRegion``), as before.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_lite.distributed.shard_spec import set_spec, spec
from megatron_lite.model.transformer import Block
from megatron_lite.parallel.tensor_parallel import RowParallelLinear, TensorParallelRegion

LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "up_proj", "down_proj")
"""The block linears that are tiled (the vocabulary layers are not: see docs/parallelism.md)."""


def tile_of(weight: nn.Parameter, row: int, column: int, factor: int) -> nn.Parameter:
    """A new (empty) parameter for tile (row, column) of ``weight`` cut into factor × factor;
    it keeps ``weight``'s marks (a tensor-parallel slice stays one for DeepSpeed)."""
    rows, columns = weight.shape
    out = nn.Parameter(torch.empty(rows // factor, columns // factor, device=weight.device,
                                   dtype=weight.dtype))
    out.__dict__.update(weight.__dict__)
    return set_spec(out, spec(weight).tiled(row, column, factor))


class TiledLinear(nn.Module):
    """A linear layer (plain, column- or row-parallel) as factor × factor tiles: (.., in) ->
    (.., out), the same function; ``add_bias``: add the bias here (not for a row-parallel one)."""

    def __init__(self, linear: nn.Module, factor: int, add_bias: bool):
        super().__init__()
        from deepspeed.runtime.zero.tiling import TiledLinear as DeepSpeedTiledLinear

        rows, columns = linear.weight.shape
        with torch.device("meta"):  # its own tiles are replaced just below
            self.tiles = DeepSpeedTiledLinear(columns, rows, bias=False, in_splits=factor,
                                              out_splits=factor)
        for row, tiles in enumerate(self.tiles.linears):
            for column, tile in enumerate(tiles):
                tile.weight = tile_of(linear.weight, row, column, factor)
        self.bias = linear.bias
        self.add_bias = add_bias and linear.bias is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tiles(x)
        return y + self.bias if self.add_bias else y


def tile_linears(model: nn.Module, factor: int) -> nn.Module:
    """Replace every block linear of a parallelized meta model by its tiled form, in place."""
    if factor == 1:
        return model
    for block in (m for m in model.modules() if isinstance(m, Block)):
        for part in (block.attn, block.mlp):
            inner = part.inner if isinstance(part, TensorParallelRegion) else part
            for name in LINEARS:
                linear = getattr(inner, name, None)
                if linear is None:
                    continue
                rows, columns = linear.weight.shape
                if rows % factor or columns % factor:  # recipes are checked before (validate.py)
                    raise ValueError(f"tile factor {factor} does not divide {name}'s {rows} x {columns}")
                setattr(inner, name, TiledLinear(linear, factor,
                                                 add_bias=not isinstance(linear, RowParallelLinear)))
    return model
