"""Memory-centric tiling (parallel/tiling.py): a tiled model is the untiled model, cut into more
parameters. The multi-rank run under ZeRO-3 is a layout in tests/distributed/test_layouts.py."""

import pytest
import torch

from megatron_lite.config import load_config
from megatron_lite.config.schema import ModelConfig
from megatron_lite.distributed.parallel_dims import ParallelDims
from megatron_lite.distributed.shard_spec import joined, spec
from megatron_lite.parallel import build_parallel_model
from megatron_lite.parallel.tiling import TiledLinear
from tests.conftest import REPO

ONE = ParallelDims(world_size=1, rank=0, local_rank=0, tensor=1, pipeline=1, data=1)


@pytest.mark.parametrize("activation, bias", [("swiglu", False), ("gelu", True)])
def test_tiled_model_is_the_untiled_model(activation, bias):
    cfg = ModelConfig(vocab_size=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, ffn_hidden=64,
                      max_seq_len=16, activation=activation, bias=bias, position="rope", norm="rmsnorm")
    plain = build_parallel_model(cfg, ONE, "cpu", seed=5)
    tiled = build_parallel_model(cfg, ONE, "cpu", seed=5, tile_factor=4)
    tiles = [m for m in tiled.modules() if isinstance(m, TiledLinear)]
    assert len(tiles) == 2 * 4  # q|k|v, o, gate|up or up, down in each of 2 blocks
    # Each weight is 16 separate tiles that ZeRO-3 can gather one at a time.
    assert sum(1 for _ in tiles[0].tiles.parameters()) == 16

    x = torch.randint(0, 64, (2, 16))
    y = torch.randint(0, 64, (2, 16))
    losses = [model(x, y) for model in (plain, tiled)]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for loss in losses:
        loss.backward()

    def by_name(model, what):
        pieces: dict[str, list] = {}
        for p in model.parameters():
            pieces.setdefault(spec(p).name, []).append((spec(p).cuts, what(p)))
        return {name: joined(parts) for name, parts in pieces.items()}

    for what in (lambda p: p.detach(), lambda p: p.grad):
        want, got = by_name(plain, what), by_name(tiled, what)
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_tile_factor_is_checked_before_the_run():
    from megatron_lite.config.load import ConfigError

    recipe = REPO / "recipes/shakespeare-char.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(recipe, ["parallel.tile_factor=4", "parallel.zero_stage=2"])
    assert "'parallel.tile_factor' = 4 saves memory only under ZeRO-3" in str(err.value)
    # shakespeare-char: d_model 128 (4 heads of 32), MLP 512: 3 divides none of them.
    with pytest.raises(ConfigError, match=r"must divide both dimensions of every block linear, "
                                          r"but qkv_proj is 384 x 128"):
        load_config(recipe, ["parallel.tile_factor=3", "parallel.zero_stage=3"])
    assert load_config(recipe, ["parallel.tile_factor=4", "parallel.zero_stage=3"]).parallel.tile_factor == 4
