"""The recipe's ``deepspeed:`` block: sections DeepSpeed reads as mappings must be mappings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Sections of DeepSpeed's config that DeepSpeed reads as mappings, with where the recipe states
# what they are most often set for. Any other value (``deepspeed.zero_optimization=false``) would
# slip past the check that the block agrees with the recipe, then either replace the generated
# section (a ZeRO-3 recipe training at stage 0) or fail inside DeepSpeed with a TypeError.
# tests/unit/test_config.py derives the top-level ones from the installed DeepSpeed (the keys
# whose DeepSpeedConfig takes ``{}`` but not a boolean or a number) and fails when this list
# misses one. ``optimizer`` and ``scheduler`` are not here: the engine refuses them in any form.
# ``amp`` is a mapping where DeepSpeed still has it and a removed section where not.
_PRECISION = "the precision is training.precision"
DEEPSPEED_SECTIONS = {
    "zero_optimization": "the stage is parallel.zero_stage",
    "zero_optimization.offload_optimizer": "the device is parallel.offload_optimizer",
    "zero_optimization.offload_param": "the device is parallel.offload_params",
    "bf16": _PRECISION, "bfloat16": _PRECISION, "fp16": _PRECISION, "torch_autocast": _PRECISION,
    "amp": _PRECISION, "compile": "torch.compile is training.compile",
    "tensor_parallel": "tensor parallelism is parallel.tensor",
    "activation_checkpointing": "recomputation is model.activation_checkpointing",
    "pipeline": "", "flops_profiler": "", "checkpoint": "",
    "data_types": "", "aio": "", "tensorboard": "", "wandb": "", "csv_monitor": "", "comet": "",
    "comms_logger": "", "timers": "", "autotuning": "", "data_efficiency": "", "expert_parallel": "",
    "hybrid_engine": "", "weight_quantization": "",
    # Read as mappings by the oldest DeepSpeed setup.py admits (0.16).
    "compression_training": "", "elasticity": "", "nebula": "", "sparse_attention": "",
}


def deepspeed_block_problems(block: Mapping[str, Any]) -> list[str]:
    """The recipe's ``deepspeed:`` sections that DeepSpeed needs as mappings but are not."""
    problems = []
    for dotted, where in DEEPSPEED_SECTIONS.items():
        *parents, leaf = dotted.split(".")
        node: Any = block
        for parent in parents:
            node = node.get(parent) if isinstance(node, Mapping) else None
        if not isinstance(node, Mapping) or leaf not in node or isinstance(node[leaf], Mapping):
            continue
        problems.append(f"'deepspeed.{dotted}' = {node[leaf]!r} must be a mapping of DeepSpeed's "
                        f"{leaf} keys (deepspeed.{dotted}.KEY=VALUE){'; ' + where if where else ''}")
    return problems
