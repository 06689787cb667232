"""Ring attention (parallel/ring.py) on 2 and 4 gloo processes equals the model's causal
attention over the whole sequence in one process: outputs and the gradients of queries, keys and
values, with grouped-query attention and RoPE at each token's own position."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

B, T, H, KV, HD = 2, 32, 4, 2, 8


def _inputs():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, HD, generator=gen)
    k = torch.randn(B, T, KV, HD, generator=gen)
    v = torch.randn(B, T, KV, HD, generator=gen)
    upstream = torch.randn(B, T, H, HD, generator=gen)
    return q, k, v, upstream


def _rope():
    from megatron_lite.model.transformer import rope_tables

    return rope_tables(HD, T, 10000.0)


def _worker(rank: int, world: int, init_file: str, results) -> None:
    from megatron_lite.model.transformer import CausalAttention
    from megatron_lite.parallel.ring import RingAttention, ring_positions

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    group = dist.new_group()  # an accelerator group, as the context-parallel one is
    q, k, v, upstream = _inputs()
    mine = ring_positions(T, world, rank)
    local = [x[:, mine].clone().requires_grad_() for x in (q, k, v)]
    ring = RingAttention(CausalAttention(0.0), group, rank, world)
    out = ring(*local, _rope())
    (out * upstream[:, mine]).sum().backward()
    # As numpy arrays: pickled by value (a tensor would travel as a file descriptor).
    results.put((rank, out.detach().numpy(), *(x.grad.numpy() for x in local)))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_equals_one_process(tmp_path, world):
    from megatron_lite.model.transformer import CausalAttention
    from megatron_lite.parallel.ring import ring_positions

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, str(tmp_path / "init"), results))
             for r in range(world)]
    for p in procs:
        p.start()
    got = {r: [torch.from_numpy(a) for a in rest] for r, *rest in (results.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0

    q, k, v, upstream = (x.clone().requires_grad_() for x in _inputs())
    out = CausalAttention(0.0)(q, k, v, _rope())
    (out * upstream).sum().backward()
    for r in range(world):
        mine = ring_positions(T, world, r)
        for name, value, expected in zip(("out", "dq", "dk", "dv"), got[r],
                                         (out.detach(), q.grad, k.grad, v.grad), strict=True):
            torch.testing.assert_close(value, expected[:, mine], rtol=1e-5, atol=1e-5,
                                       msg=f"rank {r}: {name}")


def test_each_rank_holds_two_chunks_and_the_ranks_cover_the_sequence_once():
    from megatron_lite.parallel.ring import ring_positions, sequence_positions

    assert ring_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert ring_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    held = torch.cat([sequence_positions(48, 2, u, 3, c) for c in range(3) for u in range(2)])
    assert sorted(held.tolist()) == list(range(48))
    # Ulysses alone: consecutive slices, as before context parallelism.
    assert sequence_positions(8, 2, 1, 1, 0).tolist() == [4, 5, 6, 7]
