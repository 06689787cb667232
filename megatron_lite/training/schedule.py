"""Learning-rate schedule: linear warm-up, then cosine/linear decay to ``min_lr``, then flat."""

from __future__ import annotations

import math

from megatron_lite.config.schema import OptimizerConfig, ScheduleConfig


def lr_at(step: int, opt: OptimizerConfig, sched: ScheduleConfig, total_iters: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based)."""
    warmup = sched.warmup_iters
    if step < warmup:
        # (step+1)/(warmup+1): never 0, reaches lr right after warm-up (as nanoGPT).
        return opt.lr * (step + 1) / (warmup + 1)
    if sched.decay_style == "constant":
        return opt.lr
    decay_end = sched.decay_iters if sched.decay_iters is not None else total_iters
    if step >= decay_end:
        return opt.min_lr
    progress = (step - warmup) / max(decay_end - warmup, 1)
    if sched.decay_style == "cosine":
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        coeff = 1.0 - progress
    return opt.min_lr + coeff * (opt.lr - opt.min_lr)
