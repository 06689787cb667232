"""training.exit_duration_mins counts from the start of the run (the launcher's, else the
process's), not from when the training loop's RunControl is built: imports, the model build and a
checkpoint load spend the same walltime."""

from __future__ import annotations

import time

import psutil
import pytest

from megatron_lite.config import load_config
from megatron_lite.distributed.parallel_dims import ParallelDims
from megatron_lite.training.control import RunControl
from tests.conftest import REPO

LAUNCH_START = "LAUNCH_START_EPOCH"  # what launch/polaris.sh exports


def _control(minutes: float) -> RunControl:
    cfg = load_config(REPO / "recipes/shakespeare-char.yaml", [f"training.exit_duration_mins={minutes}"])
    return RunControl(cfg, ParallelDims.plan(cfg, world_size=1))


def test_the_clock_starts_at_the_launcher_start(monkeypatch):
    monkeypatch.setenv(LAUNCH_START, str(time.time() - 11 * 60))  # 11 minutes before now
    # The process started after the launcher (this test process's own start, under pytest's
    # workers, can be earlier than that).
    monkeypatch.setattr(psutil, "Process", lambda: _Started(time.time() - 60))
    ctl = _control(10)
    assert ctl.time_left() == pytest.approx(-60, abs=5)
    assert ctl.decide(tuple(ctl.flags())).stop == "training.exit_duration_mins=10.0 reached"
    assert _control(15).decide((False, False, False, False)).stop is None


def test_the_clock_starts_at_the_process_start_without_a_launcher(monkeypatch):
    monkeypatch.delenv(LAUNCH_START, raising=False)
    # This process started before the test: as if it had spent that long importing and building.
    monkeypatch.setattr(psutil, "Process", lambda: _Started(time.time() - 30 * 60))
    ctl = _control(20)
    assert ctl.time_left() == pytest.approx(-10 * 60, abs=5)
    assert ctl.decide(tuple(ctl.flags())).stop == "training.exit_duration_mins=20.0 reached"


class _Started:
    def __init__(self, at: float):
        self.at = at

    def create_time(self) -> float:
        return self.at


@pytest.mark.parametrize("value", ["", "soon", "nan", "inf", "-5", "0"])
def test_a_launcher_start_that_is_not_a_time_gives_the_process_start(value):
    from megatron_lite.training.control import run_started_at

    assert run_started_at({LAUNCH_START: value}) == psutil.Process().create_time()
    assert run_started_at({}) == psutil.Process().create_time()


def test_a_launcher_start_after_the_process_start_gives_the_process_start():
    """Another node's clock running ahead cannot make the run younger than its process."""
    from megatron_lite.training.control import run_started_at

    assert run_started_at({LAUNCH_START: str(time.time() + 60)}) == psutil.Process().create_time()
    earlier = psutil.Process().create_time() - 100
    assert run_started_at({LAUNCH_START: str(earlier)}) == earlier
