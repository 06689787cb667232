"""Which random streams agree across ranks and which differ.

Seeds (``rank_seed``): data-parallel replicas and sequence slices (Ulysses, context) see different tokens,
so their dropout differs. Tensor-parallel ranks hold the same activations outside the parallel
regions, so there their dropout must agree - except with Megatron sequence parallelism, where
each tensor rank holds its own slice of the sequence (and must differ). Inside attention each
tensor rank holds different heads: ``TensorParallelRNG`` forks the stream there.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_lite.distributed.parallel_dims import ParallelDims


def rank_seed(seed: int, dims: ParallelDims) -> int:
    """Seed of this rank's default generator (dropout), given the run's ``seed``."""
    stream = dims.dp_rank * dims.sequence + dims.sequence_rank
    if dims.sequence_parallel:
        stream = stream * dims.tensor + dims.tp_rank
    # Pipeline stages run different layers: their streams need not relate, but differ anyway.
    return seed + 1 + stream + 7919 * dims.pp_rank


class TensorParallelRNG(nn.Module):
    """Runs ``inner`` with a generator that differs per tensor rank.

    The fork's seed is drawn from the default generator, identical on the tensor ranks and
    replayed exactly by activation checkpointing, so the recomputed masks are the same."""

    def __init__(self, inner: nn.Module, tp_rank: int):
        super().__init__()
        self.inner, self.tp_rank = inner, tp_rank

    def forward(self, *args):
        if not self.training:
            return self.inner(*args)
        seed = int(torch.randint(1 << 62, (1,)).item()) + self.tp_rank
        device = args[0].device
        with torch.random.fork_rng(devices=[device] if device.type != "cpu" else [],
                                   device_type=device.type):
            torch.manual_seed(seed)
            return self.inner(*args)
