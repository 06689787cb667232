"""One run, start to end: the path ``pretrain.py`` takes after the config is loaded."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_lite.checkpoint import Checkpointer
from megatron_lite.checkpoint.init_from import InitialWeights, load_initial_weights, own_checkpoint
from megatron_lite.config import Config, to_yaml
from megatron_lite.config.schema import ModelConfig
from megatron_lite.data.batch_plan import batch_plan, planned_steps
from megatron_lite.data.build import ensure_dataset
from megatron_lite.data.source import build_data
from megatron_lite.data.tokenizers import vocab_size_offline
from megatron_lite.distributed import detect, init_distributed
from megatron_lite.distributed.collectives import on_every_rank, on_one_rank_then_all, watch_exchange
from megatron_lite.distributed.hang import HangWatch, set_aside
from megatron_lite.distributed.launcher_env import LaunchEnv
from megatron_lite.distributed.startup import abandon_distributed, shutdown_distributed
from megatron_lite.engine.config import deepspeed_config
from megatron_lite.engine.versions import limitations as deepspeed_limitations
from megatron_lite.logging import MetricsLogger
from megatron_lite.logging.console import emit_line
from megatron_lite.model import (
    VocabularyError,
    build_model,
    count_parameters,
    flops_per_token,
    padding_note,
    padding_parameters,
    resolve_model,
)
from megatron_lite.training.build import build, refuse_what_this_machine_cannot_run
from megatron_lite.training.saving import UnsavedEnd
from megatron_lite.training.trainer import RunResult, Trainer

FINISHED_FILE = "finished.json"
"""Written under ``logging.dir`` when a run has trained all its steps (removed when one starts)."""


def train_samples(cfg: Config, iters: int, global_batch: int) -> int:
    """Training samples to plan the data indices for: the steps' batches, plus, when spikes
    may roll back, room for the skipped windows (each at most the distance back to a checkpoint
    plus ``skip_batches``; the checkpoint is assumed at most ``save_interval`` back)."""
    sp = cfg.spikes
    batches = iters
    if "rollback" in (sp.policy, sp.nonfinite_policy):
        back = max(cfg.checkpoint.save_interval or iters, sp.rollback.min_steps_back) + 1
        batches += sp.rollback.max_rollbacks * (back + sp.rollback.skip_batches)
    return batches * global_batch


def describe_model(cfg: Config) -> tuple[ModelConfig, int, float]:
    """Resolved model config, parameter count and training FLOPs per token, from the meta device.

    The vocabulary comes from ``model.vocab_size`` or, when that is null, from the tokenizer on
    disk or the recipe's ``data.tokenizer.vocab_size``, never from the network
    (``vocab_size_offline``).
    """
    vocab = None
    if cfg.model.vocab_size is None:
        tok = cfg.data.tokenizer
        assert tok.model is not None
        vocab = vocab_size_offline(tok.type, tok.model, tok.vocab_size)
    model_cfg = resolve_model(cfg.model, vocab, cfg.data.seq_length, cfg.parallel.tensor)
    params = count_parameters(build_model(model_cfg, "meta"))
    return model_cfg, params, flops_per_token(model_cfg, cfg.data.seq_length)


def _check_tasks(cfg: Config) -> None:
    from megatron_lite.evaluation import harness

    try:
        harness.require_lm_eval()
    except ImportError as e:
        raise ValueError(f"eval.harness_tasks: {e}") from None
    harness.resolve_tasks(list(cfg.eval.harness_tasks), cfg.eval.harness_include_path)


def _initial_weights(cfg: Config, model_cfg: ModelConfig, dims, log) -> InitialWeights | None:
    """The weights of ``checkpoint.init_from``, None without it or when the run resumes from
    its own checkpoint instead (rank 0 decides, so every rank builds the same way)."""
    if cfg.checkpoint.init_from is None:
        return None
    own = on_one_rank_then_all(lambda: own_checkpoint(cfg.checkpoint.dir, cfg.checkpoint.resume), dims,
                               f"looking for a checkpoint in {cfg.checkpoint.dir}", share=True)
    if own is not None:
        log(f"checkpoint.init_from={cfg.checkpoint.init_from} is ignored: the run resumes from its "
            f"own checkpoint {own}")
        return None
    return on_every_rank(lambda: load_initial_weights(cfg.checkpoint.init_from, model_cfg,
                                                      log),
                         dims, f"reading checkpoint.init_from={cfg.checkpoint.init_from}")


def run(cfg: Config, env: LaunchEnv | None = None,
        on_record: Callable[[dict[str, Any]], None] | None = None) -> RunResult:
    """Train ``cfg`` in the launch environment ``env`` (default: detected from the launcher's
    variables). ``on_record`` receives every training record, on every rank (a launcher's own
    metrics channel, such as Ray's)."""
    dims, acc = init_distributed(cfg, env or detect())
    watch = None
    if cfg.distributed.hang_dump_after > 0 and dims.group("watch") is not None:
        if dims.rank == 0:  # before any watcher runs
            try:
                set_aside(Path(cfg.logging.dir) / "hang")
            except OSError as e:
                emit_line(f"warning: could not move the earlier hang reports aside: {e}")
        group = dims.group("watch")
        watch = HangWatch(Path(cfg.logging.dir) / "hang", dims.rank,
                          lambda flags: watch_exchange(flags, group), cfg.distributed.hang_dump_after,
                          nccl=acc.device_name() == "cuda").start()
    try:
        try:
            result = _run_on_groups(cfg, dims, acc, on_record)
        finally:
            if watch is not None:
                watch.stop()
    except BaseException:
        abandon_distributed()
        raise
    shutdown_distributed(dims)
    return result


def _run_on_groups(cfg: Config, dims, acc, on_record) -> RunResult:
    def log(msg: str) -> None:
        if cfg.logging.all_ranks:
            for line in msg.split("\n"):
                emit_line(f"[rank {dims.rank}] {line}")
        elif dims.is_main:
            emit_line(msg)

    ds_config = deepspeed_config(cfg, dims)  # a contradicting deepspeed: block fails before any work
    refuse_what_this_machine_cannot_run(cfg, dims, acc)  # and what this machine cannot run
    if cfg.eval.harness_tasks:  # lm_eval and the tasks, before any work
        on_every_rank(lambda: _check_tasks(cfg), dims, "checking eval.harness_tasks")
    on_one_rank_then_all(lambda: ensure_dataset(cfg.data, log=log), dims, "the dataset build",
                         long_wait=True)
    iters, _ = planned_steps(cfg, batch_plan(cfg.training, dims.global_batch(cfg)))
    samples = (train_samples(cfg, iters, dims.global_batch(cfg)),
               cfg.training.eval_iters * dims.global_batch(cfg))
    # One rank builds (and caches) the sample indices (one per node for node-local caches),
    # then every rank maps them.
    on_one_rank_then_all(lambda: build_data(cfg.data, *samples), dims, "the sample index build",
                         per_node=not cfg.data.cache_shared, long_wait=True)
    data = on_every_rank(lambda: build_data(cfg.data, *samples, pin_memory=acc.device_name() == "cuda",
                                            build=False), dims, "opening the dataset")
    model_cfg = resolve_model(cfg.model, data.tokenizer.vocab_size, cfg.data.seq_length, dims.tensor,
                              data.tokenizer.eod_id)
    if model_cfg.tokenizer_vocab_size < data.tokenizer.vocab_size:
        raise VocabularyError(f"model.tokenizer_vocab_size={model_cfg.tokenizer_vocab_size} is smaller than "
                              f"the tokenizer's {data.tokenizer.vocab_size}; leave it null")
    expected = cfg.data.tokenizer.vocab_size
    if expected is not None and expected != data.tokenizer.vocab_size:
        log(f"warning: data.tokenizer.vocab_size={expected}, but the tokenizer has "
            f"{data.tokenizer.vocab_size} ids: the run uses {data.tokenizer.vocab_size}")
    initial = _initial_weights(cfg, model_cfg, dims, log)
    parts = build(cfg, dims, acc, data.tokenizer.vocab_size, iters, data.tokenizer.eod_id,
                  initial.value if initial is not None else None, checked=True)
    del initial  # the host copy of the source's weights, no longer needed
    for note in parts.notes:
        log(note)
    for limitation in deepspeed_limitations(cfg.training.precision, cfg.parallel.deepspeed_zero_stage):
        log(f"warning: {limitation}")

    run_dir = Path(cfg.logging.dir)
    fpt = parts.flops_per_token
    runtime = {
        "world_size": dims.world_size, "data_parallel": dims.data, "tensor_parallel": dims.tensor,
        "pipeline_parallel": dims.pipeline, "ulysses": dims.ulysses,
        "context_parallel": dims.context,
        "sequence_parallel": dims.sequence_parallel, "hsdp_shard_size": dims.hsdp_shard_size,
        "global_batch_size": dims.global_batch(cfg),
        "grad_accumulation": dims.grad_accumulation(cfg), "iters": iters,
        "vocab_size": model_cfg.vocab_size, "tokenizer_vocab_size": data.tokenizer.vocab_size,
        "parameters": count_parameters(build_model(model_cfg, "meta")), "flops_per_token": fpt,
        "device": acc.device_name(), "deepspeed_config": ds_config,
    }

    def write_run_files() -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / FINISHED_FILE).unlink(missing_ok=True)  # this run is not (an extended one)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        (run_dir / "runtime.json").write_text(json.dumps(runtime, indent=2))

    # Rank 0's file work fails on every rank (a run directory that cannot be written), never on
    # rank 0 alone while the others go on into the next collective.
    on_one_rank_then_all(write_run_files, dims, f"writing {run_dir}/config.yaml and runtime.json")
    padding = padding_parameters(model_cfg, cfg.model.vocab_size)
    counted = f"{runtime['parameters'] - padding:,} parameters{padding_note(padding)}"
    log(f"model: {counted}, {fpt / 1e9:.3f} GFLOPs/token | "
        f"world {dims.world_size} (dp {dims.data}, tp {dims.tensor}, pp {dims.pipeline}, "
        f"ulysses {dims.ulysses}{f', context {dims.context}' if dims.context > 1 else ''}) | "
        f"global batch {runtime['global_batch_size']} "
        f"(micro {cfg.training.micro_batch_size} × accum {runtime['grad_accumulation']}) | "
        f"{iters} iters | device {acc.device_name()}")

    logger = on_every_rank(lambda: MetricsLogger(cfg, run_dir, dims.is_main, json.loads(json.dumps(runtime))),
                           dims, "opening the metrics sinks (metrics.jsonl, TensorBoard, W&B)")
    try:
        checkpointer = (Checkpointer(cfg, dims, acc, parts.engine, model_cfg, log) if cfg.checkpoint.dir
                        else None)
        trainer = Trainer(cfg, dims, parts, data, logger, log, checkpointer, on_record)
        trainer.maybe_resume()
        result = trainer.train()
    finally:
        logger.close()
    if result.stopped is not None and checkpointer is None:
        # Stopping early is the hand-over to the next job (Megatron's exit-duration): without a
        # checkpoint there is nothing to hand over, and the run did not finish as asked.
        raise UnsavedEnd(f"stopped at step {result.steps} of {iters} ({result.stopped}) with nothing "
                         "saved: checkpoint.dir is null, so no later job can continue this run; set "
                         "checkpoint.dir, or drop training.exit_duration_mins to train to the end")
    if result.final_val_loss is not None and result.stopped is None:
        log(f"final validation loss {result.final_val_loss:.4f} after {result.steps} steps")
    if result.stopped is None:
        # What a chained job looks for (launch/pbs_common.sh): the run needs no further job.
        done = json.dumps({"steps": result.steps, "iters": iters}) + "\n"
        on_one_rank_then_all(lambda: (run_dir / FINISHED_FILE).write_text(done), dims,
                             f"writing {run_dir}/{FINISHED_FILE}")
    return result
