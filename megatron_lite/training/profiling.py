"""Profiling on demand (``profile.steps``, ``profile.ranks``): torch.profiler around chosen steps.

The trace is written by torch's TensorBoard handler: one ``.pt.trace.json`` per rank, a Chrome
trace that Perfetto / chrome://tracing open and that TensorBoard's profiler plugin reads from the
same folder. Activities: the CPU always, and the run's accelerator where torch.profiler has it
(CUDA; HPU through Habana's torch, which adds ``ProfilerActivity.HPU``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from megatron_lite.config import Config


def activities(device: str) -> list:
    act = torch.profiler.ProfilerActivity
    found = [act.CPU]
    extra = {"cuda": getattr(act, "CUDA", None), "hpu": getattr(act, "HPU", None)}.get(device)
    if extra is not None:
        found.append(extra)
    return found


class StepProfiler:
    """Call ``before(step)`` and ``after(step)`` around every step (``step`` counted from 1)."""

    def __init__(self, cfg: Config, rank: int, device: str, log: Callable[[str], None]):
        steps, p = list(cfg.profile.steps), cfg.profile
        self.on = bool(steps) and rank in list(p.ranks)
        self.start, self.end = (steps[0], steps[1]) if steps else (0, -1)
        self.dir = Path(p.dir or Path(cfg.logging.dir) / "profile")
        self.rank, self.device, self.log = rank, device, log
        self.prof = None
        self.mark = None

    def before(self, step: int) -> None:
        if self.on and step == self.start and self.prof is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            handler = torch.profiler.tensorboard_trace_handler(str(self.dir), worker_name=f"rank{self.rank}")
            self.prof = torch.profiler.profile(activities=activities(self.device), on_trace_ready=handler)
            self.prof.start()
        if self.prof is not None:  # the step as one span named by its number, over its operators
            self.mark = torch.profiler.record_function(f"train_step#{step}")
            self.mark.__enter__()

    def after(self, step: int) -> None:
        if self.prof is None:
            return
        if self.mark is not None:
            self.mark.__exit__(None, None, None)
            self.mark = None
        self.prof.step()
        if step >= self.end:
            self.close()
            self.log(f"profile of steps {self.start}-{self.end} (rank {self.rank}) written to {self.dir}")

    def close(self) -> None:
        """Stop recording (writes the trace); also when the run ends inside the window."""
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.stop()
