"""What the checkpoint's parts (``save``, ``load``, ``rollback``) share: the run they belong to."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatron_lite.checkpoint.store import CheckpointError
from megatron_lite.config import Config
from megatron_lite.config.schema import ModelConfig
from megatron_lite.distributed.parallel_dims import ParallelDims


@dataclass
class CheckpointContext:
    cfg: Config
    dims: ParallelDims
    acc: object
    """The accelerator (its random state is saved with each rank's)."""
    engine: object
    """The DeepSpeed engine whose state is saved and loaded."""
    model_cfg: ModelConfig
    log: Callable[[str], None]

    @property
    def root(self) -> Path | None:
        """``checkpoint.dir``, or None when the run saves nothing."""
        return Path(self.cfg.checkpoint.dir) if self.cfg.checkpoint.dir else None

    def topology(self) -> dict:
        d = self.dims
        return {"world_size": d.world_size, "tensor": d.tensor, "pipeline": d.pipeline, "data": d.data,
                "ulysses": d.ulysses, "context": d.context,
                "zero_stage": self.cfg.parallel.deepspeed_zero_stage}


def as_checkpoint_error(context: str) -> Callable[[Exception], BaseException]:
    """For ``on_one_rank_then_all``'s ``fail``: a ``CheckpointError`` stays as it is; any other
    failure becomes one, ``CONTEXT: error``."""
    return lambda e: e if isinstance(e, CheckpointError) else CheckpointError(f"{context}: {e}")
