"""What a checkpoint holds besides the weights and optimizer moments: each rank's random state,
and rank 0's trainer state (scheduler, Adam's step, DeepSpeed's counters, the trainer's extra
state). Each is captured and restored here, in plain types the weights-only loader reads."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import torch

from megatron_lite.engine import internals as ds
from megatron_lite.engine.internals import torch_optimizer
from megatron_lite.optim.schedule import LRSchedule, ScheduledLR


def rng_state(acc) -> dict:
    """This rank's random state: Python's, numpy's, torch's and the device's."""
    return {"python": random.getstate(), "numpy": _numpy_rng_state(), "torch": torch.get_rng_state(),
            "device": acc.get_rng_state() if acc.device_name() != "cpu" else None}


def restore_rng(rng: dict, acc) -> None:
    random.setstate(rng["python"])
    name, key, *rest = rng["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), *rest))
    torch.set_rng_state(rng["torch"])
    if rng["device"] is not None:
        acc.set_rng_state(rng["device"])


def trainer_state(engine, extra: dict | None) -> dict:
    """Rank 0's trainer state: the scheduler and its schedule, Adam's step count, DeepSpeed's
    step and sample counters, and ``extra`` (the trainer's own)."""
    scheduler = engine.lr_scheduler
    steps, samples = ds.step_counters(engine)
    return {
        "scheduler": scheduler.state_dict() if scheduler else None,
        "schedule": scheduler.schedule.to_dict() if isinstance(scheduler, ScheduledLR) else None,
        "adam_step": _adam_step(engine),
        "global_steps": steps, "global_samples": samples,
        "extra": extra,
    }


def restore_trainer_state(engine, state: dict,
                          follow: Callable[[dict | None, LRSchedule], LRSchedule]) -> None:
    """Put ``trainer_state``'s ``state`` back; ``follow(saved schedule, running schedule)``
    picks the schedule to go on with."""
    scheduler = engine.lr_scheduler
    if isinstance(scheduler, ScheduledLR) and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
        # Also sets the rate on the optimizer, which the scheduler's state does not hold.
        scheduler.follow(follow(state.get("schedule"), scheduler.schedule))
    _set_adam_step(engine, state["adam_step"])
    ds.set_step_counters(engine, state["global_steps"], state["global_samples"])


def _numpy_rng_state() -> tuple:
    """numpy's global RNG state in plain types (the key as a tensor): what the weights-only
    loader reads without allow-listing numpy."""
    name, key, pos, has_gauss, cached = np.random.get_state()
    return name, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(cached)


def _adam_step(engine) -> float:
    for state in torch_optimizer(engine).state.values():
        if "step" in state:
            return float(state["step"])
    return 0.0


def _set_adam_step(engine, step: float) -> None:
    for state in torch_optimizer(engine).state.values():
        if "step" in state:
            old = state["step"]
            state["step"] = (torch.full_like(old, step) if isinstance(old, torch.Tensor) else step)
