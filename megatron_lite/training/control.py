"""When to save and when to stop, agreed by every rank at a step boundary.

A signal (SIGTERM; SIGUSR1, which PBS sends before walltime with ``-l signal``-style requests)
may reach one rank only, and clocks differ between nodes: each rank reports what it saw, the
flags are OR-ed over all ranks, and every rank takes the same decision at the same step. The
flags travel with the step's report (training/step_report.py): no collective of their own.

``training.exit_duration_mins`` counts from the start of the run, not of the training loop: the
time spent importing, building the model and loading a checkpoint comes out of the same walltime.
The start is the launcher's (``LAUNCH_START_EPOCH``, which ``launch/polaris.sh`` exports: the
walltime it read from PBS was measured then), else this process's.

Where training runs off the main thread (Ray Train runs the training function in a thread of its
worker process), no signal handler can be installed there: the launcher's own handlers (on the
process's main thread) forward the stop with ``request_stop``, which feeds the same flag.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import psutil

from megatron_lite.config.schema import Config
from megatron_lite.distributed.parallel_dims import ParallelDims

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Stopped(BaseException):
    """A signal arrived where the run cannot save and stop at a step boundary: during start-up,
    or without ``checkpoint.save_on_signal``. It ends the run with the signal's name and exit
    status 128 + N. (A BaseException, like KeyboardInterrupt: no ``except Exception`` swallows
    it, and torch's JIT build still removes its lock on the way out.)"""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def stop_on_signals() -> None:
    """Until ``RunControl`` takes over: a signal stops the run with a reason, not silently
    (their default action kills the process with no word)."""
    def stop(signum, _frame) -> None:
        raise Stopped(signum)

    if threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            signal.signal(sig, stop)
        # SIGUSR2 asks for a hang report (distributed/hang.py): never a reason to die, before
        # the watcher takes it or without one.
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)


@dataclass
class Decision:
    save: bool
    stop: str | None
    """Why the run stops now (a signal, the time limit), or None."""
    asked: str | None = None
    """Why a save was asked for at this step while the run goes on (``request_save``), or None."""


_listener: RunControl | None = None
"""The training loop of this process that takes ``request_stop`` (one per process: a launcher
runs one trainer per process)."""


def request_stop(reason: str) -> bool:
    """Ask this process's training loop to save and stop at its next step boundary, as a signal
    does with ``checkpoint.save_on_signal`` (``signal REASON`` for a signal's name). Safe from any
    thread and from a signal handler (one attribute store). False when no training loop takes
    it: training has not started yet (the dataset, model or engine is being built), the run has
    no ``checkpoint.dir`` or ``save_on_signal`` is off, or training runs on the main thread,
    where the signal handlers themselves are installed."""
    control = _listener
    if control is None:
        return False
    control.received = reason
    return True


def request_save(reason: str) -> bool:
    """Ask this process's training loop to save at its next step boundary and go on (a Ray node
    about to be preempted: Ray restarts the workers elsewhere, and they resume from that save).
    Every rank saves at the same step as soon as one rank has the request: ask on one rank only
    (a request reaching two ranks on either side of a step boundary would save twice).
    Thread-safe as ``request_stop``, and False in the same cases."""
    control = _listener
    if control is None:
        return False
    control.save_asked = reason
    return True


LAUNCH_START = "LAUNCH_START_EPOCH"
"""Seconds since the epoch at which the launcher started this run (set by launch/polaris.sh)."""


def run_started_at(env: Mapping[str, str] | None = None) -> float:
    """When this run started, seconds since the epoch: the launcher's start when it exported one
    (it can only be earlier than this process's), else this process's start. A value that is
    not a time, or lies after this process's start (another node's clock running ahead), gives
    this process's start."""
    env = os.environ if env is None else env
    process = psutil.Process().create_time()
    try:
        launched = float(env.get(LAUNCH_START, ""))
    except ValueError:
        return process
    return launched if math.isfinite(launched) and 0 < launched <= process else process


class RunControl:
    def __init__(self, cfg: Config, dims: ParallelDims):
        global _listener
        self.cfg, self.dims = cfg, dims
        now = time.monotonic()
        # Monotonic from here on (a clock step during the run moves no deadline); the time before
        # this object existed is taken once, from the wall clock.
        self.start = now - max(0.0, time.time() - run_started_at())
        self.last_save = now
        self.received: str | None = None
        self.save_asked: str | None = None
        self.active = bool(cfg.checkpoint.dir) or cfg.training.exit_duration_mins is not None
        if cfg.checkpoint.dir and cfg.checkpoint.save_on_signal:
            if threading.current_thread() is threading.main_thread():
                for sig in SIGNALS:
                    signal.signal(sig, self._on_signal)
            else:
                # From here on, as the handlers above, a stop is taken at a step boundary.
                _listener = self

    def _on_signal(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def time_left(self) -> float | None:
        """Seconds to ``training.exit_duration_mins``, or None without a time limit."""
        limit = self.cfg.training.exit_duration_mins
        return None if limit is None else 60 * limit - (time.monotonic() - self.start)

    def saved(self) -> None:
        self.last_save = time.monotonic()

    N_FLAGS = 4

    def flags(self) -> list[bool]:
        """This rank's view now (signal received, out of time, save timer due, save asked); what
        the step's report carries to the other ranks. Empty when the run control is off."""
        if not self.active:
            return []
        ck, t = self.cfg.checkpoint, self.cfg.training
        now = time.monotonic()
        out_of_time = t.exit_duration_mins is not None and now - self.start >= 60 * t.exit_duration_mins
        timer = ck.save_interval_minutes > 0 and now - self.last_save >= 60 * ck.save_interval_minutes
        return [self.received is not None, out_of_time, timer, self.save_asked is not None]

    def decide(self, agreed: tuple[bool, ...]) -> Decision:
        """The decision from ``agreed``: this step's ``flags`` OR-ed over all ranks (the step
        report carries them), the same on every rank."""
        if not self.active:
            return Decision(False, None)
        got_signal, out_of_time, timer, asked = agreed
        ck, t = self.cfg.checkpoint, self.cfg.training
        why_asked = None
        if asked:
            why_asked = self.save_asked or "a save asked for on another rank"
            self.save_asked = None  # taken
        stop = None
        if got_signal:
            # A stop that is not a signal (a Ray node's drain) says what it is.
            stop = (self.received if self.received and not self.received.startswith("SIG")
                    else f"signal {self.received or 'received by another rank'}")
        elif out_of_time:
            stop = f"training.exit_duration_mins={t.exit_duration_mins} reached"
        return Decision(bool(ck.dir) and (timer or asked or stop is not None), stop,
                        why_asked if stop is None else None)
