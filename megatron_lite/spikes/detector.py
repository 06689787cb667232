"""Spike detection on the loss and the gradient norm with robust running statistics.

For each series the detector keeps the last ``window`` finite values and compares a new value
with their median. Its spread is the median absolute deviation (MAD) scaled by 1.4826, which
equals the standard deviation for normally distributed values but is not pulled up by the
spikes themselves, as a running variance would be. A value is a spike when both

    (x - median) / (1.4826 · MAD)  >=  z        and        x  >=  ratio · median

hold: the z-score catches departures from a noisy window, the ratio keeps a very flat window
(MAD near 0) from flagging small wiggles. Only upward departures count. Nothing is judged until
``warmup_steps`` finite values were seen (the first losses fall too fast for a window).

Every finite value enters its window, spikes included: the median moves little for a few
outliers, and a lasting change of level is absorbed within half a window instead of being
flagged forever. A non-finite loss or gradient norm is always an event and never enters.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from megatron_lite.config.schema import SpikesConfig

MAD_TO_SIGMA = 1.4826  # 1 / Phi^-1(3/4): MAD of a normal distribution times this is its sigma


class RobustWindow:
    """The last ``size`` values of a series, with median / MAD z-scores."""

    def __init__(self, size: int):
        self.values: deque[float] = deque(maxlen=size)

    def __len__(self) -> int:
        return len(self.values)

    def median_and_sigma(self) -> tuple[float, float]:
        median = statistics.median(self.values)
        mad = statistics.median(abs(v - median) for v in self.values)
        return median, MAD_TO_SIGMA * mad

    def judge(self, x: float, z_threshold: float, ratio: float) -> tuple[bool, float, float]:
        """(is a spike, z-score, median) of ``x`` against the window."""
        median, sigma = self.median_and_sigma()
        if sigma > 0:
            z = (x - median) / sigma
        else:
            z = math.inf if x > median else 0.0
        spike = z_threshold > 0 and z >= z_threshold and x >= ratio * median
        return spike, z, median


@dataclass
class Verdict:
    """What the detector concluded about one step."""

    nonfinite: bool = False
    reasons: list[str] = field(default_factory=list)
    """``"nonfinite"``, ``"loss"`` and/or ``"grad_norm"``."""
    loss_z: float | None = None
    loss_median: float | None = None
    grad_norm_z: float | None = None
    grad_norm_median: float | None = None

    @property
    def is_event(self) -> bool:
        return bool(self.reasons)


class SpikeDetector:
    """Feed it one (loss, grad norm) pair per step with ``observe``; deterministic, so every
    rank given the same (reduced) values takes the same decisions."""

    def __init__(self, cfg: SpikesConfig):
        self.cfg = cfg
        self.loss = RobustWindow(cfg.window)
        self.grad_norm = RobustWindow(cfg.window)
        self.seen = 0  # finite observations so far

    def observe(self, loss: float, grad_norm: float | None) -> Verdict:
        cfg = self.cfg
        if not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm)):
            return Verdict(nonfinite=True, reasons=["nonfinite"])
        verdict = Verdict()
        ready = self.seen >= max(cfg.warmup_steps, 3)
        if ready and len(self.loss) >= 3:
            spike, verdict.loss_z, verdict.loss_median = self.loss.judge(loss, cfg.loss_z, cfg.loss_ratio)
            if spike:
                verdict.reasons.append("loss")
        if ready and grad_norm is not None and len(self.grad_norm) >= 3:
            spike, verdict.grad_norm_z, verdict.grad_norm_median = self.grad_norm.judge(
                grad_norm, cfg.grad_norm_z, cfg.grad_norm_ratio)
            if spike:
                verdict.reasons.append("grad_norm")
        self.loss.values.append(loss)
        if grad_norm is not None:
            self.grad_norm.values.append(grad_norm)
        self.seen += 1
        return verdict

    def state_dict(self) -> dict:
        return {"loss": list(self.loss.values), "grad_norm": list(self.grad_norm.values), "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.loss.values.clear()
        self.loss.values.extend(state["loss"])
        self.grad_norm.values.clear()
        self.grad_norm.values.extend(state["grad_norm"])
        self.seen = state["seen"]
