"""Learning-rate schedule: linear warm-up, then cosine/linear decay to ``min_lr`` (or the rate
held, then a cooldown: warmup-stable-decay), then flat."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import torch

from megatron_lite.config.schema import OptimizerConfig, ScheduleConfig


@dataclass(frozen=True)
class LRSchedule:
    """Everything the learning rate of a step depends on (saved with every checkpoint)."""

    lr: float
    min_lr: float
    warmup_iters: int
    decay_style: str
    decay_end: int
    """The step at which the decay reaches ``min_lr`` (``schedule.decay_iters``, or the run's
    total steps)."""
    # With defaults: checkpoints saved before WSD existed hold no such keys.
    decay_fraction: float = 0.2
    decay_shape: str = "linear"

    @classmethod
    def of(cls, opt: OptimizerConfig, sched: ScheduleConfig, total_iters: int) -> LRSchedule:
        return cls(opt.lr, opt.min_lr, sched.warmup_iters, sched.decay_style,
                   sched.decay_iters if sched.decay_iters is not None else total_iters,
                   sched.decay_fraction, sched.decay_shape)

    def cooldown_start(self) -> int:
        """``wsd``: the first step of the cooldown (the rate is ``lr`` up to it)."""
        span = max(self.decay_end - self.warmup_iters, 1)
        return self.decay_end - max(round(self.decay_fraction * span), 1)

    def at(self, step: float) -> float:
        """Learning rate of optimizer step ``step`` (0-based; a fraction of a step under a batch
        ramp-up, ``data/batch_plan.py``)."""
        if step < self.warmup_iters:
            # (step+1)/(warmup+1): never 0, reaches lr right after warm-up (as nanoGPT).
            return self.lr * (step + 1) / (self.warmup_iters + 1)
        if self.decay_style == "constant":
            return self.lr
        if step >= self.decay_end:
            return self.min_lr
        start, shape = self.warmup_iters, self.decay_style
        if self.decay_style == "wsd":
            start, shape = self.cooldown_start(), self.decay_shape
            if step < start:
                return self.lr
        progress = (step - start) / max(self.decay_end - start, 1)
        if shape == "cosine":
            coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
        elif shape in ("sqrt", "minus_sqrt"):
            coeff = 1.0 - math.sqrt(progress)
        else:
            coeff = 1.0 - progress
        return self.min_lr + coeff * (self.lr - self.min_lr)

    def differences(self, other: LRSchedule) -> list[str]:
        """``name: self's -> other's`` for every field that differs."""
        return [f"{f.name} {getattr(self, f.name)!r} -> {getattr(other, f.name)!r}" for f in fields(self)
                if getattr(self, f.name) != getattr(other, f.name)]

    def same_rates_from(self, other: LRSchedule, step: int) -> bool:
        """Whether both give the same rate at every step from ``step`` on (past both decay ends
        each is flat at its ``min_lr``): schedules that differ only where the run has already
        been (a longer run still inside the warm-up, say) are the same from here."""
        end = max(self.decay_end, other.decay_end, self.warmup_iters, other.warmup_iters) + 1
        return all(math.isclose(self.at(s), other.at(s), rel_tol=1e-12, abs_tol=0.0)
                   for s in range(step, max(end, step + 1) + 1))

    def to_dict(self) -> dict:
        return asdict(self)


def lr_at(step: int, opt: OptimizerConfig, sched: ScheduleConfig, total_iters: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based)."""
    return LRSchedule.of(opt, sched, total_iters).at(step)


class ScheduledLR(torch.optim.lr_scheduler.LambdaLR):
    """A LambdaLR that follows an ``LRSchedule`` and keeps it: checkpoints record it, and a
    resumed run can follow the checkpoint's schedule or the recipe's (``schedule.on_resume``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: LRSchedule,
                 position: Callable[[int], float] | None = None):
        """``position``: a step's place in the schedule (a batch ramp-up's samples trained
        before it, in full batches); default: the step."""
        self.schedule = schedule
        where = position or (lambda step: step)
        # A plain function (not a bound method): LambdaLR's state_dict leaves functions out.
        super().__init__(optimizer, lambda step: self.schedule.at(where(step)) / self.schedule.lr
                         if self.schedule.lr else 0.0)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.pop("schedule", None)  # saved beside it, as plain values (checkpoints load weights_only)
        return state

    def follow(self, schedule: LRSchedule) -> None:
        """From the current step on, rates come from ``schedule`` (the optimizer's too)."""
        self.schedule = schedule
        self.base_lrs = [schedule.lr] * len(self.optimizer.param_groups)
        self.last_epoch -= 1
        self.step()  # the same step again: sets the optimizer's rates (and get_last_lr) anew


class ScheduleMismatch(ValueError):
    """A resumed checkpoint's schedule and the recipe's disagree, and ``schedule.on_resume``
    does not say which to follow."""


def schedule_to_follow(saved: dict | None, running: LRSchedule, step: int, source: str, mode: str,
                       log) -> LRSchedule:
    """The learning-rate schedule a resumed run goes on with: the running one (the recipe's),
    unless the checkpoint's (``saved``, from ``source``) gives another rate at some step still
    to come; then ``mode`` (``schedule.on_resume``) decides, as Megatron-LM's
    --use-checkpoint-opt_param-scheduler / --override-opt_param-scheduler do: ``checkpoint``
    or ``recipe``; by default (``check``) the run is refused rather than mix two schedules.
    Every rank reads the same rank-0 state, so every rank decides alike."""
    if saved is None:
        return running
    theirs = LRSchedule(**saved)
    if theirs == running or theirs.same_rates_from(running, step):
        return running  # no step from here on would get another rate
    diff = "; ".join(theirs.differences(running))
    if mode == "check":
        raise ScheduleMismatch(
            f"the recipe's learning-rate schedule differs from {source}'s ({diff}): set "
            "schedule.on_resume=checkpoint to continue the checkpoint's schedule, or "
            f"schedule.on_resume=recipe to switch to the recipe's from step {step} (the rate goes "
            f"from {theirs.at(step):.4g} to {running.at(step):.4g})")
    chosen = theirs if mode == "checkpoint" else running
    log(f"learning-rate schedule: the {mode}'s from step {step} (schedule.on_resume={mode}; "
        f"checkpoint -> recipe: {diff}); next rate {chosen.at(step):.4g}")
    return chosen
