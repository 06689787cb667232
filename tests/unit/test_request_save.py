"""``control.request_save`` (a Ray node about to be preempted): the loop saves at the step the
request reaches any rank, goes on, and saves once per request; a stop at the same step wins."""

from __future__ import annotations

import threading

from megatron_lite.config import load_config
from megatron_lite.distributed.parallel_dims import ParallelDims
from megatron_lite.training import control
from megatron_lite.training.control import RunControl, request_save, request_stop
from tests.conftest import REPO


def _control_off_the_main_thread(tmp_path, monkeypatch) -> RunControl:
    """As under Ray Train, whose training function runs in a thread."""
    monkeypatch.setattr(control, "_listener", None)
    cfg = load_config(REPO / "recipes/shakespeare-char.yaml", [f"checkpoint.dir={tmp_path}/ckpt"])
    dims = ParallelDims.plan(cfg, world_size=1)
    built: list[RunControl] = []
    thread = threading.Thread(target=lambda: built.append(RunControl(cfg, dims)))
    thread.start()
    thread.join()
    return built[0]


def test_a_save_request_saves_once_and_the_run_goes_on(tmp_path, monkeypatch):
    ctl = _control_off_the_main_thread(tmp_path, monkeypatch)
    assert ctl.flags() == [False, False, False, False]
    assert request_save("Ray drains node 0a1b (ranks 0, 1; its deadline is in 28 s)")
    flags = ctl.flags()
    assert flags[3]
    decision = ctl.decide(tuple(flags))
    assert decision.save and decision.stop is None
    assert decision.asked == "Ray drains node 0a1b (ranks 0, 1; its deadline is in 28 s)"
    # Taken: the next step neither saves nor says so again.
    assert ctl.flags() == [False, False, False, False]
    again = ctl.decide((False, False, False, False))
    assert not again.save and again.asked is None


def test_a_request_on_another_rank_saves_here_too(tmp_path, monkeypatch):
    ctl = _control_off_the_main_thread(tmp_path, monkeypatch)
    decision = ctl.decide((False, False, False, True))  # another rank's flag, OR-ed in the step report
    assert decision.save and decision.asked == "a save asked for on another rank"


def test_a_stop_at_the_same_step_wins(tmp_path, monkeypatch):
    ctl = _control_off_the_main_thread(tmp_path, monkeypatch)
    assert request_save("drain") and request_stop("SIGTERM (to the launcher)")
    decision = ctl.decide(tuple(ctl.flags()))
    assert decision.save and decision.stop == "signal SIGTERM (to the launcher)" and decision.asked is None


def test_without_a_loop_to_take_it_the_request_is_refused(monkeypatch):
    monkeypatch.setattr(control, "_listener", None)
    assert not request_save("drain")
