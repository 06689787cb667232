"""One rank's part of the model, with or without pipeline stages: the one entry that picks
between the plain parallelize step (``apply.py``) and pipeline stages (``pipeline.py``), so that
neither of those imports the other's builder."""

from __future__ import annotations

import torch
from torch import nn

from megatron_lite.config.schema import ModelConfig
from megatron_lite.distributed.parallel_dims import ParallelDims
from megatron_lite.model.transformer import Transformer
from megatron_lite.parallel.apply import materialize, parallelize, tag_names
from megatron_lite.parallel.pipeline import build_pipeline


def build_parallel_model(cfg: ModelConfig, dims: ParallelDims, device: torch.device | str, seed: int,
                         partition: str = "parameters") -> nn.Module:
    """This rank's part of the model: a ``Transformer`` (no pipeline) or a DeepSpeed
    ``PipelineModule`` holding this stage's layers."""
    if dims.pipeline > 1:
        return build_pipeline(cfg, dims, device, seed, partition)
    with torch.device("meta"):
        model = Transformer(cfg)
    tag_names(model)
    parallelize(model, dims)
    return materialize(model, cfg, device, seed)
