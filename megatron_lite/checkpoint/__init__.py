"""Checkpoints: every rank writes its own slice in parallel, rank 0 commits atomically;
layout-free, so a checkpoint loads into any parallel layout (see ``store`` and ``shards``)."""

from megatron_lite.checkpoint.checkpointer import Checkpointer, Loaded
from megatron_lite.checkpoint.store import CheckpointError

__all__ = ["Checkpointer", "CheckpointError", "Loaded"]
