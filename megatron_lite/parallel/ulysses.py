"""DeepSpeed-Ulysses sequence parallelism: every rank holds 1/N of each sequence; attention
is computed on 1/N of the heads over the whole sequence after an all-to-all
(``deepspeed.sequence.layer.DistributedAttention``) and the result is sent back."""

from __future__ import annotations

import torch
from torch import nn

from megatron_lite.distributed import collectives
from megatron_lite.model.loss import IGNORED
from megatron_lite.parallel import comm
from megatron_lite.parallel.ring import sequence_positions


class UlyssesAttention(nn.Module):
    """Wraps ``CausalAttention``: (B, T/N, H, hd) in and out, full-sequence attention inside."""

    def __init__(self, core: nn.Module, group):
        super().__init__()
        from deepspeed.sequence.layer import DistributedAttention

        # scatter the heads (dim 2), gather the sequence (dim 1); batch first.
        self.dist_attn = DistributedAttention(core, group, scatter_idx=2, gather_idx=1)

    def forward(self, q, k, v, rope, documents=None):
        # ``documents`` (B, T) covers the whole sequence already: it passes through as it is.
        return self.dist_attn(q, k, v, 0, None, rope, documents)


class HeldPositions(nn.Module):
    """Learned position embedding of the tokens this rank holds of each sequence
    (``ring.sequence_positions``: a Ulysses slice, of the context rank's two chunks)."""

    def __init__(self, emb: nn.Embedding, ulysses: int, ulysses_rank: int, context: int, context_rank: int):
        super().__init__()
        self.emb = emb
        self.split = (ulysses, ulysses_rank, context, context_rank)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """``positions``: (T/N,) this rank's count of them (positions from 0), or (B, T) each
        token's position in its document over the whole sequence."""
        ulysses, _, context, _ = self.split
        if positions.dim() == 2:
            held = sequence_positions(positions.size(1), *self.split, positions.device)
            return self.emb(positions[:, held])
        held = sequence_positions(positions.numel() * ulysses * context, *self.split, positions.device)
        return self.emb(held)


class SequenceMeanLoss(nn.Module):
    """The loss over the whole sequence from each rank's slice (Ulysses, context or both: the
    ``sequence`` group): the mean of the slices' mean losses (equal slices), summed forward,
    passed through unchanged backward - each rank's gradients are its slice's share, which
    DeepSpeed sums over the sequence ranks."""

    def __init__(self, head: nn.Module, group, size: int):
        super().__init__()
        self.head, self.group, self.size = head, group, size
        # With ignored targets (data.eod_mask_loss) the slices' means are weighted by the
        # targets each counts, so the loss is the mean over the whole sequence's.
        self.skips_ignored = False

    @property
    def weight(self) -> torch.Tensor:
        """The output layer's weight (a pipeline's last stage ties it to the embedding)."""
        return self.head.weight

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        out = self.head(x, targets)
        if targets is None:
            return out
        if self.skips_ignored:
            counted = (targets != IGNORED).sum().float()
            total = counted.clone()
            collectives.all_reduce(total, self.group)
            return comm.exit_region(out * (counted / total.clamp_min(1)), self.group, False)
        return comm.exit_region(out, self.group, False) / self.size
