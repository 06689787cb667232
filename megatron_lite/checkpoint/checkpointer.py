"""A run's checkpoints: one object the trainer holds, made of the parts that do each job
(``save.CheckpointWriter``, ``load.CheckpointReader``, ``rollback.Rollbacks``).

Collective: every rank calls ``save`` and ``load`` at the same step; a failure on any rank is
raised on every rank (nothing hangs), and a failed save leaves the previous checkpoint intact.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import megatron_lite.checkpoint.store as store
from megatron_lite.checkpoint.context import CheckpointContext, as_checkpoint_error
from megatron_lite.checkpoint.load import ARCHITECTURE, CheckpointReader, Loaded, architecture
from megatron_lite.checkpoint.rollback import Rollbacks
from megatron_lite.checkpoint.save import CheckpointWriter
from megatron_lite.config import Config
from megatron_lite.config.schema import ModelConfig
from megatron_lite.distributed.collectives import on_one_rank_then_all
from megatron_lite.distributed.parallel_dims import ParallelDims

__all__ = ["ARCHITECTURE", "Checkpointer", "Loaded", "architecture"]


class Checkpointer:
    def __init__(self, cfg: Config, dims: ParallelDims, acc, engine, model_cfg: ModelConfig,
                 log: Callable[[str], None]):
        self.ctx = CheckpointContext(cfg, dims, acc, engine, model_cfg, log)
        self.root = self.ctx.root
        self.writer = CheckpointWriter(self.ctx)
        self.reader = CheckpointReader(self.ctx)
        self.rollbacks = Rollbacks(self.ctx, self.reader)
        self._lock = None  # rank 0's open lock file on the directory (store.claim)

    def claim(self) -> None:
        """Collective, before the first load or save: rank 0 locks the directory for this run
        and, under ``checkpoint.resume=false``, refuses one holding another run's checkpoints."""
        def take() -> None:
            self._lock, warning = store.claim(self.root, fresh=not self.ctx.cfg.checkpoint.resume)
            if warning:
                self.ctx.log(warning)

        on_one_rank_then_all(take, self.ctx.dims, "claiming the checkpoint directory",
                             fail=as_checkpoint_error(f"cannot use checkpoint.dir {self.root}"))

    def save(self, step: int, consumed_samples: int, background: bool = False,
             extra: dict | None = None) -> Path | None:
        """Collective: ``CheckpointWriter.save``."""
        return self.writer.save(step, consumed_samples, background, extra)

    def wait(self) -> Path | None:
        """The background save in flight, if any, finished: ``CheckpointWriter.wait``."""
        return self.writer.wait()

    def load(self, target: Path | None = None) -> Loaded | None:
        """Collective: ``CheckpointReader.load``."""
        return self.reader.load(target)

    def rollback_history(self, resuming: bool) -> list[dict]:
        """Collective: ``Rollbacks.rollback_history``."""
        return self.rollbacks.rollback_history(resuming)

    def record_rollback(self, record: dict) -> None:
        """Collective: ``Rollbacks.record_rollback``."""
        self.rollbacks.record_rollback(record)

    def rollback_target(self, newest_step: int) -> tuple[Path, int, int] | None:
        """Collective: ``Rollbacks.rollback_target``."""
        return self.rollbacks.rollback_target(newest_step)

    def abandon_after(self, path: Path, reason: str) -> list[Path]:
        """Collective: ``Rollbacks.abandon_after``."""
        return self.rollbacks.abandon_after(path, reason)
