"""Checks on a typed Config: allowed values and cross-field consistency.

Each check appends a message naming the key(s), the value(s) and what is allowed; the caller
reports all of them at once. Checks that need the world size live in ``ParallelDims``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from megatron_lite.config.deepspeed_block import deepspeed_block_problems
from megatron_lite.config.schema import Config


def _check_choices(obj: Any, prefix: str, problems: list[str]) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        path = f"{prefix}{f.name}"
        allowed = f.metadata.get("choices")
        if allowed is not None and value not in allowed:
            shown = ", ".join(repr(a) for a in allowed)
            problems.append(f"'{path}' = {value!r} is not allowed; choose one of {shown}")
        if isinstance(value, float) and not math.isfinite(value):  # inf passes every "> 0"
            problems.append(f"'{path}' = {value} must be a finite number")
        if dataclasses.is_dataclass(value):
            _check_choices(value, path + ".", problems)
        elif isinstance(value, (list, tuple)):  # data.blend's entries
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    _check_choices(item, f"{path}[{i}].", problems)


def split_shares(split: str) -> tuple[float, float, float]:
    """'969,30,1' -> normalised (train, valid, test) shares; a missing test share is 0."""
    parts = [p.strip() for p in split.replace("/", ",").split(",")]
    if not 1 <= len(parts) <= 3:
        raise ValueError("give up to three comma-separated shares: train,valid,test")
    values = [float(p) for p in parts] + [0.0] * (3 - len(parts))
    if any(v < 0 for v in values) or sum(values) <= 0:
        raise ValueError("shares must be non-negative and not all zero")
    total = sum(values)
    return values[0] / total, values[1] / total, values[2] / total


def validate(cfg: Config) -> list[str]:
    """All problems found in ``cfg`` (empty when it is consistent)."""
    problems: list[str] = []
    _check_choices(cfg, "", problems)
    m, d, t, o, s = cfg.model, cfg.data, cfg.training, cfg.optimizer, cfg.schedule

    def need(ok: bool, msg: str) -> None:
        if not ok:
            problems.append(msg)

    for key, value in [
        ("model.n_layers", m.n_layers), ("model.n_heads", m.n_heads), ("model.d_model", m.d_model),
        ("model.vocab_multiple", m.vocab_multiple), ("data.seq_length", d.seq_length),
        ("training.micro_batch_size", t.micro_batch_size),
        ("training.log_interval", t.log_interval), ("training.eval_iters", t.eval_iters),
        ("parallel.tensor", cfg.parallel.tensor), ("parallel.pipeline", cfg.parallel.pipeline),
        ("parallel.ulysses", cfg.parallel.ulysses), ("parallel.context", cfg.parallel.context),
    ]:
        need(value >= 1, f"'{key}' = {value} must be at least 1")
    for key, value in [("model.n_kv_heads", m.n_kv_heads), ("model.ffn_hidden", m.ffn_hidden),
                       ("model.vocab_size", m.vocab_size), ("model.max_seq_len", m.max_seq_len),
                       ("model.tokenizer_vocab_size", m.tokenizer_vocab_size),
                       ("data.tokenizer.vocab_size", d.tokenizer.vocab_size),
                       ("training.global_batch_size", t.global_batch_size)]:
        need(value is None or value >= 1, f"'{key}' = {value} must be at least 1 (or null)")
    if m.n_heads >= 1:
        need(m.d_model % m.n_heads == 0,
             f"'model.d_model' = {m.d_model} must be divisible by 'model.n_heads' = {m.n_heads}")
        kv = m.kv_heads
        need(kv >= 1 and m.n_heads % kv == 0,
             f"'model.n_heads' = {m.n_heads} must be divisible by 'model.n_kv_heads' = {kv}")
        if m.position == "rope" and m.d_model % m.n_heads == 0:
            need(m.head_dim % 2 == 0,
                 f"rope needs an even head size; 'model.d_model'/'model.n_heads' = "
                 f"{m.head_dim}")
    if m.max_seq_len is not None:
        need(m.max_seq_len >= d.seq_length,
             f"'model.max_seq_len' = {m.max_seq_len} is shorter than 'data.seq_length' = "
             f"{d.seq_length}")
    need(0.0 <= m.dropout < 1.0, f"'model.dropout' = {m.dropout} must be in [0, 1)")
    try:
        shares = split_shares(d.split)
        need(shares[0] > 0 and shares[1] > 0,
             f"'data.split' = {d.split!r} must give training and validation a share")
    except ValueError as e:
        problems.append(f"'data.split' = {d.split!r}: {e}")
    need(d.num_workers >= 0, f"'data.num_workers' = {d.num_workers} must be 0 or more")
    need((d.prefix is None) != (not d.blend),
         "give exactly one of 'data.prefix' (one dataset) and 'data.blend' (several)")
    for i, entry in enumerate(d.blend):
        need(bool(entry.prefix) and entry.weight > 0,
             f"'data.blend[{i}]' needs a prefix and a positive weight (got {entry})")
    need(not (d.blend and d.build_from), "'data.build_from' builds a single 'data.prefix', not a blend")
    need(d.tokenizer.model is not None,
         "'data.tokenizer.model' is required: the tokenizer file or directory")

    need((t.iters is None) != (t.train_tokens is None),
         "give exactly one of 'training.iters' and 'training.train_tokens' "
         f"(got iters={t.iters}, train_tokens={t.train_tokens})")
    for key, value in [("training.iters", t.iters), ("training.train_tokens", t.train_tokens)]:
        need(value is None or value >= 1, f"'{key}' = {value} must be at least 1")
    if t.global_batch_size is not None and t.micro_batch_size >= 1:
        need(t.global_batch_size % t.micro_batch_size == 0,
             f"'training.global_batch_size' = {t.global_batch_size} must be a multiple of "
             f"'training.micro_batch_size' = {t.micro_batch_size}")
    ramp = t.rampup_batch_size
    if ramp is not None:
        if len(ramp) != 3 or any(v < 1 for v in ramp):
            problems.append(f"'training.rampup_batch_size' = {list(ramp)} must be three positive integers: "
                            "[start, increment, samples]")
        elif t.global_batch_size is None or not (ramp[0] < t.global_batch_size
                                                  and (t.global_batch_size - ramp[0]) % ramp[1] == 0):
            problems.append(f"'training.rampup_batch_size' = {list(ramp)}: the start must be below "
                            f"'training.global_batch_size' = {t.global_batch_size} by a multiple of the "
                            "increment")
        elif t.micro_batch_size >= 1 and (ramp[0] % t.micro_batch_size or ramp[1] % t.micro_batch_size):
            # (Multiples of micro_batch_size × data-parallel size: checked with the layout.)
            problems.append(f"'training.rampup_batch_size' = {list(ramp)}: the start and the increment must "
                            f"be multiples of 'training.micro_batch_size' = {t.micro_batch_size}")
        need(t.iters is None, "'training.rampup_batch_size' needs sample-based training: give "
             "'training.train_tokens' instead of 'training.iters' (a ramp changes the samples per step)")
        need(cfg.parallel.pipeline == 1, "'training.rampup_batch_size' with 'parallel.pipeline' > 1 is "
             "not supported (DeepSpeed's pipeline engine fixes its micro-batches per step when built)")
    ev = cfg.eval
    if ev.harness_tasks:
        p = cfg.parallel
        split = [f"parallel.{k}={v}" for k, v in (("pipeline", p.pipeline), ("ulysses", p.ulysses),
                                                   ("context", p.context)) if v > 1]
        if p.sequence_parallel and p.tensor > 1:
            split.append("parallel.sequence_parallel=true")
        need(not split, f"'eval.harness_tasks' scores the whole model on every rank, which "
             f"{', '.join(split)} cut up; score a checkpoint with tools/evaluate.py instead")
    need(ev.harness_interval >= 0, f"'eval.harness_interval' = {ev.harness_interval} must be 0 or more")
    need(ev.harness_limit is None or ev.harness_limit >= 1,
         f"'eval.harness_limit' = {ev.harness_limit} must be at least 1 (or null)")
    need(ev.harness_batch_size >= 1,
         f"'eval.harness_batch_size' = {ev.harness_batch_size} must be at least 1")
    need(t.eval_interval >= 0, f"'training.eval_interval' = {t.eval_interval} must be 0 or more")
    for key, value, ok, allowed in [  # what torch and numpy would refuse later, or misuse silently
        ("model.init_std", m.init_std, m.init_std > 0, "positive"),
        ("optimizer.weight_decay", o.weight_decay, o.weight_decay >= 0, "0 or more"),
        ("optimizer.beta1", o.beta1, 0 <= o.beta1 < 1, "in [0, 1)"),
        ("optimizer.beta2", o.beta2, 0 <= o.beta2 < 1, "in [0, 1)"),
        ("optimizer.eps", o.eps, o.eps > 0, "positive (0 divides 0 by 0 for a zero gradient)"),
        ("data.seed", d.seed, d.seed >= 0, "0 or more"), ("training.seed", t.seed, t.seed >= 0, "0 or more"),
        ("training.sample_tokens", t.sample_tokens, t.sample_tokens >= 0, "0 (no sample) or more"),
        ("training.sample_temperature", t.sample_temperature, t.sample_temperature >= 0, "0 or more"),
        ("training.sample_top_k", t.sample_top_k, t.sample_top_k >= 0, "0 (all tokens) or more"),
        ("training.exit_duration_mins", t.exit_duration_mins,
         t.exit_duration_mins is None or t.exit_duration_mins > 0, "positive (minutes) or null"),
    ]:
        need(ok, f"'{key}' = {value} must be {allowed}")
    if t.kernels == "liger":
        need(cfg.parallel.tensor == 1 and cfg.parallel.pipeline == 1,
             f"'training.kernels' = 'liger' replaces the single-device output layer; with "
             f"'parallel.tensor' = {cfg.parallel.tensor} and 'parallel.pipeline' = "
             f"{cfg.parallel.pipeline} use 'torch'")

    need(o.lr > 0, f"'optimizer.lr' = {o.lr} must be positive")
    for key in ("timeout_minutes", "setup_timeout_minutes"):
        value = getattr(cfg.distributed, key)
        need(value > 0, f"'distributed.{key}' = {value} must be positive (minutes)")
    after = cfg.distributed.hang_dump_after
    need(after == 0 or 0.05 <= after <= 0.9,
         f"'distributed.hang_dump_after' = {after} must be 0 (off) or a fraction of the collective "
         "timeout from 0.05 to 0.9 (the dump must come before the timeout ends the run)")
    need(0 <= o.min_lr <= o.lr,
         f"'optimizer.min_lr' = {o.min_lr} must be between 0 and 'optimizer.lr' = {o.lr}")
    need(o.grad_clip >= 0, f"'optimizer.grad_clip' = {o.grad_clip} must be 0 (off) or positive")
    need(s.warmup_iters >= 0, f"'schedule.warmup_iters' = {s.warmup_iters} must be 0 or more")
    if s.decay_iters is not None:
        need(s.decay_iters >= s.warmup_iters,
             f"'schedule.decay_iters' = {s.decay_iters} is before the end of warm-up "
             f"('schedule.warmup_iters' = {s.warmup_iters})")
    if m.eod_id is not None:
        need(m.eod_id >= 0, f"'model.eod_id' = {m.eod_id} must be a token id (0 or more), or null for "
             "the tokenizer's end-of-document id")
    if m.rope_scaling != "none":
        need(m.position == "rope", f"'model.rope_scaling' = {m.rope_scaling} needs 'model.position' = rope "
             f"(it is {m.position})")
        need(m.rope_scaling_factor > 0 and 0 < m.rope_low_freq_factor < m.rope_high_freq_factor
             and m.rope_original_max_len > 0,
             f"'model.rope_scaling' = llama3 needs rope_scaling_factor > 0 ({m.rope_scaling_factor}), "
             f"0 < rope_low_freq_factor ({m.rope_low_freq_factor}) < rope_high_freq_factor "
             f"({m.rope_high_freq_factor}) and rope_original_max_len > 0 ({m.rope_original_max_len})")
    need(0 < s.decay_fraction <= 1,
         f"'schedule.decay_fraction' = {s.decay_fraction} must be in (0, 1] (the cooldown's share of "
         "the steps after warm-up; 0.1-0.2 is usual)")

    problems.extend(_parallel_problems(cfg))
    problems.extend(deepspeed_block_problems(cfg.deepspeed))
    problems.extend(_fp8_problems(cfg))
    for key in ("save_interval", "keep_last", "keep_every"):
        value = getattr(cfg.checkpoint, key)
        need(value >= 0, f"'checkpoint.{key}' = {value} must be 0 or more")
    problems.extend(_spike_problems(cfg))
    steps = list(cfg.profile.steps)
    need(not steps or (len(steps) == 2 and 1 <= steps[0] <= steps[1]),
         f"'profile.steps' = {steps} must be empty or [start, end] with 1 <= start <= end")
    ranks = list(cfg.profile.ranks)
    need(all(r >= 0 for r in ranks), f"'profile.ranks' = {ranks} must be ranks (0 or more)")
    need(cfg.training.throughput_warmup_steps >= 0,
         f"'training.throughput_warmup_steps' = {cfg.training.throughput_warmup_steps} must be 0 or more")
    m = cfg.monitor
    need(m.slowdown_factor == 0 or m.slowdown_factor > 1,
         f"'monitor.slowdown_factor' = {m.slowdown_factor} must be 0 (off) or above 1")
    need(m.straggler_factor > 1, f"'monitor.straggler_factor' = {m.straggler_factor} must be above 1")
    for key in ("window", "min_history"):
        need(getattr(m, key) >= 1, f"'monitor.{key}' = {getattr(m, key)} must be 1 or more")
    need(m.min_history <= m.window,
         f"'monitor.min_history' = {m.min_history} must not exceed 'monitor.window' = {m.window}")
    need(m.straggler_interval >= 0,
         f"'monitor.straggler_interval' = {m.straggler_interval} must be 0 (off) or more")
    need(m.min_excess >= 0, f"'monitor.min_excess' = {m.min_excess} must be 0 or more")
    return problems


def _spike_problems(cfg: Config) -> list[str]:
    sp, problems = cfg.spikes, []
    for key in ("window", "max_consecutive_nonfinite"):
        if getattr(sp, key) < 1:
            problems.append(f"'spikes.{key}' = {getattr(sp, key)} must be at least 1")
    for key in ("warmup_steps", "loss_z", "loss_ratio", "grad_norm_z", "grad_norm_ratio"):
        if getattr(sp, key) < 0:
            problems.append(f"'spikes.{key}' = {getattr(sp, key)} must be 0 or more")
    rb = sp.rollback
    for key in ("min_steps_back", "skip_batches", "max_rollbacks"):
        if getattr(rb, key) < 0:
            problems.append(f"'spikes.rollback.{key}' = {getattr(rb, key)} must be 0 or more")
    if "rollback" in (sp.policy, sp.nonfinite_policy) and not cfg.checkpoint.dir:
        key = "spikes.policy" if sp.policy == "rollback" else "spikes.nonfinite_policy"
        problems.append(f"'{key}' = 'rollback' reloads checkpoints: set 'checkpoint.dir' (and "
                        "'checkpoint.save_interval') or choose 'skip_step'")
    return problems


def _fp8_problems(cfg: Config) -> list[str]:
    """What ``model.fp8`` needs: float8 products take sizes in multiples of 16 (every block linear's
    rows and columns, and the tokens of a micro-batch, the inner size of the weight gradient's
    product), and it converts plain linear layers only (not tensor-parallel or tiled ones)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    if not m.fp8 or m.n_heads < 1 or m.d_model % m.n_heads or m.kv_heads < 1:
        return []
    out = []
    if p.tensor > 1 or p.tile_factor > 1:
        out.append(f"'model.fp8' = true converts plain linear layers; with 'parallel.tensor' = {p.tensor} "
                   f"and 'parallel.tile_factor' = {p.tile_factor} set both to 1 or 'model.fp8' to false")
    odd = [f"{name} {rows} x {cols}" for name, (rows, cols) in _block_linear_shapes(m, 1).items()
           if rows % 16 or cols % 16]
    if odd:
        out.append(f"'model.fp8' = true needs block linear sizes in multiples of 16, but "
                   f"{', '.join(odd)} (from 'model.d_model' = {m.d_model}, 'model.n_heads' = {m.n_heads}, "
                   f"'model.n_kv_heads' = {m.n_kv_heads}, 'model.ffn_hidden' = {m.ffn_hidden})")
    tokens = t.micro_batch_size * cfg.data.seq_length
    if tokens % 16:
        out.append(f"'model.fp8' = true needs 'training.micro_batch_size' × 'data.seq_length' "
                   f"({t.micro_batch_size} × {cfg.data.seq_length} = {tokens}) to be a multiple of 16")
    return out


def _block_linear_shapes(m, tensor: int) -> dict[str, tuple[int, int]]:
    """(rows, columns) of each block linear's weight on one tensor-parallel rank."""
    q, kv, ffn = m.n_heads * m.head_dim // tensor, m.kv_heads * m.head_dim // tensor, m.mlp_hidden // tensor
    up = ("gate_up_proj", 2 * ffn) if m.activation == "swiglu" else ("up_proj", ffn)
    return {"qkv_proj": (q + 2 * kv, m.d_model), "o_proj": (m.d_model, q), up[0]: (up[1], m.d_model),
            "down_proj": (m.d_model, ffn)}


def _parallel_problems(cfg: Config) -> list[str]:
    """Layouts that cannot work whatever the world size (those that depend on it are checked by
    ``ParallelDims.plan``)."""
    p, m, d = cfg.parallel, cfg.model, cfg.data
    out: list[str] = []
    if min(p.tensor, p.pipeline, p.ulysses, p.context, m.n_heads, m.n_layers) < 1:
        return out  # reported above
    kv = m.kv_heads
    # Ulysses splits each tensor rank's heads again; the sequence is split by Ulysses, then by
    # the tensor ranks under Megatron sequence parallelism.
    heads = [("'parallel.tensor'", p.tensor), ("'parallel.ulysses'", p.ulysses)]
    if p.tensor > 1 and p.ulysses > 1:
        heads = [("'parallel.tensor' × 'parallel.ulysses'", p.tensor * p.ulysses)]
    for key, size in heads:
        if m.n_heads % size or kv % size:
            out.append(f"'model.n_heads' = {m.n_heads} and 'model.n_kv_heads' = {kv} must both be "
                       f"divisible by {key} = {size} (each rank takes whole heads)")
    slices = [("'parallel.ulysses'", p.ulysses)]
    if p.sequence_parallel:
        slices = [("'parallel.tensor' × 'parallel.ulysses'", p.tensor * p.ulysses)]
    if p.context > 1:
        # Two chunks per context rank, each cut again as above.
        size = 2 * p.context * p.ulysses * (p.tensor if p.sequence_parallel else 1)
        key = "2 × 'parallel.context'" + " × 'parallel.ulysses'" * (p.ulysses > 1) \
            + " × 'parallel.tensor'" * p.sequence_parallel
        slices = [(key, size)]
    for key, size in slices:
        if size > 1 and d.seq_length % size:
            out.append(f"'data.seq_length' = {d.seq_length} must be divisible by {key} = {size} "
                       "(each rank takes an equal slice of the sequence)")
    if p.context > 1 and m.dropout > 0:
        out.append(f"'model.dropout' = {m.dropout} with 'parallel.context' = {p.context}: ring "
                   "attention has no attention dropout; set model.dropout=0")
    if m.n_layers < p.pipeline:
        out.append(f"'parallel.pipeline' = {p.pipeline} stages need at least as many layers; "
                   f"'model.n_layers' = {m.n_layers}")
    if p.sequence_parallel and p.tensor == 1:
        out.append("'parallel.sequence_parallel' = true splits the sequence over the tensor-parallel "
                   "ranks and needs 'parallel.tensor' > 1 (for sequence parallelism without tensor "
                   "parallelism use 'parallel.ulysses')")
    if p.pipeline > 1 and p.zero_stage > 1:
        out.append(f"'parallel.zero_stage' = {p.zero_stage} with 'parallel.pipeline' = {p.pipeline}: "
                   "DeepSpeed's pipeline engine supports ZeRO stages 0 and 1 only; set "
                   "parallel.zero_stage=1")
    if p.hsdp and p.ulysses > 1:
        out.append(f"'parallel.hsdp' = true with 'parallel.ulysses' = {p.ulysses}: not in this "
                   "version (HSDP's shard and replica groups are cut from the data-parallel ranks, "
                   "and a Ulysses group shares one ZeRO partition with its data ranks); use "
                   "parallel.zero_stage=3 without HSDP, or Megatron sequence parallelism with "
                   "parallel.tensor")
    if p.hsdp and p.zero_stage in (1, 2):
        out.append(f"'parallel.hsdp' = true is ZeRO-3 within each shard group, but "
                   f"'parallel.zero_stage' = {p.zero_stage}; set parallel.zero_stage=3 (or 0)")
    if p.hsdp and p.pipeline > 1:
        out.append("'parallel.hsdp' = true needs ZeRO-3, which DeepSpeed's pipeline engine does not "
                   "support; use parallel.zero_stage=1 with pipeline parallelism")
    stage = p.deepspeed_zero_stage
    if p.offload_optimizer != "none" and stage == 0:
        out.append(f"'parallel.offload_optimizer' = {p.offload_optimizer} offloads ZeRO's optimizer "
                   "partitions and needs 'parallel.zero_stage' 1, 2 or 3")
    if "nvme" in (p.offload_optimizer, p.offload_params) and stage != 3:
        out.append(f"NVMe offload needs ZeRO-3 (DeepSpeed's ZeRO-Infinity); 'parallel.zero_stage' = "
                   f"{p.zero_stage}: set parallel.zero_stage=3")
    if p.offload_params != "none" and stage != 3:
        out.append(f"'parallel.offload_params' = {p.offload_params} needs ZeRO-3, which alone shards "
                   f"the parameters; 'parallel.zero_stage' = {p.zero_stage}")
    if "nvme" in (p.offload_optimizer, p.offload_params) and not p.nvme_path:
        out.append("NVMe offload needs 'parallel.nvme_path' (a directory on a node-local disk)")
    if (p.offload_optimizer != "none" or p.offload_params != "none") and p.pipeline > 1:
        out.append("offload with 'parallel.pipeline' > 1 is not supported in this version; "
                   "use parallel.pipeline=1 with ZeRO and offload, or no offload")
    if p.offload_optimizer != "none" and p.hsdp:
        out.append("'parallel.offload_optimizer' with 'parallel.hsdp': not in this version (HSDP "
                   "averages the gradient shards on the device, where offload no longer keeps them)")
    if p.tile_factor < 1:
        out.append(f"'parallel.tile_factor' = {p.tile_factor} must be at least 1 (1: no tiling)")
    elif p.tile_factor > 1:
        if stage != 3:
            out.append(f"'parallel.tile_factor' = {p.tile_factor} saves memory only under ZeRO-3, "
                       f"which gathers one tile at a time; 'parallel.zero_stage' = {p.zero_stage}: "
                       "set parallel.zero_stage=3 (or parallel.tile_factor=1)")
        out += [f"'parallel.tile_factor' = {p.tile_factor} must divide both dimensions of every "
                f"block linear, but {name} is {rows} x {cols} on each tensor rank (tiles are equal)"
                for name, (rows, cols) in _block_linear_shapes(m, p.tensor).items()
                if rows % p.tile_factor or cols % p.tile_factor]
    if p.hsdp_shard_size is not None and p.hsdp_shard_size < 1:
        out.append(f"'parallel.hsdp_shard_size' = {p.hsdp_shard_size} must be at least 1 (or null: "
                   "the ranks of one node)")
    return out
