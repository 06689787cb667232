"""The global batch of each step: ``training.global_batch_size`` throughout, or ramped up from a
smaller one (``training.rampup_batch_size``, Megatron-LM's ``--rampup-batch-size``).

Megatron's rule, on the samples trained so far (``c``): with ``n = (G - start) / increment``
increments spread over ``samples``, the batch is ``start + floor(c / (samples / n)) ·
increment`` until ``c`` passes ``samples``, then ``G``. Micro-batches keep their size; the
gradient-accumulation steps change. The learning rate follows samples, not steps: a step's
schedule position is the samples trained before it over ``G`` (the full batch's steps), so
``schedule.warmup_iters`` and ``decay_iters`` keep their meaning in full batches.

The plan is a pure function of the step (spike windows move the data position, never the
ramp), so a resumed run takes exactly the batches the uninterrupted one would.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from megatron_lite.config.schema import Config, TrainingConfig


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int
    """The full batch, ``G``."""
    ramp: tuple[int, int, int] | None = None
    """``(start, increment, samples)``, None for no ramp-up."""
    _first_steps: list[int] = field(default_factory=list, repr=False, compare=False)
    _first_samples: list[int] = field(default_factory=list, repr=False, compare=False)
    _batches: list[int] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self):
        # The ramp as segments of equal batches: (first step, samples before it, batch).
        if self.ramp is None:
            segments = [(0, 0, self.global_batch)]
        else:
            segments, step, trained = [], 0, 0
            while True:
                batch = self.batch_at_samples(trained)
                if not segments or segments[-1][2] != batch:
                    segments.append((step, trained, batch))
                if batch == self.global_batch:
                    break
                step, trained = step + 1, trained + batch
        for step, trained, batch in segments:
            self._first_steps.append(step)
            self._first_samples.append(trained)
            self._batches.append(batch)

    def batch_at_samples(self, trained: int) -> int:
        """Megatron's batch after ``trained`` samples."""
        if self.ramp is None:
            return self.global_batch
        start, increment, samples = self.ramp
        if trained > samples:
            return self.global_batch
        per_increment = samples / ((self.global_batch - start) // increment)
        return min(start + int(trained / per_increment) * increment, self.global_batch)

    def _segment(self, step: int) -> int:
        return bisect.bisect_right(self._first_steps, step) - 1

    def batch(self, step: int) -> int:
        """The global batch of step ``step`` (0-based)."""
        return self._batches[self._segment(step)]

    def samples_before(self, step: int) -> int:
        """Samples trained by the steps before ``step``."""
        k = self._segment(step)
        return self._first_samples[k] + (step - self._first_steps[k]) * self._batches[k]

    def position(self, step: int) -> float:
        """Step ``step``'s place in the learning-rate schedule, in full batches."""
        return self.samples_before(step) / self.global_batch

    def steps_for(self, samples: int) -> int:
        """Steps to train at least ``samples`` samples."""
        k = max(bisect.bisect_right(self._first_samples, samples) - 1, 0)
        return self._first_steps[k] + max(math.ceil((samples - self._first_samples[k]) / self._batches[k]), 0)


def batch_plan(cfg: TrainingConfig, global_batch: int) -> BatchPlan:
    """The run's plan: ``global_batch`` (the layout's, ``ParallelDims.global_batch``) with the
    recipe's ramp-up, if any."""
    ramp = cfg.rampup_batch_size
    return BatchPlan(global_batch, tuple(ramp) if ramp is not None else None)


def planned_steps(cfg: Config, plan: BatchPlan) -> tuple[int, int]:
    """(optimizer steps of the run, steps of the learning-rate schedule in full batches):
    ``training.iters`` for both, or the steps that train ``training.train_tokens`` and the full
    batches those tokens make (the same number without a ramp)."""
    t = cfg.training
    if t.iters is not None:
        return t.iters, t.iters
    assert t.train_tokens is not None
    samples = math.ceil(t.train_tokens / cfg.data.seq_length)
    return plan.steps_for(samples), math.ceil(samples / plan.global_batch)
