"""The host copies a save takes (checkpoint/host_copy.py): buffers kept from save to save,
holding the values of the moment of the copy."""

import pytest
import torch

from megatron_lite.checkpoint.host_copy import HostCopies
from megatron_lite.checkpoint.shards import local_fragments
from megatron_lite.distributed import device as devmod


def test_the_buffers_are_reused_and_hold_the_values_at_the_copy():
    copies = HostCopies(devmod.select_accelerator("cpu"))
    weights, moments = torch.arange(6.0), torch.ones(3, 2, dtype=torch.bfloat16)
    copies.begin()
    first = copies.copy(("w", "param"), weights), copies.copy(("w", "exp_avg"), moments)
    copies.end()
    copies.wait()
    weights.add_(100.0)  # the next optimizer step, while the writer still reads the copy
    torch.testing.assert_close(first[0], torch.arange(6.0), rtol=0, atol=0)
    assert first[1].dtype == torch.bfloat16 and first[1].shape == (6,)
    copies.begin()
    second = copies.copy(("w", "param"), weights)
    copies.end()
    copies.wait()
    assert second.data_ptr() == first[0].data_ptr()  # no new host memory per save
    torch.testing.assert_close(second, torch.arange(6.0) + 100.0, rtol=0, atol=0)
    # Two tensors under one key (two tiles of a weight, say) would share a buffer: refused.
    with pytest.raises(ValueError, match="under the key"):
        copies.copy(("w", "param"), moments)


def test_by_default_each_fragment_is_a_new_fp32_host_clone():
    """Without a HostCopies (tools), local_fragments keeps its own clones."""
    from megatron_lite.config.schema import ModelConfig
    from megatron_lite.distributed.parallel_dims import ParallelDims
    from megatron_lite.parallel import build_parallel_model

    class Engine:
        def __init__(self, module):
            self.module = module
            self.optimizer = torch.optim.AdamW(module.parameters())

    cfg = ModelConfig(vocab_size=32, n_layers=1, n_heads=2, d_model=16, ffn_hidden=32, max_seq_len=8)
    dims = ParallelDims(world_size=1, rank=0, local_rank=0, tensor=1, pipeline=1, data=1)
    engine = Engine(build_parallel_model(cfg, dims, "cpu", seed=0))
    fragments = local_fragments(engine, dims)
    by_name = {f.name: f for f in fragments}
    weight = engine.module.tok_emb.weight
    assert by_name["tok_emb.weight"].tensors["param"].data_ptr() != weight.data_ptr()
    torch.testing.assert_close(by_name["tok_emb.weight"].tensors["param"], weight.detach().reshape(-1))
