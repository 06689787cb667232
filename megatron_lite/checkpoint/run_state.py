"""What a checkpoint holds besides the weights and optimizer moments: each rank's random state
and the engine's state (scheduler, Adam's step, DeepSpeed's counters), saved by rank 0 with the
trainer's own state (``Trainer.state_dict``). Each saves and loads itself, in plain types the
weights-only loader reads."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import torch

from megatron_lite.engine import internals as ds
from megatron_lite.engine.internals import torch_optimizer
from megatron_lite.optim.schedule import LRSchedule, ScheduledLR


class RngState:
    """This rank's random state: Python's, numpy's, torch's and the device's. Saved and loaded
    through ``state_dict``/``load_state_dict`` (torchtitan's ``Stateful``)."""

    def __init__(self, acc):
        self.acc = acc

    def state_dict(self) -> dict:
        acc = self.acc
        return {"python": random.getstate(), "numpy": _numpy_rng_state(), "torch": torch.get_rng_state(),
                "device": acc.get_rng_state() if acc.device_name() != "cpu" else None}

    def load_state_dict(self, state: dict) -> None:
        random.setstate(state["python"])
        name, key, *rest = state["numpy"]
        np.random.set_state((name, np.asarray(key, dtype=np.uint32), *rest))
        torch.set_rng_state(state["torch"])
        if state["device"] is not None:
            self.acc.set_rng_state(state["device"])


Follow = Callable[["dict | None", LRSchedule], LRSchedule]
"""(the saved schedule, the running one) -> the schedule to go on with."""


class EngineState:
    """What DeepSpeed's engine holds besides the weights and the optimizer moments, saved by rank
    0: the scheduler and its schedule, Adam's step count, DeepSpeed's step and sample counters."""

    def __init__(self, engine):
        self.engine = engine

    def state_dict(self) -> dict:
        engine = self.engine
        scheduler = engine.lr_scheduler
        steps, samples = ds.step_counters(engine)
        return {
            "scheduler": scheduler.state_dict() if scheduler else None,
            "schedule": scheduler.schedule.to_dict() if isinstance(scheduler, ScheduledLR) else None,
            "adam_step": _adam_step(engine),
            "global_steps": steps, "global_samples": samples,
        }

    def load_state_dict(self, state: dict, follow: Follow = lambda saved, running: running) -> None:
        """``follow`` picks the schedule to go on with (a resume may change it; see
        ``optim.schedule.schedule_to_follow``)."""
        engine = self.engine
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
