"""AdamW with weight decay on matrices only (never on norms or biases)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megatron_lite.config.schema import OptimizerConfig


def param_groups(model: nn.Module, weight_decay: float,
                 shape: Callable[[nn.Parameter], tuple[int, ...]] = lambda p: tuple(p.shape)) -> list[dict]:
    """``shape``: a parameter's logical shape (a ZeRO-3 partition is a flat piece of a matrix)."""
    decay, no_decay = [], []
    for p in model.parameters():  # a tied weight appears once
        if p.requires_grad:
            (decay if len(shape(p)) >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device_type: str,
                    adamw: type | None = None, offloaded: bool = False,
                    shape: Callable[[nn.Parameter], tuple[int, ...]] = lambda p: tuple(p.shape),
                    ) -> torch.optim.Optimizer:
    """AdamW; ``adamw``: a device's fused class with torch's arguments (Gaudi's FusedAdamW);
    ``offloaded``: the update runs on the host (ZeRO-Offload), by DeepSpeed's CPU Adam (SIMD,
    multi-threaded; DeepSpeed refuses another optimizer there); ``shape``: see
    ``param_groups``."""
    groups = param_groups(model, cfg.weight_decay, shape)
    if offloaded:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                adamw_mode=True)
    if adamw is not None:
        return adamw(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    # torch's fused AdamW has kernels for CUDA, Intel GPUs and CPU; elsewhere the multi-tensor path.
    fused = device_type in ("cuda", "xpu", "cpu")
    return torch.optim.AdamW(groups, lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=fused, foreach=None if fused else True)


def first_step_state(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """The Adam state ``opt`` would create for ``p`` on its first step (zero moments, step 0):
    torch's AdamW counts steps in a tensor (on the parameter's device for the fused kernel),
    DeepSpeed's CPU Adam in an int."""
    moments = {"exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
               "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if isinstance(opt, DeepSpeedCPUAdam):
        return {"step": 0, **moments}
    fused = bool(opt.defaults.get("fused"))
    return {"step": torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu"), **moments}
