"""Slowdown and straggler detection from the phase timings of training records.

A slowdown is a log interval whose time per step is ``monitor.slowdown_factor`` times the rolling
median of the intervals before it; the event names the phase whose time per step grew most. A
straggler is a rank whose local time per step (the work it does before its first collective makes
every rank wait for the slowest) is ``monitor.straggler_factor`` times the median of the other
ranks'; step times alone would not show it, as every rank's step ends together at that exchange.
The local work is the data wait, and the forward pass too where the forward holds no collective
(no tensor, sequence or pipeline parallelism, ZeRO below 3); elsewhere the other ranks' forward
includes their wait for the slow one.
"""

from __future__ import annotations

import socket
import statistics
from collections import deque
from collections.abc import Callable
from typing import Any

from megatron_lite.config.schema import Config, MonitorConfig
from megatron_lite.distributed.collectives import all_gather_object
from megatron_lite.distributed.parallel_dims import ParallelDims
from megatron_lite.training.timing import PHASES

Event = tuple[str, str, dict[str, Any]]
"""(kind, one-line message, fields) for ``MetricsLogger.event``."""


class SlowdownMonitor:
    """Rank 0's view: its own training records, one per log interval."""

    def __init__(self, cfg: MonitorConfig):
        self.cfg = cfg
        self.history: deque[dict[str, float]] = deque(maxlen=cfg.window)
        self.slow: str | None = None  # inside a slowdown: the phase its event named

    def observe(self, record: dict[str, Any]) -> Event | None:
        """A ``slowdown`` event for this record, or None: one per slowdown, and another when the
        phase that grew most changes. Records of warm-up steps (null throughput) are not compared
        and do not enter the median."""
        if self.cfg.slowdown_factor == 0 or record.get("tokens_per_sec") is None:
            return None
        times = {"step": record["step_time_ms"],
                 **{p: record[f"{p}_ms"] for p in PHASES if f"{p}_ms" in record}}
        event = None
        if len(self.history) >= self.cfg.min_history:
            median = {k: statistics.median(h[k] for h in self.history) for k in times}
            limit = max(self.cfg.slowdown_factor * median["step"],
                        median["step"] * (1 + self.cfg.min_excess))
            if times["step"] > limit:
                # One event per slowdown, unless the phase that grew most changes.
                event = self._event(record["step"], times, median)
                phase = event[2]["phase"]
                event, self.slow = (event if phase != self.slow else None), phase
                return event  # a slow interval stays out of the median
            self.slow = None
        self.history.append(times)
        return event

    def _event(self, step: int, times: dict[str, float], median: dict[str, float]) -> Event:
        phases = [p for p in PHASES if p in times]
        grew = max(phases, key=lambda p: times[p] - median[p]) if phases else "step"
        ratio = times["step"] / median["step"] if median["step"] > 0 else float("inf")
        message = (f"step time {times['step']:.1f} ms is {ratio:.1f}x the median {median['step']:.1f} ms "
                   f"of the last {len(self.history)} log intervals; {grew} grew most "
                   f"({times.get(grew, 0.0):.1f} ms/step against {median.get(grew, 0.0):.1f})")
        return "slowdown", message, {"phase": grew, "step_time_ms": times["step"],
                                     "median_step_time_ms": median["step"], "ratio": ratio}


def forward_is_local(cfg: Config) -> bool:
    """Whether the forward pass holds no collective in this layout."""
    p = cfg.parallel
    return (p.tensor == 1 and p.pipeline == 1 and p.ulysses == 1 and p.context == 1
            and p.deepspeed_zero_stage < 3
            and not p.hsdp)


class StragglerCheck:
    """Collective over the control group (host objects), at the same log steps on every rank."""

    def __init__(self, cfg: Config, dims: ParallelDims):
        self.cfg, self.dims = cfg.monitor, dims
        self.phases = ("data", "forward") if forward_is_local(cfg) else ("data",)
        self.last_window = 0
        self.host = socket.gethostname()

    def due(self, step: int) -> bool:
        """The first log step at or after each multiple of ``monitor.straggler_interval`` (the
        same answer on every rank: every rank logs the same steps)."""
        n = self.cfg.straggler_interval
        return n > 0 and self.dims.world_size > 1 and step // n > self.last_window

    def check(self, step: int, record: dict[str, Any],
              gather: Callable[..., list] = all_gather_object) -> list[Event]:
        """Every rank: gathers (rank, host, local ms/step, step ms) and returns the events of the
        ranks slower than the others (the same list on every rank)."""
        self.last_window = step // self.cfg.straggler_interval
        local = sum(record.get(f"{p}_ms", 0.0) for p in self.phases)
        mine = (self.dims.rank, self.host, local, record["step_time_ms"])
        ranks = gather(mine, self.dims, "the straggler check")
        events = []
        for rank, host, local, step_ms in ranks:
            others = [r[2] for r in ranks if r[0] != rank]
            median = statistics.median(others)
            if local > self.cfg.straggler_factor * median and local - median > self.cfg.min_excess * step_ms:
                events.append(("straggler", (
                    f"rank {rank} on {host} spends {local:.1f} ms per step on its own work "
                    f"({' and '.join(self.phases)}) against a median of {median:.1f} ms on the other "
                    "ranks: every rank waits for it"), {"rank": rank, "host": host, "local_ms": local,
                                                        "median_local_ms": median}))
        return events
