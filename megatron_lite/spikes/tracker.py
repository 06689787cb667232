"""Per-step spike bookkeeping: verdicts, policies, provenance, ``spikes.jsonl`` and the state
saved in checkpoints.

The trainer takes every step through ``track``; where the verdict comes before the update, the
step runner calls ``judge`` once during the step, at the moment DeepSpeed hands the gradients to
the optimizer, with the loss reduced over all ranks and the global gradient norm; elsewhere the
trainer hands the step's report to ``record`` once it has been read, one step later
(training/step_report.py). The answer is the same on every rank because its inputs are.

``spikes.jsonl`` holds one JSON object per event and nothing that varies between identical runs
(no wall time: the same event in ``metrics.jsonl`` has it), so a resumed run's file equals the
uninterrupted run's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from megatron_lite.config.schema import SpikesConfig
from megatron_lite.spikes.detector import SpikeDetector, Verdict

SPIKES_FILE = "spikes.jsonl"
T = TypeVar("T")


class SpikeStop(RuntimeError):
    """The run must stop: too many non-finite steps in a row, or rollbacks exhausted."""


@dataclass
class StepContext:
    step: int
    """The step being taken (1-based: the value of ``step`` after it)."""
    batch_start: int
    """Global index of the batch's first sample (the data position before the step)."""
    lr: float
    global_batch: int
    consumed_after: int
    """The data position after the step (past any rolled-back range)."""


def _round(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.6g}")


class SpikeTracker:
    def __init__(self, cfg: SpikesConfig, run_dir: Path, is_main: bool,
                 locate: Callable[[int], dict] | None, log: Callable[[str], None], event_sink=None):
        self.cfg, self.is_main, self.locate, self.log = cfg, is_main, locate, log
        self.path = run_dir / SPIKES_FILE
        self.event_sink = event_sink  # MetricsLogger: metrics.jsonl, TensorBoard, W&B
        self.detector = SpikeDetector(cfg)
        self.consecutive_nonfinite = 0
        self.events = 0  # lines of spikes.jsonl that this run's state accounts for
        self.rollbacks = 0
        self.skip: list[tuple[int, int]] = []  # rolled-back sample ranges [start, end)
        self.context: StepContext | None = None
        self.pending: dict | None = None  # the step's judgement, turned into an event by track

    # ---------------------------------------------------------------- per step
    def track(self, ctx: StepContext, take_step: Callable[[], T]) -> tuple[T, str]:
        """Take one step (``take_step``, whose update ``judge`` gates) and record its event, if
        any. Returns the step's result and the action the trainer must take: ``apply`` (nothing
        to do), ``log``, ``skip``, ``rollback`` or ``stop``."""
        self.context, self.pending = ctx, None
        result = take_step()
        return result, self._record_event()

    def record(self, ctx: StepContext, report) -> str:
        """A step judged after its update from its ``report`` (``step_report.StepReport``): the
        device skipped a non-finite update; returns the action, as ``track`` does."""
        self.context, self.pending = ctx, None
        self.judge(report.loss, report.grad_norm)
        return self._record_event()

    def judge(self, loss: float, grad_norm: float | None, loss_scale_overflow: bool = False) -> bool:
        """Whether this step's update may be applied. Called once per step on every rank."""
        if loss_scale_overflow:
            # fp16: DeepSpeed skipped the step to lower its loss scale; that is not an event
            # unless the loss itself is not finite.
            grad_norm = None
        verdict = self.detector.observe(loss, grad_norm)
        if not verdict.is_event:
            self.consecutive_nonfinite = 0
            self.pending = None
            return True
        cfg = self.cfg
        if verdict.nonfinite:
            self.consecutive_nonfinite += 1
            action = "skip" if cfg.nonfinite_policy == "skip_step" else "rollback"
            if self.consecutive_nonfinite >= cfg.max_consecutive_nonfinite:
                action = "stop"
        else:
            self.consecutive_nonfinite = 0
            action = {"log": "log", "skip_step": "skip", "rollback": "rollback"}[cfg.policy]
        self.pending = {"verdict": verdict, "loss": loss, "grad_norm": grad_norm, "action": action}
        return action == "log"

    def _record_event(self) -> str:
        if self.pending is None:
            return "apply"
        p, ctx = self.pending, self.context
        assert ctx is not None
        verdict: Verdict = p["verdict"]
        kind = "nonfinite" if verdict.nonfinite else "spike"
        record = {
            "event": kind, "index": self.events, "step": ctx.step, "action": p["action"],
            "reasons": verdict.reasons, "loss": _round(p["loss"]), "loss_median": _round(verdict.loss_median),
            "loss_z": _round(verdict.loss_z), "grad_norm": _round(p["grad_norm"]),
            "grad_norm_median": _round(verdict.grad_norm_median), "grad_norm_z": _round(verdict.grad_norm_z),
            "lr": _round(ctx.lr), "consumed_samples": ctx.consumed_after,
            "sample_range": [ctx.batch_start, ctx.batch_start + ctx.global_batch],
        }
        if kind == "nonfinite":
            record["consecutive"] = self.consecutive_nonfinite
        self._emit(record, with_samples=True)
        what = "non-finite loss/gradient" if kind == "nonfinite" else f"{' and '.join(verdict.reasons)} spike"
        parts = [f"loss {p['loss']:.4f}"]
        if verdict.loss_z is not None:
            parts[-1] += f" (median {verdict.loss_median:.4f}, z {verdict.loss_z:.1f})"
        if p["grad_norm"] is not None:
            parts.append(f"grad norm {p['grad_norm']:.4g}")
            if verdict.grad_norm_z is not None:
                parts[-1] += f" (median {verdict.grad_norm_median:.4g}, z {verdict.grad_norm_z:.1f})"
        self.log(f"{what} at step {ctx.step}: {', '.join(parts)}; samples {ctx.batch_start}.."
                 f"{ctx.batch_start + ctx.global_batch - 1}; action: {p['action']}")
        return p["action"]

    def _emit(self, record: dict, with_samples: bool = False) -> None:
        """One event to ``spikes.jsonl`` (with the batch's provenance), metrics.jsonl,
        TensorBoard and W&B; rank 0 writes, every rank counts."""
        self.events += 1
        if not self.is_main:
            return
        full = dict(record)
        try:
            if with_samples and self.locate is not None:
                start, end = record["sample_range"]
                full["samples"] = [{"index": i, **self.locate(i)} for i in range(start, end)]
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(full) + "\n")
        except Exception as e:  # rank 0 alone: raising would leave the others waiting
            self.log(f"warning: writing {self.path} failed ({type(e).__name__}: {e}); the tracker's "
                     "state (skip windows, rollback count) is still saved with every checkpoint")
        if self.event_sink is not None:
            message = json.dumps({k: v for k, v in record.items() if k not in ("event", "step")})
            self.event_sink.event(record["step"], record["event"], message)

    # ---------------------------------------------------------------- rollbacks
    def rollback_window(self, checkpoint_position: int, spike_end: int) -> tuple[int, int]:
        """The samples a rollback skips: from the reloaded checkpoint's data position through the
        spiking batch and ``skip_batches`` more."""
        assert self.context is not None
        return (checkpoint_position,
                spike_end + self.cfg.rollback.skip_batches * self.context.global_batch)

    def record_rollback(self, to_step: int, checkpoint: str, window: tuple[int, int]) -> None:
        assert self.context is not None
        self.rollbacks += 1
        self.skip.append(window)
        self.consecutive_nonfinite = 0
        self._emit({"event": "rollback", "index": self.events, "step": self.context.step,
                    "to_step": to_step, "checkpoint": checkpoint, "skip_samples": list(window),
                    "rollbacks": self.rollbacks, "max_rollbacks": self.cfg.rollback.max_rollbacks})
        self.log(f"rolled back from step {self.context.step} to {checkpoint} (step {to_step}); "
                 f"skipping samples {window[0]}..{window[1] - 1} "
                 f"(rollback {self.rollbacks} of {self.cfg.rollback.max_rollbacks})")

    def record_note(self, kind: str, message: str) -> None:
        """A non-spike event (a rollback that could not happen, a stop)."""
        assert self.context is not None
        self._emit({"event": kind, "index": self.events, "step": self.context.step, "message": message})
        self.log(f"{kind} at step {self.context.step}: {message}")

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"detector": self.detector.state_dict(), "consecutive_nonfinite": self.consecutive_nonfinite,
                "events": self.events, "rollbacks": self.rollbacks, "skip": [list(w) for w in self.skip]}

    def load_state_dict(self, state: dict) -> None:
        """Everything ``state_dict`` saved; ``resume`` then reconciles it with the log."""
        self.detector.load_state_dict(state["detector"])
        self.consecutive_nonfinite = state["consecutive_nonfinite"]
        self.events, self.rollbacks = state["events"], state["rollbacks"]
        self.skip = [tuple(w) for w in state["skip"]]

    def restore_statistics(self, state: dict | None) -> None:
        """After a rollback: the detector as it was at the reloaded checkpoint. The history
        (events, rollbacks, skipped windows) is never rolled back."""
        self.detector = SpikeDetector(self.cfg)
        if state is not None:
            self.detector.load_state_dict(state["detector"])
        self.consecutive_nonfinite = 0

    def _lines(self) -> list[str]:
        if not self.path.is_file():
            return []
        text = self.path.read_text(encoding="utf-8", errors="replace")  # a torn last character
        return [line for line in text.splitlines() if line.strip()]

    def read_log(self) -> list[dict]:
        """What ``resume`` needs of ``spikes.jsonl``, one small record per event (the event kind;
        for rollbacks their count and window) — rank 0 reads it and the trainer broadcasts it,
        without the per-sample provenance."""
        out = []
        lines = self._lines()
        for n, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
                rollback = record.get("event") == "rollback"
                keep = ("event", "rollbacks", "skip_samples") if rollback else ("event",)
                out.append({k: record[k] for k in keep})
            except (json.JSONDecodeError, AttributeError, KeyError) as e:
                if n == len(lines):  # an interrupted write (full disk, a node crash): dropped
                    self.log(f"warning: ignoring the torn last line of {self.path} (an interrupted "
                             "write); resuming rewrites the file without it")
                    break
                raise ValueError(f"{self.path}, line {n}, is not a spike record ({type(e).__name__}: "
                                 f"{e}); move the file aside to resume with a new log") from None
        return out

    def resume(self, state: dict | None, events: list[dict], history: list[dict] = ()) -> None:
        """Restore the state saved with the checkpoint (None: a fresh start) and cut
        ``spikes.jsonl`` (summarised by ``read_log``, the same on every rank) back to what it
        accounts for. Rollbacks recorded after the checkpoint was written are kept, with their
        skipped windows (the resumed run must skip them too); events after the last of them are
        dropped, as the resumed run meets them again. ``history`` (the rollbacks recorded with
        the checkpoints) counts the same way and does not depend on the log being there. On a
        fresh start an old file is renamed, not overwritten."""
        if state is None:
            if self.is_main and self._lines():
                k = 1
                while (old := self.path.with_name(f"spikes.{k}.jsonl")).exists():
                    k += 1
                self.path.replace(old)
                self.log(f"{self.path} from an earlier run moved to {old}")
            return
        self.load_state_dict(state)
        keep = min(self.events, len(events))
        for i, record in enumerate(events):
            if i >= self.events and record["event"] == "rollback":
                keep = i + 1
                self.rollbacks = max(self.rollbacks, record["rollbacks"])
                window = tuple(record["skip_samples"])
                if window not in self.skip:
                    self.skip.append(window)
        self.events = keep
        for record in history:
            self.rollbacks = max(self.rollbacks, record["rollbacks"])
            window = tuple(record["skip_samples"])
            if window not in self.skip:
                self.skip.append(window)
        if self.is_main and len(self._lines()) > keep:  # events after it, or a torn last line
            tmp = self.path.with_name(SPIKES_FILE + ".tmp")
            tmp.write_text("".join(line + "\n" for line in self._lines()[:keep]))
            tmp.replace(self.path)
