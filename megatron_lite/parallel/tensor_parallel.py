"""Megatron-style tensor-parallel layers. Each holds one rank's slice of a plain layer.

The linears do no communication themselves: a sub-layer (attention, MLP) is wrapped in a
``TensorParallelRegion`` that enters and leaves the region with one collective each way
(``comm``), as Megatron's fused-QKV layers do, instead of one per linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.distributed import collectives
from megatron_lite.parallel import comm


def mark_shard(param: nn.Parameter, like: nn.Parameter, dim: int, rank: int, size: int) -> nn.Parameter:
    """Record on ``param`` that it is slice ``rank`` of ``size`` along ``dim`` of ``like``.

    ``ml_name``/``ml_shard`` let initialisation and gathering rebuild the full tensor;
    ``tensor_model_parallel`` tells DeepSpeed's gradient-norm code to count it on every rank."""
    param.ml_name = like.ml_name
    param.ml_full_shape = tuple(like.shape)
    param.ml_shard = (dim, rank, size)
    param.tensor_model_parallel = True
    param.partition_dim = dim
    return param


def slice_of(param: nn.Parameter, dim: int, rank: int, size: int) -> nn.Parameter:
    full = param.shape[dim]
    shape = list(param.shape)
    shape[dim] = full // size
    return mark_shard(nn.Parameter(torch.empty(shape, device=param.device, dtype=param.dtype)),
                      param, dim, rank, size)


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
    replace the gather of the full (N, V) logits."""

    @staticmethod
    def forward(ctx, logits, targets, group, start: int):
        logits = logits.float()
        vocab_local = logits.shape[-1]
        rows = torch.arange(logits.shape[0], device=logits.device)
        row_max = logits.max(dim=-1).values
        collectives.all_reduce(row_max, group, op=torch.distributed.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(1)
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
        return grad.mul_(grad_out.unsqueeze(1)), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group,
                                 vocab_start: int) -> torch.Tensor:
    """Per-token losses (N,) from this rank's logits (N, V/tp) for vocabulary ids
    ``[vocab_start, vocab_start + V/tp)``; equals ``F.cross_entropy`` on the gathered logits."""
    return _VocabParallelCrossEntropy.apply(logits, targets, group, vocab_start)


class VocabParallelLMHead(nn.Module):
    """Output layer with the vocabulary split over the ranks: the loss is computed from each
    rank's logit slice; without targets the logits are gathered (generation)."""

    def __init__(self, weight: nn.Parameter, rank: int, group, sequence_parallel: bool):
        super().__init__()
        self.weight = weight
        self.start = rank * weight.shape[0]
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = comm.enter_region(x, self.group, self.sequence_parallel)  # (B, T, D)
        logits = F.linear(x, self.weight)  # (B, T, V/tp)
        if targets is None:
            return comm.gather_last_dim(logits, self.group)  # (B, T, V)
        losses = vocab_parallel_cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                              self.group, self.start)
        return losses.mean()
