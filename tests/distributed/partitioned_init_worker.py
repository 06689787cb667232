"""Worker of test_partitioned_init.py (each of 2 ranks): builds a ZeRO-3 model as a run does and
writes, as JSON in OUT/rank{N}.json, the most bytes its parameters held on the device while it
was being built, with the planner's per-rank weight bytes and largest parameter.

The bytes are counted as each parameter is filled (the build's gradient-sum registration, which
every parameter passes through once, right after it is filled): the storage every parameter
built so far holds, its ZeRO partition included. ``whole=1`` builds without the partitioned
initialisation (the build before it: the whole model first, DeepSpeed shards it later)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megatron_lite.config import load_config
from megatron_lite.distributed import detect, init_distributed
from megatron_lite.distributed.startup import shutdown_distributed
from megatron_lite.engine.initialize import partitioned_init
from megatron_lite.model import resolve_model
from megatron_lite.parallel import apply, build_parallel_model
from megatron_lite.planner.estimate import estimate, largest_gathered
from megatron_lite.training.entry import exit_process

out = Path(sys.argv[1])  # each rank its own file: lines two ranks print at once can interleave
overrides = [a for a in sys.argv[2:] if a != "whole=1"]
cfg = load_config("recipes/shakespeare-char.yaml", ["model.vocab_size=66", "training.micro_batch_size=1",
                                                   "parallel.zero_stage=3", *overrides])
dims, acc = init_distributed(cfg, detect())
model_cfg = resolve_model(cfg.model, None, cfg.data.seq_length, dims.tensor)
partition, dtype = (None, None) if "whole=1" in sys.argv else partitioned_init(cfg, dims)


def held(param) -> int:
    """Bytes ``param`` holds: its data, and its ZeRO partition where DeepSpeed moved it aside."""
    part = getattr(param, "ds_tensor", None)
    return param.untyped_storage().nbytes() + (part.untyped_storage().nbytes() if part is not None else 0)


built, peaks = [], []
register = apply.comm.register_gradient_sum


def counted(param):
    built.append(param)
    peaks.append(sum(held(p) for p in built))
    return register(param)


apply.comm.register_gradient_sum = counted
model = build_parallel_model(model_cfg, dims, acc.current_device_name(), cfg.training.seed,
                             zero_partition=partition, dtype=dtype)
plan = estimate(cfg, model_cfg, dims.world_size, 2)
result = {"rank": dims.rank, "peak": max(peaks), "after": sum(held(p) for p in model.parameters()),
          "counted": len(built), "parameters": len(list(model.parameters())),
          "plan_weights": plan.weights, "largest": largest_gathered(model_cfg, dims.tensor, 1),
          "element": 2 if cfg.training.precision != "fp32" else 4}
(out / f"rank{dims.rank}.json").write_text(json.dumps(result))
shutdown_distributed(dims)
exit_process(0)  # as pretrain.py: no interpreter finalization after the groups are gone (it can abort)
