"""Trains a small GPT and a small Llama for a few steps under the layout given by the
overrides, on fixed random tokens; writes this rank's losses, gradient norms and parameter
slices (by plain-model name) to OUT/rank{R}.pt. Run by test_layouts.py, one process or many.

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/layout_worker.py OUT \
        parallel.tensor=2 [variant=llama]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from megatron_lite.config import load_config
from megatron_lite.data.gpt_dataset import GlobalBatchSampler
from megatron_lite.distributed import detect, init_distributed
from megatron_lite.distributed.collectives import mean_over_ranks
from megatron_lite.distributed.parallel_dims import ParallelDims
from megatron_lite.distributed.startup import shutdown_distributed
from megatron_lite.engine.internals import torch_optimizer
from megatron_lite.parallel import local_shards
from megatron_lite.training.build import build

REPO = Path(__file__).resolve().parents[2]
STEPS = 5
# 95 ids, padded to 95 rows by one process and to 96 by two tensor ranks: every layout must mask
# the padding to compute the one-process function.
VOCAB = 95
COMMON = ["model.n_layers=4", "model.n_heads=4", "model.d_model=64", "model.vocab_multiple=1",
          "data.seq_length=32", "training.micro_batch_size=2", "training.global_batch_size=8",
          "training.iters=5", "schedule.warmup_iters=0", "optimizer.lr=1e-3", "optimizer.grad_clip=0.5",
          # Adam divides by sqrt(v) + eps: with the default 1e-8, gradients that are sums of
          # cancelling terms (|g| near eps) turn float rounding into 1e-5 weight differences.
          "optimizer.eps=1e-6"]
VARIANTS = {
    # GPT-2 style: learned positions, LayerNorm, GELU, biases, tied embeddings.
    "gpt": [],
    # Llama style: RoPE, RMSNorm, SwiGLU, grouped-query attention, untied, recomputed activations,
    # Qwen3's per-head query/key norms (replicated weights inside the tensor-parallel region) and
    # Qwen2's biases on q/k/v alone (split with their columns).
    # 8 query and 4 key/value heads: 2 of each per rank of Ulysses 2, as DeepSpeed < 0.18.3 needs.
    "llama": ["model.position=rope", "model.norm=rmsnorm", "model.activation=swiglu", "model.bias=false",
              "model.tie_embeddings=false", "model.n_heads=8", "model.n_kv_heads=4",
              "model.activation_checkpointing=true", "model.qk_norm=true", "model.qkv_bias=true"],
}


def train(overrides: list[str]) -> tuple[dict, ParallelDims]:
    cfg = load_config(REPO / "recipes/shakespeare-char.yaml", overrides)
    dims, acc = init_distributed(cfg, detect())
    parts = build(cfg, dims, acc, VOCAB, STEPS)
    engine, runner, device = parts.engine, parts.step_runner(), parts.device

    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (STEPS * dims.global_batch(cfg), cfg.data.seq_length + 1), generator=gen)
    if cfg.model.eod_id is not None:  # documents of a few tokens to a few dozen
        data[data % 8 == 0] = cfg.model.eod_id
    sampler = GlobalBatchSampler(0, dims.global_batch(cfg), cfg.training.micro_batch_size,
                                 dims.dp_rank, dims.data)
    batches = (data[idx] for idx in sampler)
    losses, norms = [], []
    for _ in range(STEPS):
        loss = runner.train_step(batches, device) / runner.grad_accum
        losses.append(mean_over_ranks(loss.item(), dims, "the loss"))
        norms.append(float(runner.grad_norm) if runner.grad_norm is not None else None)
    params = list(engine.module.parameters())
    if cfg.parallel.deepspeed_zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            shards = local_shards(engine.module)
    else:
        shards = local_shards(engine.module)
    offloaded = [str(getattr(where.device, "value", where.device)) if where is not None else "none"
                 for where in (engine.zero_offload_optimizer(), engine.zero_offload_param())]
    return {"losses": losses, "grad_norms": norms, "shards": shards,
            "optimizer": type(torch_optimizer(engine)).__name__, "offload": offloaded,
            "ran": what_ran(engine, dims)}, dims


def what_ran(engine, dims: ParallelDims) -> dict:
    """What this rank really ran, for the test to hold against the layout it claims: its place
    and its groups' sizes, the modules the parallelize step swapped in, the blocks it holds,
    the ZeRO stage DeepSpeed's engine runs and whether it is DeepSpeed's pipeline engine."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from megatron_lite.distributed.collectives import group_size
    from megatron_lite.model.transformer import Block
    from megatron_lite.parallel.apply import ScatterSequence
    from megatron_lite.parallel.ring import RingAttention
    from megatron_lite.parallel.tensor_parallel import ColumnParallelLinear, TensorParallelRegion
    from megatron_lite.parallel.ulysses import UlyssesAttention

    modules = list(engine.module.modules())
    axes = ("tensor", "ulysses", "context", "data", "pipeline")
    return {
        "coordinates": {axis: dims.coordinate(axis) for axis in axes},
        "group_sizes": {axis: group_size(dims.group(axis)) for axis in axes},
        "column_parallel": sum(isinstance(m, ColumnParallelLinear) for m in modules),
        "sequence_parallel_regions": sum(isinstance(m, TensorParallelRegion) and m.sequence_parallel
                                         for m in modules),
        "scatters": sum(isinstance(m, ScatterSequence) for m in modules),
        "ulysses_attention": sum(isinstance(m, UlyssesAttention) for m in modules),
        "ring_attention": sum(isinstance(m, RingAttention) for m in modules),
        "blocks": sum(isinstance(m, Block) for m in modules),
        "zero_stage": engine.zero_optimization_stage(),
        "pipeline_stages": engine.num_stages if isinstance(engine, PipelineEngine) else 1,
    }


def main() -> None:
    out, overrides = Path(sys.argv[1]), [a for a in sys.argv[2:] if not a.startswith("variant=")]
    only = [a.split("=", 1)[1] for a in sys.argv[2:] if a.startswith("variant=")]
    results = {}
    for name, extra in VARIANTS.items():
        if only and name not in only:
            continue
        results[name], dims = train([*COMMON, *extra, *overrides])
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    out.mkdir(parents=True, exist_ok=True)
    torch.save(results, out / f"rank{rank}.pt")
    shutdown_distributed(dims)


if __name__ == "__main__":
    from megatron_lite.training.entry import exit_process

    main()
    exit_process(0)  # as pretrain.py: no interpreter finalization after the groups are gone
