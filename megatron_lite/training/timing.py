"""Where a training step's time goes, without adding host synchronisation.

``PhaseClock`` splits steps into phases. The data wait is host time (the host blocked on the
loader). Forward, backward and optimizer are device time: on an accelerator each phase boundary
records a device event, and the events are read at the log step, after the logged loss has
synchronised the host with the device anyway; on a synchronous device (CPU) the host clock is
the device clock. ``IntervalClock`` turns one log interval into step time and throughput, with
evaluation, checkpoint saves and the first steps of the process (warm-up) kept apart.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

PHASES = ("data", "forward", "backward", "optimizer")
"""The phases of a step, in the order a step goes through them."""


class PhaseClock:
    """Totals per phase since the last ``read``. ``mark(phase)`` ends the running phase and starts
    ``phase`` (``None``: starts nothing). ``data`` is timed on the host; the others on the device."""

    def __init__(self, acc=None):
        host = acc is None or acc.use_host_timers()
        self._new_event: Callable | None = None if host else (lambda: acc.Event(enable_timing=True))
        self._totals = dict.fromkeys(PHASES, 0.0)  # ms
        self._spans: list[tuple[str, object, object]] = []  # device phases, read at the log step
        self._phase: str | None = None
        self._seen: set[str] = set()
        self._host_start = 0.0
        self._event_start: object | None = None

    def mark(self, phase: str | None) -> None:
        now = time.perf_counter()
        event = None
        if self._new_event is not None and (phase not in (None, "data") or self._phase not in (None, "data")):
            # One event ends the device phase that ends and starts the one that starts.
            event = self._new_event()
            event.record()
        if self._phase is not None:
            self._seen.add(self._phase)
            if self._event_start is None:  # a host-timed phase (or no device events)
                self._totals[self._phase] += 1000.0 * (now - self._host_start)
            else:
                self._spans.append((self._phase, self._event_start, event))
        device_timed = phase not in (None, "data")
        self._phase, self._host_start, self._event_start = phase, now, event if device_timed else None

    def read(self) -> dict[str, float]:
        """The totals (ms) of the phases timed since the last read, then zero. Call it after the
        host has waited for the device (the logged loss was read): every event recorded so far is
        then complete."""
        self.mark(None)
        for phase, start, end in self._spans:
            end.synchronize()  # done already; keeps an early call correct rather than raising
            self._totals[phase] += start.elapsed_time(end)
        totals = {phase: self._totals[phase] for phase in PHASES if phase in self._seen}
        self._spans, self._seen = [], set()
        self._totals = dict.fromkeys(PHASES, 0.0)
        return totals


class NoClock:
    """A ``PhaseClock`` that measures nothing: for steps driven outside the trainer (tests,
    benchmarks)."""

    def mark(self, phase: str | None) -> None:
        pass

    def read(self) -> dict[str, float]:
        return {}


@dataclass
class Span:
    """Steps since a point in time, and the seconds in it that were not steps."""

    start: float
    steps: int = 0
    eval_s: float = 0.0
    checkpoint_s: float = 0.0

    def step_seconds(self, now: float) -> float:
        return max(now - self.start - self.eval_s - self.checkpoint_s, 0.0)


class IntervalClock:
    """The current log interval (every step) and its part after the process's warm-up steps
    (the steps that throughput counts)."""

    def __init__(self, warmup_steps: int):
        self.warmup_steps = warmup_steps
        self.steps_in_process = 0
        self.restart()

    @property
    def warming_up(self) -> bool:
        return self.steps_in_process < self.warmup_steps

    def restart(self) -> None:
        now = time.perf_counter()
        self.all = Span(now)
        self.timed = None if self.warming_up else Span(now)

    def step_done(self) -> None:
        self.steps_in_process += 1
        self.all.steps += 1
        if self.timed is not None:
            self.timed.steps += 1
        elif not self.warming_up:  # the last warm-up step just ended
            self.timed = Span(time.perf_counter())

    def add(self, kind: str, seconds: float) -> None:
        """Evaluation (``eval``) or a save's blocking time (``checkpoint``): not step time."""
        for span in (self.all, self.timed):
            if span is not None:
                setattr(span, f"{kind}_s", getattr(span, f"{kind}_s") + seconds)


def process_age_s() -> float | None:
    """Seconds since this process started (interpreter start-up and imports included), from
    Linux's ``/proc`` and boot clock (10 ms resolution); None elsewhere."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            # Field 22 (starttime, clock ticks after boot); the command name (field 2) may hold
            # spaces, so count from its closing parenthesis.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return max(since_boot - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
