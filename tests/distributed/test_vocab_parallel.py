"""Vocabulary-parallel cross-entropy on 2 and 4 gloo processes equals
``F.cross_entropy`` on the gathered logits, in values and gradients; with a padded vocabulary
(ids from ``used`` on are padding, a whole rank's slice of them with 4 ranks) it equals the
cross-entropy of the unpadded logits, and the padding gets no gradient."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


def _worker(rank: int, world: int, used: int, init_file: str, results) -> None:
    from megatron_lite.parallel.tensor_parallel import vocab_parallel_cross_entropy

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(0)
    n, vocab = 37, 96
    logits = torch.randn(n, vocab, generator=gen) * 5
    targets = torch.randint(0, used, (n,), generator=gen)
    targets[0], targets[1] = 0, used - 1  # the first and the last id of the vocabulary
    upstream = torch.rand(n, generator=gen)

    local = logits.chunk(world, dim=1)[rank].clone().requires_grad_()
    group = dist.new_group()  # an accelerator group, as the tensor-parallel one is
    losses = vocab_parallel_cross_entropy(local, targets, group, rank * (vocab // world), used)
    (losses * upstream).sum().backward()
    # As numpy arrays: pickled by value. A torch tensor would travel as a file descriptor that
    # the parent fetches from this process, which may have exited by then.
    results.put((rank, losses.detach().numpy(), local.grad.numpy()))
    dist.barrier()  # every rank done before any tears its groups down
    dist.destroy_process_group()


@pytest.mark.parametrize("world, used", [(2, 96), (4, 96), (2, 95), (4, 50)])
def test_vocab_parallel_cross_entropy_equals_the_gathered_one(tmp_path, world, used):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = str(tmp_path / "init")
    procs = [ctx.Process(target=_worker, args=(r, world, used, init, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = {r: (torch.from_numpy(loss), torch.from_numpy(grad))
           for r, loss, grad in (results.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0

    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 96, generator=gen) * 5).requires_grad_()
    targets = torch.randint(0, used, (37,), generator=gen)
    targets[0], targets[1] = 0, used - 1
    upstream = torch.rand(37, generator=gen)
    expected = F.cross_entropy(logits[:, :used], targets, reduction="none")
    (expected * upstream).sum().backward()
    for r in range(world):
        loss, grad = got[r]
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, logits.grad.chunk(world, dim=1)[r], rtol=1e-6, atol=1e-7)
