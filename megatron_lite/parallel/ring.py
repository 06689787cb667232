"""Ring attention: context parallelism (``parallel.context``), Megatron-LM's
``--context-parallel-size`` with its causal load balancing.

The sequence is cut into 2·C chunks and context rank r holds chunks r and 2C−1−r, so every rank
does the same causal work. Queries stay; keys and values travel around the ring (only the KV
heads under GQA, repeated to the query heads on arrival), each rank attending its queries to
each block it receives; the blocks' partial results merge by their log-sum-exp. Backward, the
keys' and values' gradients travel with them and arrive back at their owner after a full turn.
Each block's kernel is torch's flash attention with its log-sum-exp (``engine/internals.py``:
``attention_with_lse``); the next block's transfer overlaps the current block's compute.

Written here because no maintained implementation fits: torch's context parallelism
(``torch.distributed.tensor.experimental.context_parallel``) dispatches only CUDA's attention
kernels and its private ring functions changed signature between the torch releases this
project supports; DeepSpeed has Ulysses but no ring. Under Ulysses as well (USP), the Ulysses
all-to-all runs first and this ring runs on the heads it leaves each rank
(``parallel/apply.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_lite.distributed import collectives
from megatron_lite.engine.internals import attention_with_lse, attention_with_lse_backward
from megatron_lite.model.document_attention import document_mask
from megatron_lite.model.transformer import document_positions


def ring_positions(seq_len: int, size: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The positions, in order, of the tokens context rank ``rank`` of ``size`` holds: chunks
    ``rank`` and ``2·size−1−rank`` of ``2·size`` equal chunks of ``seq_len`` tokens."""
    chunk = seq_len // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    return torch.cat([first, first + (2 * size - 1 - 2 * rank) * chunk])


def sequence_positions(seq_len: int, ulysses: int, ulysses_rank: int, context: int, context_rank: int,
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """The positions of the tokens a rank holds between attentions: its context rank's tokens
    (``ring_positions``) cut into ``ulysses`` equal consecutive slices, this rank's slice. (The
    Ulysses all-to-all gathers the context rank's tokens back, in this order, for attention.)"""
    held = ring_positions(seq_len, context, context_rank, device)
    return held.chunk(ulysses)[ulysses_rank]


class RingAttention(nn.Module):
    """Wraps ``CausalAttention`` (its RoPE kernel; no attention dropout): (B, T/C, H, hd) queries
    and (B, T/C, Hkv, hd) keys and values in, this rank's (B, T/C, H, hd) out, attending over the
    whole sequence of the context group."""

    def __init__(self, core: nn.Module, group, rank: int, size: int):
        super().__init__()
        self.core, self.group, self.rank, self.size = core, group, rank, size

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """``documents``: (B, T) the document of every token of the context group's sequence,
        or None (one causal sequence)."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T/C, hd)
        if rope is not None:
            positions = ring_positions(q.size(2) * self.size, self.size, self.rank, q.device)
            if documents is None:
                cos, sin = rope[0][positions], rope[1][positions]  # (T/C, hd)
            else:
                in_document = document_positions(documents)[:, positions]  # (B, T/C)
                cos, sin = rope[0][in_document].unsqueeze(1), rope[1][in_document].unsqueeze(1)
            q, k = self.core.rotate(q, cos, sin), self.core.rotate(k, cos, sin)
        y = _RingAttention.apply(q, k.contiguous(), v.contiguous(), self.group, self.rank, self.size,
                                 documents)
        return y.transpose(1, 2)  # (B, T/C, H, hd)


def _heads(x: torch.Tensor, repeat: int) -> torch.Tensor:
    """(B, Hkv, T, hd) keys or values to the query heads (query head h uses KV head h // repeat)."""
    return x if repeat == 1 else x.repeat_interleave(repeat, dim=1)


def _kv_heads(grad: torch.Tensor, repeat: int) -> torch.Tensor:
    """(B, H, T, hd) gradient of repeated keys or values -> (B, Hkv, T, hd), summed per KV head."""
    if repeat == 1:
        return grad
    B, H, T, hd = grad.shape
    return grad.view(B, H // repeat, repeat, T, hd).sum(2)


def _block(step: int, rank: int, size: int, half: int) -> tuple[slice, slice, bool]:
    """At ring step ``step`` a rank holds the keys of rank (rank − step) mod size: which of its
    query rows and which of the received key rows take part, and whether causally. Step 0: its
    own chunks, causal. A source before it: every query over the source's first chunk (its
    second lies after both of ours). A source after it: our second chunk over both of the
    source's (our first lies before both of theirs)."""
    everything = slice(None)
    if step == 0:
        return everything, everything, True
    if (rank - step) % size < rank:
        return everything, slice(0, half), False
    return slice(half, None), everything, False


def _block_mask(documents: torch.Tensor | None, step: int, rank: int, size: int, rows: slice,
                cols: slice) -> torch.Tensor | None:
    """(B, 1, rows, cols) which of this block's keys each query sees when attention stays
    within documents (each position's document is known to every rank: no transfer); None for
    plain causal attention."""
    if documents is None:
        return None
    seq = documents.size(1)
    q_pos = ring_positions(seq, size, rank, documents.device)[rows]
    k_pos = ring_positions(seq, size, (rank - step) % size, documents.device)[cols]
    return document_mask(documents[:, q_pos], documents[:, k_pos], q_pos, k_pos)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, rank: int, size: int, documents):
        # q (B, H, T/C, hd); k, v (B, Hkv, T/C, hd); documents (B, T) or None
        repeat, half = q.size(1) // k.size(1), q.size(2) // 2
        kv = torch.stack([k, v])  # (2, B, Hkv, T/C, hd): one transfer per step
        out = lse = None
        extras = []
        for step in range(size):
            wait = collectives.ring_exchange_start(kv, group) if step < size - 1 else None
            rows, cols, causal = _block(step, rank, size, half)
            block_out, block_lse, extra = attention_with_lse(
                q[:, :, rows], _heads(kv[0][:, :, cols], repeat), _heads(kv[1][:, :, cols], repeat), causal,
                _block_mask(documents, step, rank, size, rows, cols))
            extras.append(extra)
            if out is None:  # step 0 covers every row
                out, lse = block_out.float(), block_lse
            else:
                merged_lse = torch.logaddexp(lse[:, :, rows], block_lse)  # (B, H, rows)
                merged = (out[:, :, rows] * torch.exp(lse[:, :, rows] - merged_lse).unsqueeze(-1)
                          + block_out.float() * torch.exp(block_lse - merged_lse).unsqueeze(-1))
                out, lse = out.clone(), lse.clone()
                out[:, :, rows], lse[:, :, rows] = merged, merged_lse
            if wait is not None:
                kv = wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.rank, ctx.size, ctx.extras, ctx.documents = group, rank, size, extras, documents
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, rank, size = ctx.group, ctx.rank, ctx.size
        repeat, half = q.size(1) // k.size(1), q.size(2) // 2
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack([k, v])
        # The gradient of the keys and values held travels with them, each rank adding its
        # blocks' share; the next block is computed while it is in flight, and after the last
        # step the exchange brings each rank its own.
        dkv_wait = None
        for step in range(size):
            wait = collectives.ring_exchange_start(kv, group) if step < size - 1 else None
            rows, cols, causal = _block(step, rank, size, half)
            dq_b, dk_b, dv_b = attention_with_lse_backward(
                dout[:, :, rows], q[:, :, rows], _heads(kv[0][:, :, cols], repeat),
                _heads(kv[1][:, :, cols], repeat), out[:, :, rows], lse[:, :, rows].contiguous(), causal,
                ctx.extras[step], _block_mask(ctx.documents, step, rank, size, rows, cols))
            dq[:, :, rows] += dq_b.float()
            # The partial sums for the keys held now (the previous rank's, sent after its block).
            dkv = torch.zeros_like(kv, dtype=torch.float32) if dkv_wait is None else dkv_wait()
            dkv[0][:, :, cols] += _kv_heads(dk_b.float(), repeat)
            dkv[1][:, :, cols] += _kv_heads(dv_b.float(), repeat)
            dkv_wait = collectives.ring_exchange_start(dkv, group)
            if wait is not None:
                kv = wait()
        dkv = dkv_wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None
