"""ShardSpec: the layout-free address every parameter carries (distributed/shard_spec.py). The
tensor-parallel slices themselves are checked by the layout tests in tests/distributed."""

import pytest
import torch
from torch import nn

from megatron_lite.config.schema import ModelConfig
from megatron_lite.distributed.parallel_dims import ParallelDims
from megatron_lite.distributed.shard_spec import ShardSpec, joined, spec
from megatron_lite.model.transformer import Transformer, initial_value
from megatron_lite.parallel import build_parallel_model

CFG = ModelConfig(vocab_size=96, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, ffn_hidden=48,
                  max_seq_len=16, tie_embeddings=True, qk_norm=True)


def test_one_process_build_tags_every_parameter_with_its_plain_name_and_initial_value():
    dims = ParallelDims(world_size=1, rank=0, local_rank=0, tensor=1, pipeline=1, data=1)
    built = build_parallel_model(CFG, dims, "cpu", seed=3)
    with torch.device("meta"):
        plain = dict(Transformer(CFG).named_parameters())
    got = {spec(p).name: p for p in built.parameters()}
    assert set(got) == set(plain)  # the tied weight is one parameter, named once
    assert built.lm_head.weight is built.tok_emb.weight
    for name, p in got.items():
        where = spec(p)
        assert where.full_shape == tuple(plain[name].shape) == tuple(p.shape)
        assert not where.sharded and where.cuts == () and where.grad_sum_group is None
        torch.testing.assert_close(p.detach(), initial_value(CFG, name, p.shape, 3), rtol=0, atol=0)


def test_a_device_without_generators_builds_the_model(monkeypatch):
    """Gaudi's bridge refuses ``torch.Generator(device="hpu")``; torch refuses one on the meta
    device the same way, so a build for meta stands in for a build on HPU. The weights are
    drawn on the host: the CPU build's values are what every device gets."""
    with pytest.raises(RuntimeError):
        torch.Generator(device="meta")
    dims = ParallelDims(world_size=1, rank=0, local_rank=0, tensor=1, pipeline=1, data=1)
    made: list[str] = []
    real = torch.Generator

    def recording(device="cpu"):
        made.append(str(device))
        return real(device=device)

    monkeypatch.setattr(torch, "Generator", recording)
    built = build_parallel_model(CFG, dims, "meta", seed=3)
    assert all(p.device.type == "meta" for p in built.parameters())
    assert made and set(made) == {"cpu"}


def test_slices_of_all_ranks_put_back_together_give_the_full_tensor():
    full = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    whole = ShardSpec("w", (8, 6))
    assert whole.local(full) is full
    for dim in (0, 1):
        parts = [whole.sliced(dim, rank, 2) for rank in range(2)]
        assert [p.cuts for p in parts] == [((dim, 0, 2),), ((dim, 1, 2),)]
        pieces = [p.local(full) for p in parts]
        assert all(piece.shape[dim] == full.shape[dim] // 2 for piece in pieces)
        torch.testing.assert_close(torch.cat(pieces, dim), full)
    # A tile of a tensor-parallel slice: the slice's rows, then a 2 x 2 grid over the slice.
    tiles = [whole.sliced(0, 1, 2).tiled(r, c, 2) for r in range(2) for c in range(2)]
    assert tiles[1].cuts == ((0, 1, 2), (0, 0, 2), (1, 1, 2))
    torch.testing.assert_close(tiles[1].local(full), full[4:6, 3:6])
    other_half = [(((0, 0, 2),), full[:4])]
    torch.testing.assert_close(joined([*other_half, *((t.cuts, t.local(full)) for t in tiles)]), full)
    assert joined([(t.cuts, t.local(full)) for t in tiles])[:4].isnan().all()  # not covered
    group = object()
    summed = whole.summed_over(group)
    assert summed.grad_sum_group is group and whole.grad_sum_group is None  # replaced, not edited


def test_a_parameter_without_a_spec_names_the_builder():
    with pytest.raises(AttributeError, match="build_parallel_model"):
        spec(nn.Parameter(torch.zeros(2, 3)))
