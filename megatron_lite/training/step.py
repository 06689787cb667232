"""One optimizer step and one evaluation batch, for every parallel layout.

The trainer and the layout tests drive the engine only through ``StepRunner``: it splits
sequences for Ulysses, hands micro-batches to DeepSpeed's pipeline engine under pipeline
parallelism, and clips gradients itself where DeepSpeed would not report the norm.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_lite.config.schema import Config
from megatron_lite.distributed.parallel_dims import ParallelDims
from megatron_lite.training.engine import trainer_clips_gradients


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, dims: ParallelDims) -> torch.Tensor:
    """Clip to the global gradient norm over all tensor-parallel slices (a replicated parameter
    counted once); returns the norm before clipping. Gradients must already be averaged over
    the data-parallel ranks."""
    grads = [p.grad for p in params if p.grad is not None and (dims.tp_rank == 0 or hasattr(p, "ml_shard"))]
    device = params[0].device
    square = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        square += g.float().pow(2).sum()
    if dims.tensor > 1:
        dist.all_reduce(square, group=dims.group("tensor"))
    norm = square.sqrt()
    if max_norm > 0 and math.isfinite(max_norm):
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
    return norm


class StepRunner:
    def __init__(self, cfg: Config, dims: ParallelDims, engine, grad_accum: int):
        self.cfg, self.dims, self.engine, self.grad_accum = cfg, dims, engine, grad_accum
        self.pipelined = dims.pipeline > 1
        self.own_clipping = trainer_clips_gradients(cfg) and not self.pipelined
        self.grad_norm: torch.Tensor | None = None

    def split(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T+1) token windows -> this rank's (inputs, targets)."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        if self.dims.ulysses > 1:
            inputs = inputs.chunk(self.dims.ulysses, dim=1)[self.dims.sp_rank]
            targets = targets.chunk(self.dims.ulysses, dim=1)[self.dims.sp_rank]
        return inputs, targets

    def _pairs(self, batches: Iterator[torch.Tensor], device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in batches:
            yield self.split(batch.to(device, non_blocking=True))

    def train_step(self, batches: Iterator[torch.Tensor], device) -> torch.Tensor:
        """One optimizer step over ``grad_accum`` micro-batches; returns the sum of the
        micro-batch losses as a device tensor (no host sync)."""
        engine = self.engine
        if self.pipelined:
            loss = engine.train_batch(data_iter=self._pairs(batches, device))
            self.grad_norm = engine.get_global_grad_norm()
            return loss.detach().float() * self.grad_accum
        loss_sum = torch.zeros((), device=device)
        pairs = self._pairs(batches, device)
        for micro in range(self.grad_accum):
            inputs, targets = next(pairs)
            loss = engine(inputs, targets)
            engine.backward(loss)
            if self.own_clipping and micro == self.grad_accum - 1:
                self.grad_norm = clip_grad_norm(list(engine.module.parameters()),
                                                self.cfg.optimizer.grad_clip, self.dims)
            engine.step()
            loss_sum += loss.detach().float()
        if not self.own_clipping:
            self.grad_norm = engine.get_global_grad_norm()
        return loss_sum

    @torch.no_grad()
    def eval_loss(self, batches: Iterator[torch.Tensor], device) -> torch.Tensor:
        """Mean loss of ``grad_accum`` micro-batches (one global batch)."""
        if self.pipelined:
            loss = self.engine.eval_batch(self._pairs(batches, device), num_micro_batches=self.grad_accum)
            return loss.float().reshape(())
        total = torch.zeros((), device=device)
        pairs = self._pairs(batches, device)
        for _ in range(self.grad_accum):
            total += self.engine(*next(pairs)).float()
        return total / self.grad_accum
