"""The pieces of state a checkpoint holds besides the weights save and load themselves
(``state_dict``/``load_state_dict``), through the rank file's weights-only format."""

from __future__ import annotations

import io
import random

import numpy as np
import torch

from megatron_lite.checkpoint.run_state import RngState
from megatron_lite.config.schema import SpikesConfig
from megatron_lite.spikes import SpikeTracker, StepContext
from megatron_lite.training.trainer import TrainState


class CpuAccelerator:
    def device_name(self) -> str:
        return "cpu"


def _through_a_rank_file(state: dict) -> dict:
    """What a save writes and a load reads back (weights-only: plain types and tensors)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_the_random_state_loaded_draws_what_the_saved_one_drew():
    rng = RngState(CpuAccelerator())
    saved = _through_a_rank_file(rng.state_dict())
    expected = _draws()
    _draws()  # the run moves on
    rng.load_state_dict(saved)
    assert _draws() == expected


def test_the_spike_trackers_state_loads_whole(tmp_path):
    cfg = SpikesConfig(policy="skip_step", warmup_steps=3)

    def tracker_in(run_dir):
        return SpikeTracker(cfg, run_dir, True, lambda i: {"dataset": "d", "pieces": [[0, i, i + 1]]},
                            lambda _: None)

    tracker = tracker_in(tmp_path)
    for step, loss in enumerate([2.0, 2.1, 2.0, 2.05, 9.0, float("nan")], 1):
        ctx = StepContext(step, (step - 1) * 4, 1e-3, 4, step * 4)
        tracker.track(ctx, lambda loss=loss: tracker.judge(loss, 1.0))
    tracker.skip.append((8, 12))
    saved = _through_a_rank_file(tracker.state_dict())

    (tmp_path / "other").mkdir()
    other = tracker_in(tmp_path / "other")
    other.load_state_dict(saved)
    assert other.state_dict() == tracker.state_dict()
    assert other.events == 2 and other.consecutive_nonfinite == 1 and other.skip == [(8, 12)]


def test_the_train_state_loads_in_place():
    state = TrainState(7, 56)
    held = state  # the training loop's reference
    held.load_state_dict(_through_a_rank_file(TrainState(3, 24).state_dict()))
    assert (state.step, state.consumed_samples) == (3, 24)
