"""Autograd-aware collectives at the edges of tensor- and sequence-parallel regions.

Each is a pair (forward op, backward op) of Megatron's regions. A tensor-parallel sub-layer
(attention or MLP) is entered through ``enter_region`` and left through ``exit_region``, so it
costs exactly one collective forward and one backward:

==========================  =======================  ========================
                            forward                  backward
==========================  =======================  ========================
enter (no SP)               identity                 all-reduce
exit (no SP)                all-reduce               identity
enter (SP)                  all-gather (sequence)    reduce-scatter (sequence)
exit (SP)                   reduce-scatter           all-gather
scatter_sequence            take own slice           all-gather
==========================  =======================  ========================

All run on the tensor-parallel (or Ulysses) group, an accelerator group, with device tensors
(``distributed/collectives.py``). Callers only insert these ops when the group has more than
one rank.
"""

from __future__ import annotations

import torch

from megatron_lite.distributed import collectives
from megatron_lite.distributed.shard_spec import set_spec, spec

SEQ_DIM = 1  # activations are (B, T, ...)


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    return collectives.all_reduce(x.contiguous(), group)


def all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = collectives.group_size(group)
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    return collectives.all_gather_into(out, x, group).movedim(0, dim)


def reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = collectives.group_size(group)
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    return collectives.reduce_scatter_into(out, x, group).movedim(0, dim)


def own_slice(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size, rank = collectives.group_size(group), collectives.group_rank(group)
    return x.chunk(size, dim)[rank].contiguous()


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sequence_parallel: bool):
        ctx.group, ctx.sp = group, sequence_parallel
        return all_gather(x, SEQ_DIM, group) if sequence_parallel else x

    @staticmethod
    def backward(ctx, grad):
        if ctx.sp:
            return reduce_scatter(grad, SEQ_DIM, ctx.group), None, None
        return all_reduce(grad, ctx.group), None, None


class _Exit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sequence_parallel: bool):
        ctx.group, ctx.sp = group, sequence_parallel
        return reduce_scatter(x, SEQ_DIM, group) if sequence_parallel else all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (all_gather(grad, SEQ_DIM, ctx.group) if ctx.sp else grad), None, None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return own_slice(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, SEQ_DIM, ctx.group), None


class _GatherLast(torch.autograd.Function):
    """All-gather along the last dimension (vocabulary-parallel logits); backward takes the
    own slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx, grad):
        return own_slice(grad, grad.dim() - 1, ctx.group), None


def enter_region(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    return _Enter.apply(x, group, sequence_parallel)


def exit_region(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    return _Exit.apply(x, group, sequence_parallel)


def scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    return _ScatterSequence.apply(x, group)


def gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherLast.apply(x, group)


def sum_gradient_over(param: torch.nn.Parameter, group) -> None:
    """Make ``param``'s gradient the sum over ``group``: for replicated parameters that see only
    a slice of the sequence on each rank (norms and biases under sequence parallelism).
    Takes effect when the parameter is materialised (``apply.materialize``)."""
    set_spec(param, spec(param).summed_over(group))


def register_gradient_sum(param: torch.nn.Parameter) -> None:
    group = spec(param).grad_sum_group
    if group is not None:
        param.register_hook(lambda grad: all_reduce(grad.clone(), group))
