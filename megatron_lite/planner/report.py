"""The ``--plan`` printout."""

from __future__ import annotations

from megatron_lite.config.schema import Config
from megatron_lite.distributed.device import DEVICES, device_spec
from megatron_lite.model import resolve_model
from megatron_lite.planner.estimate import GB, estimate, fits, host_per_node, step_time

ASSUMED_VOCAB = 32000


def _vocab(cfg: Config) -> tuple[int | None, str | None]:
    """The tokenizer's vocabulary when the recipe leaves ``model.vocab_size`` null (from the disk
    or the recipe, never the network)."""
    if cfg.model.vocab_size is not None:
        return None, None
    from megatron_lite.data.tokenizers import vocab_size_offline

    tok = cfg.data.tokenizer
    assert tok.model is not None
    try:
        return vocab_size_offline(tok.type, tok.model, tok.vocab_size), None
    except (OSError, ValueError):  # FileNotFoundError too; or a tokenizer on disk that is broken
        if tok.vocab_size is not None:
            return tok.vocab_size, None
        return ASSUMED_VOCAB, (f"the tokenizer '{tok.model}' does not exist yet: assumed a vocabulary "
                               f"of {ASSUMED_VOCAB:,} (set data.tokenizer.vocab_size for exact numbers)")


def plan_report(cfg: Config, world_size: int, gpus_per_node: int, device: str,
                mfu: float, host_memory_gb: float | None = None) -> tuple[list[str], bool]:
    """Lines to print and whether the run fits in the device's memory (and, with offload, in the
    node's host memory: ``host_memory_gb``, default the device table's typical node)."""
    spec = device_spec(device)
    if spec is None:
        raise ValueError(f"unknown device '{device}'; choose one of {', '.join(DEVICES)}")
    vocab, note = _vocab(cfg)
    model = resolve_model(cfg.model, vocab, cfg.data.seq_length, cfg.parallel.tensor)
    plan = estimate(cfg, model, world_size, gpus_per_node)
    d, t = plan.dims, cfg.training
    nodes = -(-world_size // gpus_per_node)
    recompute = model.activation_checkpointing
    lines = [
        f"plan for {world_size} × {device} ({nodes} node(s) × {gpus_per_node}), {t.precision}, "
        f"{spec.memory_gb:g} GB and {(spec.fp32 if t.precision == 'fp32' else spec.bf16) / 1e12:g} "
        "TFLOP/s peak each",
        f"layout: tensor {d.tensor}{' + sequence parallel' if d.sequence_parallel else ''} × pipeline "
        f"{d.pipeline} × ulysses {d.ulysses}{f' × context {d.context}' if d.context > 1 else ''} × data "
        f"{d.data}, ZeRO-{cfg.parallel.deepspeed_zero_stage}"
        + (f" (HSDP: shard groups of {d.hsdp_shard_size} × {d.hsdp_replicas} replicas)"
           if d.hsdp_shard_size else ""),
        f"batch: micro {t.micro_batch_size} × accumulation {plan.grad_accumulation} × data {d.data} = "
        f"{d.global_batch(cfg)} sequences of {cfg.data.seq_length} tokens ({plan.tokens_per_step:,} "
        "tokens per step)",
        f"parameters: {plan.counts.total:,} total; {plan.stage_parameters:,} on one rank of the largest "
        f"pipeline stage ({plan.stage_blocks} of {model.n_layers} blocks)",
        "",
        "memory per device (GB = 10^9 bytes)",
    ]
    tiles = f" (tiles of 1/{cfg.parallel.tile_factor ** 2})" if cfg.parallel.tile_factor > 1 else ""
    rows = [("weights", plan.weights, ""), ("gradients", plan.grads, ""),
            ("optimizer (master + Adam)", plan.optimizer, "")]
    others = "; ".join(f"recompute {rc}: {v / GB:.2f}" for rc, v in plan.activations_if.items()
                       if rc != recompute)
    rows += [(f"activations (recompute {recompute})", plan.activations,
              f"{plan.in_flight} micro-batch(es) in flight; {others}"),
             ("output layer and loss", plan.output_layer, "one micro-batch, at the loss"),
             *([("gathered by ZeRO-3", plan.gathered,
                 "the largest parameter whole, with its gradient" + tiles)]
               if plan.gathered else []),
             ("total", plan.total, f"of {spec.memory_gb:g}")]
    lines += [f"  {label:<34} {value / GB:8.2f}   {extra}".rstrip() for label, value, extra in rows]
    host_gb = host_memory_gb or spec.host_memory_gb
    node_host = host_per_node(plan, gpus_per_node)
    if plan.host or plan.nvme:
        lines += ["", "offloaded (ZeRO-Offload), per device and per node"]
        if plan.host:
            lines.append(f"  {'host memory':<34} {plan.host / GB:8.2f}   {node_host / GB:.2f} per node "
                         f"of {host_gb:g}")
        if plan.nvme:
            lines.append(f"  {'NVMe files':<34} {plan.nvme / GB:8.2f}   "
                         f"{plan.nvme * min(gpus_per_node, world_size) / GB:.2f} per node")
    lines.append("")
    seconds, tokens = step_time(plan, spec, t.precision, mfu)
    lines += [
        f"compute: {plan.flops_per_token / 1e9:.3f} GFLOPs per token (6N + attention; recompute not "
        "counted)",
        f"at {100 * mfu:.0f}% MFU: {seconds:.3g} s per step, {tokens:,.0f} tokens/s "
        f"({tokens / world_size:,.0f} per device)",
    ]
    ok = fits(plan, spec)
    warnings = [note] if note else []
    if node_host > 0.9 * host_gb * GB:
        warnings.append(f"does NOT fit the host: {node_host / GB:.1f} GB of offloaded state per node, "
                        f"{host_gb:g} GB of host memory (and the OS, data loaders and pinned buffers "
                        "need their share); offload to nvme, use more nodes, or --host-memory-gb")
    host_ok = node_host <= 0.9 * host_gb * GB
    if not ok:
        warnings.append(f"does NOT fit: {plan.total / GB:.1f} GB needed per device, {spec.memory_gb:g} GB "
                        "available; raise parallel.zero_stage / tensor / pipeline, turn on "
                        "model.activation_checkpointing, lower training.micro_batch_size, offload "
                        "(parallel.offload_optimizer / offload_params) or, for one layer larger "
                        "than the device, tile it (parallel.tile_factor)")
    elif plan.total > 0.85 * spec.memory_gb * GB:
        warnings.append(f"tight: {plan.total / GB:.1f} of {spec.memory_gb:g} GB; framework buffers and "
                        "fragmentation usually need 10-20% more")
    if warnings:
        lines += [""] + [f"warning: {w}" for w in warnings]
    return lines, ok and host_ok


def suggest_report(cfg: Config, world_size: int, gpus_per_node: int, device: str, mfu: float,
                   top: int = 10, recipe: str = "RECIPE") -> tuple[list[str], bool]:
    """``--plan --suggest``: the fastest layouts that fit (``planner/suggest.py``), as lines."""
    from megatron_lite.planner.suggest import HEADROOM, suggest

    spec = device_spec(device)
    if spec is None:
        raise ValueError(f"unknown device '{device}'; choose one of {', '.join(DEVICES)}")
    vocab, note = _vocab(cfg)
    found = suggest(cfg, vocab, world_size, gpus_per_node, spec, mfu)
    nodes = -(-world_size // gpus_per_node)
    lines = [f"layouts for {world_size} × {device} ({nodes} node(s) × {gpus_per_node}) that fit in "
             f"{100 * HEADROOM:.0f}% of {spec.memory_gb:g} GB, fastest first (predicted at {100 * mfu:.0f}% "
             "MFU plus communication at the device table's bandwidths: a ranking, not a promise)"]
    if note:
        lines.append(f"note: {note}")
    if not found:
        lines.append("none fits: more devices, a device with more memory, a shorter "
                     "data.seq_length or a smaller training.micro_batch_size")
        return lines, False
    fastest = found[0].seconds
    lines.append(f"  {'#':>2} {'s/step':>8} {'vs best':>7} {'GB':>6}  layout; largest costs")
    for i, s in enumerate(found[:top], 1):
        keys = " ".join(o for o in s.overrides if not o.endswith(("=1", "=false")) or "zero_stage" in o)
        costs = ", ".join(f"{k} {v:.3g}" for k, v in sorted(s.parts.items(), key=lambda kv: -kv[1])[:3])
        lines.append(f"  {i:>2} {s.seconds:8.3g} {s.seconds / fastest:7.2f} {s.plan.total / GB:6.1f}  "
                     f"{keys}; {costs}")
    lines.append(f"({len(found)} layouts fit; run the first with: python pretrain.py {recipe} "
                 f"{' '.join(found[0].overrides)})")
    return lines, True
