"""The checkpoint side of a loss-spike rollback: the history of rollbacks kept with the
checkpoints (so the skipped data and the count survive a crash), the checkpoint to go back to,
and moving the newer ones aside (never deleting them)."""

from __future__ import annotations

from pathlib import Path

from megatron_lite.checkpoint import store
from megatron_lite.checkpoint.context import CheckpointContext, as_checkpoint_error
from megatron_lite.checkpoint.load import CheckpointReader
from megatron_lite.checkpoint.manifest import RESUME_SECTIONS, read_manifest
from megatron_lite.checkpoint.store import CheckpointError
from megatron_lite.distributed.collectives import on_one_rank_then_all


class Rollbacks:
    def __init__(self, ctx: CheckpointContext, reader: CheckpointReader):
        self.ctx, self.reader = ctx, reader
        self.dims, self.log, self.root = ctx.dims, ctx.log, ctx.root

    def rollback_history(self, resuming: bool) -> list[dict]:
        """Collective. The rollbacks recorded with the checkpoints (``store.ROLLBACKS``), the
        same on every rank; on a fresh start an old history is set aside and [] returned."""
        def read() -> list[dict]:
            if self.root is None or not self.root.is_dir():
                return []
            if resuming:
                return store.read_rollbacks(self.root)
            if (old := store.set_aside_rollbacks(self.root)) is not None:
                self.log(f"{self.root / store.ROLLBACKS} from an earlier run moved to {old}")
            return []

        return on_one_rank_then_all(
            read, self.dims, "reading the rollback history", share=True,
            fail=as_checkpoint_error(f"cannot read or move the rollback history in {self.root}"))

    def record_rollback(self, record: dict) -> None:
        """Collective, before anything is moved or reloaded: rank 0 adds ``record`` to the
        history kept with the checkpoints, so the skipped data window and the rollback count
        survive a crash and a changed ``logging.dir``."""
        assert self.root is not None
        history = self.root / store.ROLLBACKS
        on_one_rank_then_all(
            lambda: store.append_rollback(self.root, record), self.dims, "recording the rollback",
            fail=lambda e: CheckpointError(f"cannot record the rollback in {history}: {e}"))

    def rollback_target(self, newest_step: int) -> tuple[Path, int, int] | None:
        """Collective. The newest committed, verified checkpoint at or before ``newest_step``:
        its path, step and data position."""
        def listed() -> list[tuple[Path, dict]]:
            out = []
            if self.root is None or not self.root.is_dir():
                return out
            for path in store.committed_steps(self.root):
                try:
                    manifest = read_manifest(path, RESUME_SECTIONS)
                except Exception as e:  # one unreadable checkpoint: the others may do
                    self.log(f"warning: not rolling back to {path}: {e}")
                    continue
                if manifest["step"] <= newest_step:
                    out.append((path, manifest))
            return out

        candidates = on_one_rank_then_all(
            listed, self.dims, "listing the rollback candidates", share=True,
            fail=as_checkpoint_error(f"cannot list the checkpoints in {self.root}"))
        found = self.reader.first_valid(candidates, strict=False, required=False)
        if found is None:
            return None
        path, manifest = found
        return path, manifest["step"], manifest["consumed_samples"]

    def abandon_after(self, path: Path, reason: str) -> list[Path]:
        """Collective. Make ``path`` the latest checkpoint: newer ones are moved (not deleted)
        to ``abandoned/`` so neither a resume nor retention picks them up."""
        return on_one_rank_then_all(
            lambda: store.abandon_after(self.root, path, reason), self.dims,
            "moving newer checkpoints aside", share=True,
            fail=as_checkpoint_error(f"cannot move checkpoints newer than {path} aside"))
