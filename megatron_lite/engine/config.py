"""DeepSpeed's config, generated from the recipe: the only code that knows its format."""

from __future__ import annotations

import copy
from typing import Any

from megatron_lite.config.deepspeed_block import deepspeed_block_problems
from megatron_lite.config.schema import Config
from megatron_lite.distributed.parallel_dims import ParallelDims


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
    norm; there the trainer clips itself so the norm can be logged (and spikes tracked). Not
    under pipelining, where DeepSpeed's engine owns the whole step."""
    p = cfg.parallel
    return p.deepspeed_zero_stage == 0 and cfg.training.precision == "fp32" and p.pipeline == 1


def deepspeed_config(cfg: Config, dims: ParallelDims) -> dict[str, Any]:
    """The DeepSpeed config generated from the recipe, with its ``deepspeed:`` block merged over."""
    t = cfg.training
    generated = {
        # DeepSpeed's view: under HSDP its data-parallel world is one shard group.
        "train_batch_size": t.micro_batch_size * dims.grad_accumulation(cfg) * dims.deepspeed_data,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": dims.grad_accumulation(cfg),
        "gradient_clipping": 0.0 if trainer_clips_gradients(cfg) else cfg.optimizer.grad_clip,
        "zero_optimization": {"stage": cfg.parallel.deepspeed_zero_stage},
        # bf16 needs no loss scaling, so DeepSpeed's per-tensor overflow scan (several kernels and a
        # host sync per parameter tensor) only duplicates the update gate (training/step.py),
        # which declines every step with a non-finite loss or gradient norm.
        "bf16": {"enabled": t.precision == "bf16", "check_grad_overflow": False},
        "fp16": {"enabled": t.precision == "fp16", "initial_scale_power": 16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,  # we log ourselves
        "wall_clock_breakdown": False,
    }
    if dims.pipeline > 1 and dims.sequence_parallel:
        # The pipeline engine sends 1/tensor of a stage's output from each tensor rank and
        # gathers it on the next stage, which assumes the tensor ranks hold the same output;
        # under Megatron sequence parallelism each holds its own slice of the sequence.
        generated["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    zero = generated["zero_optimization"]
    if sums_over_sequence_by_loss(cfg, dims):
        zero["reduce_scatter"] = True  # the path sequence_gradient_factor is right for
    for key, where in (("offload_optimizer", cfg.parallel.offload_optimizer),
                       ("offload_param", cfg.parallel.offload_params)):
        if where != "none":
            # Pinned host buffers: the device copies them asynchronously.
            zero[key] = {"device": where, "pin_memory": True}
            if where == "nvme":
                zero[key]["nvme_path"] = cfg.parallel.nvme_path
    extra = copy.deepcopy(dict(cfg.deepspeed))
    problems = _contradictions(cfg, dims, extra)
    if problems:
        raise ValueError("the recipe's deepspeed: block contradicts the recipe (set the recipe key "
                         "instead, or drop the deepspeed key): " + "; ".join(problems))
    return deep_merge(generated, extra)


def _owned_values(cfg: Config, dims: ParallelDims) -> dict[str, tuple[Any, str]]:
    """DeepSpeed keys whose meaning the recipe already states elsewhere: dotted key -> (the
    recipe's value in DeepSpeed's terms, where the recipe states it)."""
    owned = {
        "train_batch_size": (dims.global_batch(cfg), "training.global_batch_size"),
        "train_micro_batch_size_per_gpu": (cfg.training.micro_batch_size, "training.micro_batch_size"),
        "gradient_accumulation_steps": (
            dims.grad_accumulation(cfg),
            "training.global_batch_size / (micro_batch_size × data-parallel size)"),
        "gradient_clipping": (cfg.optimizer.grad_clip, "optimizer.grad_clip"),
        "zero_optimization.stage": (cfg.parallel.deepspeed_zero_stage, "parallel.zero_stage / parallel.hsdp"),
        "bf16.enabled": (cfg.training.precision == "bf16", "training.precision"),
        "fp16.enabled": (cfg.training.precision == "fp16", "training.precision"),
        "zero_optimization.offload_optimizer.device": (cfg.parallel.offload_optimizer,
                                                       "parallel.offload_optimizer"),
        "zero_optimization.offload_param.device": (cfg.parallel.offload_params, "parallel.offload_params"),
    }
    if sums_over_sequence_by_loss(cfg, dims):
        owned["zero_optimization.reduce_scatter"] = (
            True, "ZeRO-3 with parallel.ulysses / parallel.context (sequence_gradient_factor)")
    return owned


def sums_over_sequence_by_loss(cfg: Config, dims: ParallelDims) -> bool:
    """Whether the trainer multiplies the loss by the sequence ranks before backward
    (``sequence_gradient_factor``)."""
    return cfg.parallel.deepspeed_zero_stage == 3 and dims.sequence > 1 and dims.pipeline == 1


def sequence_gradient_factor(cfg: Config, dims: ParallelDims) -> float:
    """What the training loss is multiplied by before DeepSpeed's backward. A sequence rank's
    gradient is its slice's share, to be summed over the sequence (Ulysses × context) ranks and
    averaged over the data ranks: DeepSpeed's all-reduce and ZeRO 1/2 divide by the data ranks
    alone, but ZeRO-3's reduce-scatter (``reduce_scatter: true``, its default and the only path
    it takes for every bucket) divides by data × sequence ranks, which would leave the
    gradients 1/sequence of the one-process ones (and the reported norm with them)."""
    return float(dims.sequence) if sums_over_sequence_by_loss(cfg, dims) else 1.0


def _contradictions(cfg: Config, dims: ParallelDims, extra: dict) -> list[str]:
    """Problems with the recipe's ``deepspeed:`` block (``extra``, edited in place): a key that
    restates the recipe's own value is dropped (the generated value, which may be DeepSpeed's way
    of doing the same thing, stays); one that says something else is a contradiction, since a
    silent winner would leave the logged config, the planner and the checkpoints describing
    another run than the one DeepSpeed executes."""
    # Config loading refuses these already; a Config built another way gets the same answer.
    problems = deepspeed_block_problems(extra)
    for name, section in (("optimizer", "optimizer"), ("scheduler", "schedule")):
        if name in extra:
            problems.append(f"deepspeed.{name}: the {name} is built from the recipe's {section}: section")
    for dotted, (value, source) in _owned_values(cfg, dims).items():
        *parents, leaf = dotted.split(".")
        block = extra
        for parent in parents:
            block = block.get(parent) if isinstance(block, dict) else None
        if not isinstance(block, dict) or leaf not in block:
            continue
        given = block[leaf]
        if given == value or (isinstance(value, float) and isinstance(given, (int, float))
                              and float(given) == value):
            del block[leaf]
        else:
            problems.append(f"deepspeed.{dotted}={given!r} but {source} gives {value!r}")
    return problems
