"""Run metrics to the console, ``metrics.jsonl``, TensorBoard and Weights & Biases (rank 0 only).

``metrics.jsonl`` is a stable contract (docs/run_directory.md): one JSON object per line, a
training record per logged step and an evaluation record per evaluation.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from megatron_lite.config.schema import Config
from megatron_lite.logging.console import emit_line


class MetricsLogger:
    """Rank 0's metrics sinks. Writing inside the training loop happens on rank 0 alone, so a
    failing sink (a full disk, TensorBoard, W&B) is reported once and skipped, never raised:
    the other ranks would wait for rank 0 in the next collective."""

    def __init__(self, cfg: Config, run_dir: Path, enabled: bool, config_dict: dict[str, Any]):
        self.enabled = enabled
        self.run_dir = run_dir
        self._jsonl = None
        self._records = 0  # written by this run (start_fresh moves only an earlier run's file)
        self._tb = None
        self._wandb = None
        self._wandb_floor = self._wandb_step = -1
        self._wandb_state: Path | None = None
        self._failing: set[str] = set()
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir))
        recipe = recipe_dict(cfg)
        if self._tb is not None:
            self._safely("TensorBoard", lambda: write_hparams(self._tb, recipe))
        if cfg.logging.wandb_mode != "disabled":
            import wandb

            # One W&B run across requeues: its id lives with the checkpoints (with the last
            # step it received), and a resumed run continues it. Without checkpoints nothing
            # resumes: every start is a run of its own.
            self._wandb_state = Path(cfg.checkpoint.dir) / WANDB_STATE if cfg.checkpoint.dir else None
            state = read_wandb_state(self._wandb_state) if self._wandb_state else {}
            run_id = state.get("id") or new_wandb_id()
            self._wandb_floor = int(state.get("step", -1))
            self._wandb = wandb.init(
                project=cfg.logging.wandb_project, name=cfg.logging.run_name or run_dir.name,
                dir=str(run_dir), mode=cfg.logging.wandb_mode, id=run_id, resume="allow",
                tags=list(cfg.logging.wandb_tags) or None, group=cfg.logging.wandb_group,
                config={**recipe, "runtime": config_dict})
            self._wandb_step = self._wandb_floor
            if self._wandb_state is not None:
                self._safely(str(self._wandb_state), lambda: self._save_wandb_state(run_id))

    def start_fresh(self, log) -> None:
        """This run resumes nothing: ``metrics.jsonl`` left in ``logging.dir`` by an earlier run
        is moved to ``metrics.K.jsonl`` (as ``spikes.jsonl`` is), so that the file, and the
        plots made from it, hold one run. Before the run's first record; a failure to move it
        is a warning (the records are appended after the old ones), never a stop."""
        path = self.run_dir / "metrics.jsonl"
        if self._jsonl is None or self._records or not path.is_file() or path.stat().st_size == 0:
            return
        k = 1
        while (old := path.with_name(f"metrics.{k}.jsonl")).exists():
            k += 1
        try:  # the open file follows the rename: records go to the old file until the new opens
            path.replace(old)
            fresh = open(path, "a", encoding="utf-8")
        except OSError as e:
            emit_line(f"warning: cannot start a new {path} ({e}); this run's records follow the "
                      f"earlier run's in {old if old.exists() else path}", sys.stderr)
            return
        self._jsonl.close()
        self._jsonl = fresh
        log(f"{path} from an earlier run moved to {old}")

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
        self._to_wandb(scalars, step)

    def _write_jsonl(self, record: dict[str, Any]) -> None:
        assert self._jsonl is not None

        def write() -> None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()

        self._records += 1
        self._safely(str(self.run_dir / "metrics.jsonl"), write)

    def _safely(self, sink: str, fn) -> None:
        try:
            fn()
        except Exception as e:
            if sink not in self._failing:
                self._failing.add(sink)
                emit_line(f"warning: writing {sink} failed ({type(e).__name__}: {e}); training goes on, "
                          "records are dropped until it works again", sys.stderr)
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
        self._to_wandb({f"events/{kind}": 1}, step)

    def _to_wandb(self, scalars: dict[str, Any], step: int) -> None:
        """Steps up to the last one a finished W&B run of this checkpoint directory holds are not
        sent again (W&B keeps a step's first value; a resume recomputes them bit for bit anyway).
        A stop on a signal or the time limit saves at its last step, so nothing is sent twice;
        after a crash (SIGKILL, a lost node) the steps since the resumed checkpoint are sent
        again, as W&B's own records of them died with its process."""
        if self._wandb is None or step <= self._wandb_floor:
            return
        self._safely("W&B", lambda: self._wandb.log(scalars, step=step))
        self._wandb_step = max(self._wandb_step, step)

    def _save_wandb_state(self, run_id: str) -> None:
        assert self._wandb_state is not None
        tmp = self._wandb_state.with_suffix(".tmp")
        self._wandb_state.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"id": run_id, "step": self._wandb_step}))
        os.replace(tmp, self._wandb_state)

    def text(self, tag: str, text: str, step: int) -> None:
        if self._tb is not None:
            self._safely("TensorBoard", lambda: self._tb.add_text(tag, text, step))

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._safely("W&B", self._wandb.finish)
            if self._wandb_state is not None:  # only now is every step surely W&B's
                self._safely(str(self._wandb_state), lambda: self._save_wandb_state(self._wandb.id))


WANDB_STATE = "wandb_run.json"
"""In ``checkpoint.dir`` (else the run directory): the W&B run id and the last step it received."""


def new_wandb_id() -> str:
    """Eight lowercase letters and digits, as W&B makes its run ids."""
    import secrets
    import string

    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def read_wandb_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def recipe_dict(cfg: Config) -> dict[str, Any]:
    """The resolved recipe as plain nested data (W&B's config)."""
    import dataclasses

    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def write_hparams(writer, recipe: dict[str, Any]) -> None:
    """The recipe as TensorBoard hyperparameters (its HPARAMS tab), in the run's own event file."""
    from torch.utils.tensorboard.summary import hparams

    values = {k: v if isinstance(v, (int, float, str, bool)) else json.dumps(v)
              for k, v in flat(recipe).items()}
    for summary in hparams(values, {}):
        writer.file_writer.add_summary(summary)


def duration(seconds: float) -> str:
    """``1h02m``, ``4m05s``, ``12s``."""
    seconds = max(int(round(seconds)), 0)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


PHASE_NAMES = (("data", "data"), ("forward", "fwd"), ("backward", "bwd"), ("optimizer", "opt"))
"""A step's phases (training/timing.py) and their short names on the console."""


def console_line(r: dict[str, Any], total_iters: int, time_left: float | None = None) -> str:
    """One line per log interval; it ends with the ETA of the run at the interval's step time
    and, when the run has a time limit (``time_left`` seconds), the time to it."""
    parts = [f"step {r['step']:>6}/{total_iters}", f"loss {r['loss']:.4f}", f"lr {r['lr']:.3e}"]
    if r.get("grad_norm") is not None:
        parts.append(f"gnorm {r['grad_norm']:.3f}")
    phases = " ".join(f"{short} {r[f'{phase}_ms']:.1f}" for phase, short in PHASE_NAMES if f"{phase}_ms" in r)
    parts.append(f"{r['step_time_ms']:.1f} ms/step" + (f" ({phases})" if phases else ""))
    if r.get("tokens_per_sec") is None:
        parts.append("throughput: warm-up")
    else:
        parts += [f"{r['tokens_per_sec']:,.0f} tok/s", f"{r['tokens_per_sec_per_device']:,.0f} tok/s/dev",
                  f"{r['tflops_per_device']:.2f} TFLOP/s/dev"]
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    parts.append(f"mem {r['memory_gib']:.2f} GiB")
    eta = f"ETA {duration((total_iters - r['step']) * r['step_time_ms'] / 1000)}"
    if time_left is not None:
        eta += f" (time limit in {duration(time_left)})"
    parts.append(eta)
    return " | ".join(parts)
