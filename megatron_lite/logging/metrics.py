"""Run metrics to the console, ``metrics.jsonl``, TensorBoard and Weights & Biases (rank 0 only).

``metrics.jsonl`` is a stable contract (docs/run_directory.md): one JSON object per line, a
training record per logged step and an evaluation record per evaluation.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from megatron_lite.config.schema import Config


class MetricsLogger:
    """Rank 0's metrics sinks. Writing inside the training loop happens on rank 0 alone, so a
    failing sink (a full disk, TensorBoard, W&B) is reported once and skipped, never raised:
    the other ranks would wait for rank 0 in the next collective."""

    def __init__(self, cfg: Config, run_dir: Path, enabled: bool, config_dict: dict[str, Any]):
        self.enabled = enabled
        self.run_dir = run_dir
        self._jsonl = None
        self._tb = None
        self._wandb = None
        self._failing: set[str] = set()
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir))
        if cfg.logging.wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(
                project=cfg.logging.wandb_project, name=cfg.logging.run_name or run_dir.name,
                dir=str(run_dir), mode=cfg.logging.wandb_mode, config=config_dict)

    def log(self, record: dict[str, Any]) -> None:
        """Write one record (must hold ``step``) to every sink."""
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        self._write_jsonl(record)
        step = record["step"]
        scalars = {k: v for k, v in record.items()
                   if k not in ("step", "time") and isinstance(v, (int, float)) and math.isfinite(v)}
        if self._tb is not None:
            self._safely("TensorBoard", lambda: [self._tb.add_scalar(k, v, step) for k, v in scalars.items()])
        if self._wandb is not None:
            self._safely("W&B", lambda: self._wandb.log(scalars, step=step))

    def _write_jsonl(self, record: dict[str, Any]) -> None:
        assert self._jsonl is not None

        def write() -> None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()

        self._safely(str(self.run_dir / "metrics.jsonl"), write)

    def _safely(self, sink: str, fn) -> None:
        try:
            fn()
        except Exception as e:
            if sink not in self._failing:
                self._failing.add(sink)
                print(f"warning: writing {sink} failed ({type(e).__name__}: {e}); training goes on, "
                      "records are dropped until it works again", file=sys.stderr, flush=True)
        else:
            self._failing.discard(sink)

    def event(self, step: int, kind: str, message: str, **fields: Any) -> None:
        """A noteworthy event (a failed save, a stop on a signal): a ``metrics.jsonl`` record
        with ``event``, TensorBoard text and a W&B count."""
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), "step": step, "event": kind, "message": message, **fields}
        self._write_jsonl(record)
        if self._tb is not None:
            self._safely("TensorBoard", lambda: self._tb.add_text(f"events/{kind}", message, step))
        if self._wandb is not None:
            self._safely("W&B", lambda: self._wandb.log({f"events/{kind}": 1}, step=step))

    def text(self, tag: str, text: str, step: int) -> None:
        if self._tb is not None:
            self._safely("TensorBoard", lambda: self._tb.add_text(tag, text, step))

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def console_line(r: dict[str, Any], total_iters: int) -> str:
    parts = [f"step {r['step']:>6}/{total_iters}", f"loss {r['loss']:.4f}", f"lr {r['lr']:.3e}"]
    if r.get("grad_norm") is not None:
        parts.append(f"gnorm {r['grad_norm']:.3f}")
    parts += [f"{r['step_time_ms']:.1f} ms/step", f"{r['tokens_per_sec']:,.0f} tok/s",
              f"{r['tokens_per_sec_per_device']:,.0f} tok/s/dev",
              f"{r['tflops_per_device']:.2f} TFLOP/s/dev"]
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    parts.append(f"mem {r['memory_gib']:.2f} GiB")
    return " | ".join(parts)
