"""The DeepSpeed engine: ``deepspeed.initialize`` with our optimizer and schedule, the patches
applied to the engine it returns (all in ``patch_engine``), and ZeRO-3's partitioned
initialisation."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from megatron_lite.config.schema import Config
from megatron_lite.distributed.cpu_extensions import ask_cpu_info_once
from megatron_lite.distributed.parallel_dims import ParallelDims
from megatron_lite.distributed.shard_spec import spec
from megatron_lite.engine import internals
from megatron_lite.engine.config import deepspeed_config
from megatron_lite.engine.mpu import ModelParallelUnit
from megatron_lite.engine.pipeline import keep_output_layer_gradient
from megatron_lite.engine.versions import GAS_SCALING_ALWAYS, deepspeed_version
from megatron_lite.optim.optimizer import build_optimizer
from megatron_lite.optim.schedule import LRSchedule, ScheduledLR

PARAMETER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def partitioned_init(cfg: Config, dims: ParallelDims) -> tuple[Callable[[nn.Parameter], None] | None,
                                                               torch.dtype | None]:
    """ZeRO-3 (HSDP included): DeepSpeed's partitioned initialisation, applied to each parameter
    as soon as the build has filled it (``parallel.apply.materialize``), so that a rank holds
    its ZeRO partition of the model and at most one whole parameter, never its whole part of
    the model (7B at tensor=1 would take 27 GB of an A100-40GB before sharding). Returns the
    per-parameter step and the parameters' type (DeepSpeed's engine checks that a model
    initialised this way already has its precision's type; converting fp32 to bf16 before or
    after rounds alike). (None, None) elsewhere: ZeRO-1/2 keep whole weights on every rank.

    One ``deepspeed.zero.Init`` (its groups, its NVMe swapper) serves the whole build; each
    parameter is converted as soon as it is filled (``internals.partition_one``). It
    partitions over the group the engine shards over (the data × Ulysses ranks, under HSDP the
    shard group: ``ModelParallelUnit``)."""
    if cfg.parallel.deepspeed_zero_stage != 3 or cfg.model.fp8:
        # float8 swaps the block linears after the build; it needs the whole weights there.
        return None, None
    import deepspeed

    mpu = ModelParallelUnit(dims)
    init = deepspeed.zero.Init(data_parallel_group=mpu.get_sequence_data_parallel_group(),
                               config_dict_or_path=deepspeed_config(cfg, dims), mpu=mpu,
                               mem_efficient_linear=False)
    dtype = PARAMETER_DTYPES[cfg.training.precision]
    return functools.partial(internals.partition_one, init), dtype


def build_engine(model: nn.Module, cfg: Config, dims: ParallelDims, total_iters: int,
                 device_type: str, adamw: type | None = None,
                 position: Callable[[int], float] | None = None):
    """``deepspeed.initialize`` with our AdamW (``adamw``: a device's fused class) and LR
    schedule over ``total_iters`` steps (``position``: each step's place in it, see
    ``ScheduledLR``); returns the engine."""
    import deepspeed

    offloaded = cfg.parallel.offload_optimizer != "none"
    if offloaded or cfg.parallel.offload_params != "none":
        ask_cpu_info_once()  # CPU Adam's load and the NVMe op's read the CPU, a second each time
    # The plain model's shapes: a parameter partitioned at its initialisation (ZeRO-3) is flat.
    optimizer = build_optimizer(model, cfg.optimizer, device_type, adamw, offloaded,
                                lambda p: spec(p).full_shape)
    scheduler = ScheduledLR(optimizer, LRSchedule.of(cfg.optimizer, cfg.schedule, total_iters), position)
    # The pipeline engine takes its process groups from the PipelineModule's own topology
    # (built in the same rank order as ours); otherwise DeepSpeed gets our groups as its mpu.
    mpu = None if dims.pipeline > 1 else ModelParallelUnit(dims)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, mpu=mpu,
        config=deepspeed_config(cfg, dims), dist_init_required=False)
    patch_engine(engine, cfg, dims)
    return engine


def patch_engine(engine, cfg: Config, dims: ParallelDims) -> None:
    """Every change made to a DeepSpeed engine after ``deepspeed.initialize``, in one place (the
    step's own hooks into the optimizer are ``StepRunner``'s, through ``internals``)."""
    zero = cfg.parallel.deepspeed_zero_stage
    if dims.pipeline > 1 and zero == 0:
        internals.keep_clipped_norm(engine)
        if cfg.training.precision == "bf16" and dims.pp_rank == dims.pipeline - 1:
            keep_output_layer_gradient(engine)
    if zero == 0:
        internals.drop_gradients_from_a_list(engine)
    if (dims.pipeline == 1 and zero == 0 and dims.data == 1 and dims.sequence == 1
            and ((dims.grad_accumulation(cfg) == 1 and cfg.training.rampup_batch_size is None)
                 or deepspeed_version() >= GAS_SCALING_ALWAYS)):
        # No gradient is replicated over ranks, so DeepSpeed's all-reduce would reduce over a
        # group of one: skip its flatten / all-reduce / unflatten of every gradient per step.
        # (Older DeepSpeed also stops averaging over accumulation steps then: see there.)
        internals.skip_backward_allreduce(engine)
