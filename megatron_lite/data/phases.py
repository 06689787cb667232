"""Data phases: what data a run trains on, recorded with every checkpoint, so that a resume with
another blend or prefix is a decision (``data.on_resume``), never an accident.

A phase is the data identity (``identity``) from a sample position on. ``new_phase`` starts the
new data's own sample order at the position the run has reached: global sample ``i`` of the run
is sample ``i - start`` of the phase's dataset (``PhaseDataset``), so the data position, the
skipped spike windows and the checkpoints stay in the run's one sample count.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_lite.config.schema import DataConfig
from megatron_lite.data.gpt_index import SAMPLE_ORDER


class DataPhaseError(ValueError):
    """The data differs from the checkpoint's and ``data.on_resume`` does not allow it, or a
    rollback would go back across a phase's start."""


def _dataset_id(prefix: str) -> list:
    """A dataset by file name and size: the same data moved to another filesystem is the same
    dataset; other data under the old name is not."""
    path = Path(f"{prefix}.bin")
    return [path.name, path.stat().st_size if path.is_file() else None]


def identity(cfg: DataConfig) -> dict:
    """What decides the training samples, apart from the sequence length (checked with the
    model): the dataset(s) and weights, the split, the shuffling seed and the release's way of
    ordering documents' samples (``order``)."""
    return {
        "prefix": _dataset_id(cfg.prefix) if cfg.prefix else None,
        "blend": [[e.weight, *_dataset_id(e.prefix)] for e in cfg.blend],
        "split": cfg.split, "split_by": cfg.split_by, "seed": cfg.seed, "order": SAMPLE_ORDER,
    }


def differences(old: dict, new: dict) -> list[str]:
    """``data.KEY: old -> new`` for each key that differs."""
    return [f"data.{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(old.keys() | new.keys())
            if old.get(key) != new.get(key)]


def first_phase(cfg: DataConfig) -> list[dict]:
    return [{"phase": 0, "step": 0, "start": 0, "data": identity(cfg)}]


def phases_at_resume(saved: list[dict] | None, cfg: DataConfig, step: int, consumed: int, source: str,
                     log) -> list[dict]:
    """The run's phases after resuming from ``source`` at ``step`` (data position ``consumed``):
    the checkpoint's, unchanged when the data is the same; with one more phase starting at
    ``consumed`` under ``data.on_resume=new_phase``; refused under ``check``, every difference
    named. A checkpoint from before phases were recorded is taken to be on this data."""
    current = identity(cfg)
    order_note = (f"{source} was saved by a release whose sample order depended on the run's length: "
                  f"from sample {consumed} on, the samples follow this release's order, in which some "
                  "already read may come again (and a skipped spike window skips other samples)")
    if not saved:
        log(f"{source} records no data identity (saved before data phases): its data is taken to be "
            "the recipe's")
        if cfg.split_by == "documents":
            log(order_note)
        return [{"phase": 0, "step": 0, "start": 0, "data": current}]
    last = saved[-1]
    if last["data"].get("order", 1) != SAMPLE_ORDER:  # not a choice of the recipe: a note, not a refusal
        if cfg.split_by == "documents":
            log(order_note)
        last = {**last, "data": {**last["data"], "order": SAMPLE_ORDER}}
        saved = [*saved[:-1], last]
    diff = differences(last["data"], current)
    if not diff:
        return saved
    listed = "; ".join(diff)
    if cfg.on_resume == "check":
        raise DataPhaseError(
            f"the recipe's data differs from {source}'s ({listed}): set data.on_resume=new_phase to "
            f"start a new data phase at sample {consumed} (the new data from its first sample), or "
            "restore the recipe's data settings to continue the checkpoint's")
    phase = {"phase": last["phase"] + 1, "step": step, "start": consumed, "data": current}
    log(f"data phase {phase['phase']} from step {step} (sample {consumed}): {listed}")
    return [*saved, phase]


class PhaseDataset(torch.utils.data.Dataset):
    """The run's sample ``i`` is sample ``i - start`` of the phase's ``dataset``; ``locate``
    names the phase (spike provenance)."""

    def __init__(self, dataset, phase: int, start: int):
        self.dataset, self.phase, self.start = dataset, phase, start

    def __len__(self) -> int:
        return self.start + len(self.dataset)

    def _inside(self, i: int) -> int:
        if i < self.start:
            raise DataPhaseError(f"sample {i} is before data phase {self.phase}, which starts at sample "
                                 f"{self.start}")
        return i - self.start

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.dataset[self._inside(i)]

    def locate(self, i: int) -> dict:
        inner = getattr(self.dataset, "locate", None)
        where = inner(self._inside(i)) if inner is not None else {}
        return {"phase": self.phase, "phase_sample": i - self.start, **where}
