"""One rank's part of the model, with or without pipeline stages.

The order of a build: the plain ``Transformer`` on the meta device (no memory), every parameter
tagged with its ``ShardSpec`` (its name and shape in the plain model); ``parallelize`` (tensor,
Megatron-sequence and Ulysses parallelism); ``tile_linears`` (memory-centric tiling); under
pipeline parallelism ``keep_stage`` (this stage's parts only); then ``materialize`` (this rank's
slices on the device, each from the plain model's initial value of its name, or from the weights
of ``checkpoint.init_from``; under ZeRO-3 each parameter is partitioned as soon as it is filled).
Every layout starts from exactly the single-process weights, and no rank's device ever holds the
whole model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megatron_lite.config.schema import ModelConfig
from megatron_lite.distributed.parallel_dims import ParallelDims
from megatron_lite.distributed.shard_spec import tag
from megatron_lite.engine.pipeline import loss_scale, pipeline_module
from megatron_lite.model.flops import parameter_counts
from megatron_lite.model.transformer import Transformer
from megatron_lite.parallel.apply import InitialValue, materialize, parallelize, use_selective_recompute
from megatron_lite.parallel.stages import keep_stage, stage_layers
from megatron_lite.parallel.tiling import tile_linears


def build_parallel_model(cfg: ModelConfig, dims: ParallelDims, device: torch.device | str, seed: int,
                         partition: str = "parameters", tile_factor: int = 1,
                         zero_partition: Callable[[nn.Parameter], None] | None = None,
                         dtype: torch.dtype | None = None, grad_accum: int | None = None,
                         initial: InitialValue | None = None) -> nn.Module:
    """This rank's part of the model: a ``Transformer`` (no pipeline) or a DeepSpeed
    ``PipelineModule`` around this stage's ``Transformer`` (``parallel.pipeline_partition``);
    ``tile_factor``: each block linear cut into that many × that many tiles;
    ``zero_partition``, ``dtype``: ZeRO-3's partitioned initialisation (``materialize``);
    ``grad_accum``: the accumulation steps of a step (the pipeline's loss scale: required with
    pipeline parallelism); ``initial``: each parameter's full value by name (default: the
    seeded initial values)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    tag(model)
    parallelize(model, dims)
    use_selective_recompute(model)
    tile_linears(model, tile_factor)
    if dims.pipeline == 1:
        return materialize(model, cfg, device, seed, zero_partition, dtype, initial)
    if grad_accum is None:
        raise ValueError("build_parallel_model: a pipelined model needs grad_accum (its loss scale)")
    first, end, _ = stage_layers(parameter_counts(cfg), dims.pipeline, partition)[dims.pp_rank]
    keep_stage(model, range(first, end), first=dims.pp_rank == 0, last=dims.pp_rank == dims.pipeline - 1)
    return pipeline_module(materialize(model, cfg, device, seed, initial=initial), dims, cfg.tie_embeddings,
                           loss_scale(dims, grad_accum))
