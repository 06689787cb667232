"""``ShardSpec``: how one of this rank's parameters relates to the plain single-device model.

Parallelism swaps modules (a tensor-parallel linear holds a slice of the plain one; a pipeline
stage keeps some blocks), so a parameter's module path depends on the layout. Initialisation,
checkpoints, gradient clipping and gradient reduction need the layout-free address instead:
the plain-model name and shape, which slice of it this rank holds, and the group its gradient
is summed over. That is one typed record per parameter, set when the plain model is built
(``tag``) and replaced, never edited, by the parallelize step (``ShardSpec.sliced``,
``ShardSpec.summed_over``).

It lives here, below ``parallel/``, because ``checkpoint/`` and ``training/`` read it too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

_ATTRIBUTE = "shard_spec"


@dataclass(frozen=True)
class ShardSpec:
    name: str
    """The parameter's name in the plain model (``blocks.0.attn.q_proj.weight``)."""
    full_shape: tuple[int, ...]
    """Its shape in the plain model."""
    dim: int | None = None
    """The dimension split over the tensor-parallel ranks; None: this rank holds all of it."""
    rank: int = 0
    """Which of the ``size`` equal slices this rank holds."""
    size: int = 1
    """How many slices there are."""
    grad_sum_group: Any = None
    """A process group over which the gradient is summed before anything else reads it (a
    replicated parameter that sees only this rank's part of the activations: a norm under
    sequence parallelism, a per-head norm inside a tensor-parallel region); None: no sum."""

    @property
    def sharded(self) -> bool:
        return self.dim is not None

    @property
    def slice(self) -> tuple[int, int, int] | None:
        """(dim, rank, size), or None when not sharded: the form checkpoints record."""
        return (self.dim, self.rank, self.size) if self.dim is not None else None

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``full`` (a tensor of ``full_shape``)."""
        return full if self.dim is None else full.chunk(self.size, self.dim)[self.rank]

    def sliced(self, dim: int, rank: int, size: int) -> ShardSpec:
        return dataclasses.replace(self, dim=dim, rank=rank, size=size)

    def summed_over(self, group) -> ShardSpec:
        return dataclasses.replace(self, grad_sum_group=group)


def spec(param: nn.Parameter) -> ShardSpec:
    try:
        return getattr(param, _ATTRIBUTE)
    except AttributeError:
        raise AttributeError(f"parameter of shape {tuple(param.shape)} has no ShardSpec: models are "
                             "built by parallel.build_parallel_model, which tags every "
                             "parameter") from None


def set_spec(param: nn.Parameter, value: ShardSpec) -> nn.Parameter:
    setattr(param, _ATTRIBUTE, value)
    return param


def tag(module: nn.Module, prefix: str = "") -> None:
    """Give every parameter of the plain ``module`` its whole-tensor ShardSpec."""
    for name, param in module.named_parameters():
        set_spec(param, ShardSpec(prefix + name, tuple(param.shape)))
