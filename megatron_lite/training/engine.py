"""The DeepSpeed engine: the only module that knows DeepSpeed's config format."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from megatron_lite.config.schema import Config
from megatron_lite.distributed.parallel_dims import ParallelDims
from megatron_lite.training.optimizer import build_optimizer
from megatron_lite.training.schedule import lr_at


def deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def trainer_clips_gradients(cfg: Config) -> bool:
    """True where DeepSpeed's plain-optimizer path (ZeRO 0, fp32) would clip but discard the
    norm; there the trainer clips itself so the norm can be logged (and spikes tracked)."""
    return cfg.parallel.zero_stage == 0 and cfg.training.precision == "fp32"


def deepspeed_config(cfg: Config, dims: ParallelDims) -> dict[str, Any]:
    """The DeepSpeed config generated from the recipe, with its ``deepspeed:`` block merged over."""
    t = cfg.training
    generated = {
        "train_batch_size": dims.global_batch(cfg),
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": dims.grad_accumulation(cfg),
        "gradient_clipping": 0.0 if trainer_clips_gradients(cfg) else cfg.optimizer.grad_clip,
        "zero_optimization": {"stage": cfg.parallel.zero_stage},
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": t.precision == "fp16", "initial_scale_power": 16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,  # we log ourselves
        "wall_clock_breakdown": False,
    }
    return deep_merge(generated, dict(cfg.deepspeed))


def build_engine(model: nn.Module, cfg: Config, dims: ParallelDims, total_iters: int,
                 device_type: str):
    """``deepspeed.initialize`` with our AdamW and LR schedule; returns the engine."""
    import deepspeed

    optimizer = build_optimizer(model, cfg.optimizer, device_type)
    peak = cfg.optimizer.lr
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, cfg.optimizer, cfg.schedule, total_iters) / peak)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler,
        config=deepspeed_config(cfg, dims), dist_init_required=False)
    return engine
