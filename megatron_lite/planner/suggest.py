"""``--plan --suggest``: the layouts that fit a model on an allocation, fastest first.

Every layout of the recipe's model on ``world_size`` devices is tried: tensor and Ulysses sizes
within a node (their collectives run every layer), ring attention (``parallel.context``) and
pipeline stages across nodes, the rest data parallel with ZeRO-1, 2, 3 or HSDP (ZeRO-3 within
a node), each with no, selective and full activation checkpointing; offload and tiling only
when nothing fits without them (they cost speed). The recipe's own checks
(``config.validate``) and the world-size checks (``ParallelDims.plan``) drop impossible ones;
the memory estimate (``estimate``) drops those that do not fit (``fits``, with 15% kept free
for framework buffers).

The rest are ranked by a predicted step time (``step_seconds``): the model FLOPs at the given MFU
(4/3 of them with full recomputation), plus the pipeline bubble, plus every collective at the
device table's bandwidths (within a node or across nodes, by where the group's ranks sit in
the rank order), none of it assumed hidden behind compute except ring attention's transfers,
each of which runs beside one block of attention, and HSDP's replica all-reduce, which runs
beside the last micro-batch's backward pass: only what they do not cover counts.
Ring collectives move ``2 (n - 1) / n`` of the bytes (all-reduce) or ``(n - 1) / n``
(all-gather, reduce-scatter, all-to-all). The numbers rank layouts against each other; measure
the winner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from megatron_lite.config.schema import Config, ModelConfig
from megatron_lite.config.validate import validate
from megatron_lite.distributed.device import DeviceSpec
from megatron_lite.distributed.parallel_dims import TopologyError
from megatron_lite.model import resolve_model
from megatron_lite.planner.estimate import GB, Plan, estimate

HEADROOM = 0.85
"""The share of device memory a suggested layout may plan to use."""

CPU_ADAM_PARAMS_PER_SECOND = 1e9
"""DeepSpeed's CPU Adam, parameters updated per second per rank (rough: a few host cores each)."""


@dataclass(frozen=True)
class Suggestion:
    overrides: tuple[str, ...]
    """The recipe keys that make this layout (``pretrain.py RECIPE KEY=VALUE ...``)."""
    plan: Plan
    seconds: float
    """Predicted seconds per step."""
    parts: dict[str, float]
    """What the seconds are made of: compute, bubble and each kind of communication."""


def _ring(n: int, all_reduce: bool = False) -> float:
    """Share of the bytes each rank sends in a ring collective over ``n`` ranks."""
    return (2.0 if all_reduce else 1.0) * (n - 1) / n if n > 1 else 0.0


def step_seconds(plan: Plan, cfg: Config, spec: DeviceSpec, gpus_per_node: int,
                 mfu: float) -> tuple[float, dict[str, float]]:
    """Predicted seconds per step of ``plan`` and their parts (see the module docstring)."""
    d, m, p = plan.dims, plan.model, cfg.parallel
    precision = cfg.training.precision
    width = 4 if precision == "fp32" else 2
    peak = spec.fp32 if precision == "fp32" else spec.bf16
    recompute = m.activation_checkpointing
    intra, inter, host = (x * GB for x in (spec.intra_node_gbs, spec.inter_node_gbs, spec.host_gbs))

    def bandwidth(span: int) -> float:
        """Of a group whose ranks lie within ``span`` consecutive ranks."""
        return intra if span <= gpus_per_node else inter

    micro = plan.grad_accumulation  # micro-batches per step on each rank
    blocks = plan.stage_blocks
    b, s, h = cfg.training.micro_batch_size, cfg.data.seq_length / d.sequence, m.d_model
    full = recompute == "full"
    passes = 3 if full else 2  # forward, backward, and the recomputed forward
    # (Selective recomputation reruns elementwise ops only: no FLOPs counted.)
    parts = {"compute": plan.flops_per_token * plan.tokens_per_step / (d.world_size * peak * mfu)
             * (4 / 3 if full else 1)}
    parts["pipeline bubble"] = parts["compute"] * (d.pipeline - 1) / micro
    # Tensor parallelism: an all-reduce (or its all-gather + reduce-scatter) of the (b, s, h)
    # activations entering and leaving attention and the MLP, every pass.
    tp_bytes = 2 * passes * b * s * h * width * _ring(d.tensor, all_reduce=True)
    parts["tensor"] = blocks * micro * tp_bytes / bandwidth(d.tensor)
    # Ulysses: all-to-alls of q, k, v and the output per pass (this rank's heads).
    sp_bytes = 4 * passes * b * s * h / d.tensor * width * _ring(d.ulysses)
    parts["ulysses"] = blocks * micro * sp_bytes / bandwidth(d.tensor * d.ulysses)
    # Ring attention: this rank's keys and values (its KV heads) pass context − 1 times per
    # forward, each beside a block of attention (half a block's query-key pairs under the
    # causal balance); backward passes them again, and their fp32 gradients context times,
    # each beside a block's backward (twice the compute) but the last.
    if d.context > 1:
        heads = d.tensor * d.ulysses
        piece = cfg.data.seq_length / d.context  # the tokens a context rank attends for
        kv = 2 * b * piece * m.kv_heads * m.head_dim / heads
        link = bandwidth(heads * d.context)
        block = 4 * b * piece * piece / 2 * m.n_heads * m.head_dim / heads / (peak * mfu)
        forward = (d.context - 1) * max(0.0, kv * width / link - block)
        exposed = max(0.0, kv * width / link - 2 * block) + max(0.0, kv * 4 / link - 2 * block)
        backward = (d.context - 1) * exposed + kv * 4 / link
        parts["context"] = blocks * micro * ((2 if full else 1) * forward + backward)
    # Pipeline: activations forward and their gradients back, per micro-batch and boundary.
    if d.pipeline > 1:
        boundary = 2 * b * s * h * width / (d.tensor if d.sequence_parallel else 1)
        parts["pipeline"] = micro * boundary / bandwidth(d.world_size // d.pipeline + 1)
    # Data parallelism over data × sequence ranks (each holds a share of the gradient).
    grad_bytes = plan.stage_parameters * width
    ranks = d.data * d.sequence
    span = d.tensor * ranks
    stage = p.deepspeed_zero_stage
    if d.hsdp_shard_size:
        shard = d.hsdp_shard_size
        shard_span = d.tensor * d.sequence * shard
        parts["data"] = grad_bytes * _ring(shard) / bandwidth(shard_span)
        # The replica all-reduce of each bucket starts when its reduce-scatter ends, beside the
        # last micro-batch's backward (2/3 of its compute): what that does not cover, and at
        # least the last block's share (reduced when the backward has ended), stays exposed.
        replicas = grad_bytes / shard * _ring(d.hsdp_replicas, all_reduce=True) / bandwidth(span)
        backward = parts["compute"] * 2 / 3 / micro
        parts["hsdp replicas"] = max(replicas - backward, replicas / blocks)
        parts["zero-3 gathers"] = passes * grad_bytes * _ring(shard) / bandwidth(shard_span)
    else:
        parts["data"] = grad_bytes * _ring(ranks, all_reduce=True) / bandwidth(span)
        if stage == 3:
            parts["zero-3 gathers"] = passes * grad_bytes * _ring(ranks) / bandwidth(span)
    zero_ranks = d.hsdp_shard_size or ranks
    if p.offload_optimizer != "none":
        local = plan.stage_parameters / (zero_ranks if stage >= 1 else 1)
        # Gradients down in fp32, weights back up; CPU Adam in between.
        parts["offload"] = local * (4 + width) / host + local / CPU_ADAM_PARAMS_PER_SECOND
    if p.offload_params != "none":
        parts["offload"] = parts.get("offload", 0.0) + passes * grad_bytes / host
    parts = {k: v for k, v in parts.items() if v > 0}
    return sum(parts.values()), parts


def _layouts(world: int, gpus_per_node: int, m: ModelConfig,
             rescue: bool) -> Iterator[tuple[str, ...]]:
    """Recipe overrides of every layout worth trying; ``rescue``: only offload and tiling."""
    powers = [1, 2, 4, 8, 16, 32, 64, 128]
    for t in (x for x in powers if x <= gpus_per_node and gpus_per_node % x == 0):
        for u, c, pp in ((u, c, pp) for u in powers if t * u <= gpus_per_node for c in powers
                         for pp in powers if pp <= m.n_layers and world % (t * u * c * pp) == 0):
                base = (f"parallel.tensor={t}", f"parallel.ulysses={u}", f"parallel.context={c}",
                        f"parallel.pipeline={pp}",
                        f"parallel.sequence_parallel={'true' if t > 1 else 'false'}")
                data = world // (t * u * c * pp)
                if pp > 1:
                    zeros = [("parallel.zero_stage=1", "parallel.hsdp=false")]
                else:
                    zeros = [(f"parallel.zero_stage={z}", "parallel.hsdp=false") for z in (1, 2, 3)]
                    if u == 1 and data * t * c > gpus_per_node:  # more than one node of data ranks
                        zeros.append(("parallel.zero_stage=3", "parallel.hsdp=true"))
                for zero in zeros:
                    for rc in ("none", "selective", "full"):
                        layout = (*base, *zero, f"model.activation_checkpointing={rc}")
                        if not rescue:
                            yield layout
                            continue
                        if pp == 1 and "parallel.hsdp=false" in zero:
                            yield (*layout, "parallel.offload_optimizer=cpu")
                        if zero[0] == "parallel.zero_stage=3":
                            for f in (2, 4, 8):
                                yield (*layout, f"parallel.tile_factor={f}")


def _with(cfg: Config, overrides: tuple[str, ...]) -> Config:
    sections: dict[str, dict] = {}
    for item in overrides:
        key, value = item.split("=", 1)
        section, field = key.split(".")
        parsed: object = {"true": True, "false": False}.get(value, value)
        if isinstance(parsed, str) and parsed.isdigit():
            parsed = int(parsed)
        sections.setdefault(section, {})[field] = parsed
    changes = {name: dataclasses.replace(getattr(cfg, name), **fields) for name, fields in sections.items()}
    return dataclasses.replace(cfg, **changes)


def suggest(cfg: Config, vocab: int | None, world: int, gpus_per_node: int, spec: DeviceSpec,
            mfu: float) -> list[Suggestion]:
    """Every layout of the recipe's model (``vocab``: the tokenizer's, where the recipe leaves
    ``model.vocab_size`` out) that fits ``world`` devices of ``spec``, fastest first."""
    found: list[Suggestion] = []
    model = resolve_model(cfg.model, vocab, cfg.data.seq_length, 1)
    for rescue in (False, True):
        for overrides in _layouts(world, gpus_per_node, model, rescue):
            variant = _with(cfg, overrides)
            if validate(variant):
                continue
            try:
                plan = estimate(variant, resolve_model(variant.model, vocab, variant.data.seq_length,
                                                       variant.parallel.tensor), world, gpus_per_node)
            except (TopologyError, ValueError):
                continue
            if plan.total > HEADROOM * spec.memory_gb * GB:
                continue
            seconds, parts = step_seconds(plan, variant, spec, gpus_per_node, mfu)
            found.append(Suggestion(overrides, plan, seconds, parts))
        if found:
            break
    return sorted(found, key=lambda x: x.seconds)
