"""Megatron-style tensor-parallel layers. Each holds one rank's slice of a plain layer.

The linears do no communication themselves: a sub-layer (attention, MLP) is wrapped in a
``TensorParallelRegion`` that enters and leaves the region with one collective each way
(``comm``), as Megatron's fused-QKV layers do, instead of one per linear.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.distributed import collectives
from megatron_lite.distributed.shard_spec import set_spec, spec
from megatron_lite.engine import internals
from megatron_lite.model.loss import IGNORED
from megatron_lite.parallel import comm


def slice_of(param: nn.Parameter, dim: int, rank: int, size: int) -> nn.Parameter:
    """A new (empty) parameter for slice ``rank`` of ``size`` along ``dim`` of ``param``; its
    ShardSpec says so, and DeepSpeed's gradient-norm code is told to count it on every rank."""
    shape = list(param.shape)
    shape[dim] = shape[dim] // size
    out = nn.Parameter(torch.empty(shape, device=param.device, dtype=param.dtype))
    set_spec(out, spec(param).sliced(dim, rank, size))
    internals.mark_tensor_parallel(out)
    return out


class ColumnParallelLinear(nn.Module):
    """``nn.Linear`` with its output features split over the ranks: (.., in) -> (.., out/tp)."""

    def __init__(self, linear: nn.Linear, rank: int, size: int):
        super().__init__()
        self.weight = slice_of(linear.weight, 0, rank, size)
        self.bias = slice_of(linear.bias, 0, rank, size) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``nn.Linear`` with its input features split: (.., in/tp) -> partial sums (.., out).

    The bias is replicated and added by the region after the partial sums are reduced."""

    def __init__(self, linear: nn.Linear, rank: int, size: int):
        super().__init__()
        self.weight = slice_of(linear.weight, 1, rank, size)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class TensorParallelRegion(nn.Module):
    """Runs ``inner`` (column-parallel linears in, row-parallel ``out_name`` linear out) between
    one entering and one leaving collective, then adds the row-parallel bias."""

    def __init__(self, inner: nn.Module, out_name: str, group, sequence_parallel: bool):
        super().__init__()
        self.inner, self.out_name = inner, out_name
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x: torch.Tensor, *args) -> torch.Tensor:
        x = comm.enter_region(x, self.group, self.sequence_parallel)  # (B, T, D) on every rank
        y = comm.exit_region(self.inner(x, *args), self.group, self.sequence_parallel)
        bias = getattr(self.inner, self.out_name).bias
        return y if bias is None else y + bias


class VocabParallelEmbedding(nn.Module):
    """Rows of the embedding split over the ranks; each looks up the tokens it owns and the
    partial results are summed (all-reduce)."""

    def __init__(self, emb: nn.Embedding, rank: int, size: int, group):
        super().__init__()
        self.weight = slice_of(emb.weight, 0, rank, size)
        self.start = rank * self.weight.shape[0]
        self.group = group

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, D)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        return comm.exit_region(x, self.group, False)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split along the vocabulary: (N, V/tp) on each rank.

    Two small all-reduces (the row maxima; the target logits with the sums of exponentials)
    replace the gather of the full (N, V) logits. Columns from ``real`` on (the vocabulary's
    padding on the last ranks) are masked out: exp gives 0, so they take no part in the softmax
    and get no gradient."""

    @staticmethod
    def forward(ctx, logits, targets, group, start: int, real: int):
        logits = logits.float()
        vocab_local = logits.shape[-1]
        rows = torch.arange(logits.shape[0], device=logits.device)
        if real > 0:
            row_max = logits[:, :real].max(dim=-1).values
        else:  # a rank holding only padding
            row_max = logits.new_full(logits.shape[:1], -math.inf)
        collectives.all_reduce(row_max, group, op=torch.distributed.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(1)
        if real < vocab_local:
            shifted[:, real:] = -math.inf
        local = targets - start
        owned = (local >= 0) & (local < vocab_local)
        local = local.clamp(0, vocab_local - 1)
        target_logit = torch.where(owned, shifted[rows, local], 0.0)
        exp = shifted.exp_()
        sums = torch.stack([target_logit, exp.sum(dim=-1)])
        collectives.all_reduce(sums, group)
        target_logit, sum_exp = sums
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(1)), local, owned)
        ctx.dtype = logits.dtype
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_out):
        softmax, local, owned = ctx.saved_tensors
        grad = softmax  # d loss_i / d logits_i = softmax_i - onehot(target_i)
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= owned.to(grad.dtype)
        return grad.mul_(grad_out.unsqueeze(1)), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group,
                                 vocab_start: int, used: int | None = None) -> torch.Tensor:
    """Per-token losses (N,) from this rank's logits (N, V/tp) for vocabulary ids
    ``[vocab_start, vocab_start + V/tp)``; equals ``F.cross_entropy`` on the gathered logits
    of the ids below ``used`` (the tokenizer's; default: all)."""
    vocab_local = logits.shape[-1]
    real = vocab_local if used is None else min(max(used - vocab_start, 0), vocab_local)
    return _VocabParallelCrossEntropy.apply(logits, targets, group, vocab_start, real)


class VocabParallelLMHead(nn.Module):
    """Output layer with the vocabulary split over the ranks: the loss is computed from each
    rank's logit slice; without targets the logits are gathered (generation). ``used``: the
    tokenizer's ids (the rest is padding, masked out); None: all."""

    def __init__(self, weight: nn.Parameter, rank: int, group, sequence_parallel: bool,
                 used: int | None = None):
        super().__init__()
        self.weight = weight
        self.start = rank * weight.shape[0]
        self.group, self.sequence_parallel, self.used = group, sequence_parallel, used
        self.skips_ignored = False  # as LMHead's

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = comm.enter_region(x, self.group, self.sequence_parallel)  # (B, T, D)
        logits = F.linear(x, self.weight)  # (B, T, V/tp)
        if targets is None:
            return comm.gather_last_dim(logits, self.group)[..., :self.used]  # (B, T, V) real ids
        losses = vocab_parallel_cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                              self.group, self.start, self.used)
        if self.skips_ignored:  # an ignored row's loss is computed (no slice has its id), not counted
            kept = targets.reshape(-1) != IGNORED
            return (losses * kept).sum() / kept.sum().clamp_min(1)
        return losses.mean()
