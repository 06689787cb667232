"""Phase clock (host and device-event paths), interval accounting, slowdown and straggler rules."""

from types import SimpleNamespace

import pytest

from megatron_lite.config.schema import Config, MonitorConfig
from megatron_lite.training.monitor import SlowdownMonitor, StragglerCheck
from megatron_lite.training.timing import IntervalClock, PhaseClock


class RecordingEvent:
    """An accelerator event as torch.cuda.Event behaves: elapsed_time only once both are done.
    Its device runs apart from the host: each recorded event is 5 ms of device time after the
    previous one, however long the host took in between."""

    made = []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None
        self.synchronized = False
        RecordingEvent.made.append(self)

    def record(self):
        self.at = 0.005 * len([e for e in RecordingEvent.made if e.at is not None])

    def synchronize(self):
        self.synchronized = True

    def elapsed_time(self, end):
        assert self.at is not None and end.synchronized, "read before the device finished"
        return 1000.0 * (end.at - self.at)


class Accelerator:
    def __init__(self, host: bool):
        self.host = host

    def use_host_timers(self):
        return self.host

    def Event(self, enable_timing=False):  # noqa: N802 (DeepSpeed's accelerator API)
        return RecordingEvent(enable_timing)


class HostClock:
    """time.perf_counter as the phase clock sees it: it moves only when the test says."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


@pytest.mark.parametrize("host", [True, False], ids=["host-clock", "device-events"])
def test_phase_clock_sums_each_phase_until_read(host, monkeypatch):
    RecordingEvent.made.clear()
    host_clock = HostClock()
    monkeypatch.setattr("megatron_lite.training.timing.time", SimpleNamespace(perf_counter=host_clock))
    clock = PhaseClock(Accelerator(host))
    for _ in range(2):  # two micro-batches: the optimizer phase runs into the next data wait
        clock.mark("data")
        host_clock.sleep(0.02)
        clock.mark("forward")
        host_clock.sleep(0.01)
        clock.mark("backward")
        host_clock.sleep(0.003)
        clock.mark("optimizer")
    clock.mark(None)
    totals = clock.read()
    assert list(totals) == ["data", "forward", "backward", "optimizer"]
    assert totals["data"] == pytest.approx(40)  # the host's wait, on every device
    if host:
        assert [totals[p] for p in ("forward", "backward", "optimizer")] == pytest.approx([20, 6, 0])
    else:  # the device's time between the events: 5 ms per phase per micro-batch
        assert [totals[p] for p in ("forward", "backward", "optimizer")] == pytest.approx([10.0] * 3)
    # The data wait is host time: no event marks the start of a data phase.
    assert len(RecordingEvent.made) == (0 if host else 2 * 4)
    assert clock.read() == {}  # zero after a read


def test_interval_clock_keeps_warm_up_and_other_work_out_of_throughput():
    clock = IntervalClock(warmup_steps=2)
    clock.restart()
    clock.step_done()
    assert clock.timed is None  # one warm-up step done
    clock.step_done()
    assert clock.timed is not None and clock.timed.steps == 0  # warm-up over: counted from here
    clock.step_done()
    clock.add("eval", 0.5)
    clock.add("checkpoint", 0.25)
    assert (clock.all.steps, clock.timed.steps) == (3, 1)
    assert clock.all.eval_s == clock.timed.eval_s == 0.5
    assert clock.all.step_seconds(clock.all.start + 1.0) == pytest.approx(0.25)
    clock.restart()
    assert clock.timed is not None and clock.all.steps == 0


def record(step, step_ms, **phases):
    return {"step": step, "step_time_ms": step_ms, "tokens_per_sec": 1.0,
            **{f"{p}_ms": v for p, v in phases.items()}}


def test_slowdown_names_the_phase_that_grew_once_per_slowdown():
    monitor = SlowdownMonitor(MonitorConfig(slowdown_factor=1.5, window=4, min_history=3))
    normal = {"data": 1.0, "forward": 10.0, "backward": 20.0, "optimizer": 5.0}
    assert monitor.observe({**record(1, 40.0, **normal), "tokens_per_sec": None}) is None  # warm-up
    for step in (2, 3, 4):
        assert monitor.observe(record(step, 36.0 + step, **normal)) is None
    kind, message, fields = monitor.observe(record(5, 100.0, **{**normal, "data": 60.0}))
    assert (kind, fields["phase"]) == ("slowdown", "data") and "data grew most" in message
    assert fields["median_step_time_ms"] == 39.0
    assert monitor.observe(record(6, 100.0, **{**normal, "data": 60.0})) is None  # the same slowdown
    assert monitor.observe(record(7, 100.0, **{**normal, "backward": 80.0}))[2]["phase"] == "backward"
    assert monitor.observe(record(8, 41.0, **normal)) is None  # over
    assert monitor.observe(record(9, 100.0, **{**normal, "data": 60.0}))[2]["phase"] == "data"
    # Slow intervals stayed out of the median (window 4: steps 3, 4 and 8 and nothing slow).
    assert [h["step"] for h in monitor.history] == [36.0 + 2, 36.0 + 3, 36.0 + 4, 41.0]
    assert SlowdownMonitor(MonitorConfig(slowdown_factor=0)).observe(record(1, 1e9)) is None


class Dims:
    def __init__(self, rank, world_size=3):
        self.rank, self.world_size = rank, world_size


def test_straggler_is_the_rank_slower_than_the_median_of_the_others():
    cfg = Config(monitor=MonitorConfig(straggler_interval=10, straggler_factor=1.3, min_excess=0.05))
    ranks = [(0, "a", 10.0, 100.0), (1, "b", 30.0, 100.0), (2, "c", 11.0, 100.0)]
    check = StragglerCheck(cfg, Dims(0))
    assert check.phases == ("data", "forward")  # plain data parallelism: the forward is local
    assert [check.due(s) for s in (5, 10, 12, 19, 21)] == [False, True, True, True, True]
    events = check.check(10, record(10, 100.0, data=1.0, forward=9.0), gather=lambda mine, *a: ranks)
    assert [(k, f["rank"], f["host"]) for k, _, f in events] == [("straggler", 1, "b")]
    assert not check.due(19) and check.due(20)
    # An excess under monitor.min_excess of the step time is noise.
    close = [(0, "a", 10.0, 100.0), (1, "b", 14.0, 100.0), (2, "c", 10.0, 100.0)]
    assert check.check(20, record(20, 100.0), gather=lambda mine, *a: close) == []
    # ZeRO-3: the other ranks' forward waits for the slow one; the data wait alone is compared.
    zero3 = Config(parallel=Config().parallel.__class__(zero_stage=3))
    assert StragglerCheck(zero3, Dims(0)).phases == ("data",)
    assert not StragglerCheck(cfg, Dims(0, world_size=1)).due(10)
