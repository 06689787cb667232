"""One rank's training components from the config: model, kernels, compilation, DeepSpeed engine,
and what builds the step runner.

The one assembly used by a run (``run.py``), the benchmarks (``bench/``) and the distributed
tests, so that what is measured and tested is what a run trains with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_lite.config.schema import Config, ModelConfig
from megatron_lite.data.batch_plan import BatchPlan, batch_plan, planned_steps
from megatron_lite.distributed import device as devmod
from megatron_lite.distributed.collectives import on_every_rank
from megatron_lite.distributed.parallel_dims import ParallelDims
from megatron_lite.engine.initialize import build_engine, partitioned_init
from megatron_lite.engine.versions import pipeline_problem
from megatron_lite.model import flops_per_token, require_document_end, resolve_model
from megatron_lite.model.float8 import convert_blocks_to_float8, float8_library_problem
from megatron_lite.parallel import build_parallel_model
from megatron_lite.parallel.apply import (
    InitialValue,
    compile_blocks,
    loss_kernel_problem,
    use_device_kernels,
    use_loss_kernel,
    use_loss_mask,
)
from megatron_lite.parallel.random import rank_seed
from megatron_lite.training.step import StepRunner, UpdateGate
from megatron_lite.training.timing import NoClock


@dataclass
class Components:
    """What one rank trains with."""

    acc: Any
    """DeepSpeed's accelerator of this rank's device."""
    model_cfg: ModelConfig
    """The resolved model: the vocabulary padded for the tensor-parallel size."""
    engine: Any
    """The DeepSpeed engine; ``engine.module`` is this rank's part of the model."""
    iters: int
    """The optimizer steps the learning-rate schedule is planned for."""
    flops_per_token: float
    """Training FLOPs per token of the whole model (for MFU)."""
    plan: BatchPlan
    """The global batch of each step (``training.rampup_batch_size``)."""
    notes: list[str] = field(default_factory=list)
    """What the build chose that belongs in the log: fused kernels, compilation."""
    runner_args: tuple = field(default=(), repr=False)
    """What ``step_runner`` builds with: the config, the dims, the gradient accumulation steps,
    the device's graph break and clipping kernel."""

    def step_runner(self, gate: UpdateGate | None = None, clock: NoClock | None = None) -> StepRunner:
        """One optimizer step / evaluation batch for the layout, with its collaborators (see
        ``StepRunner``): the trainer's runner has a gate; a benchmark's or a test's need none."""
        cfg, dims, grad_accum, graph_break, clip_kernel = self.runner_args
        m = self.model_cfg
        return StepRunner(cfg, dims, self.engine, grad_accum, graph_break, clip_kernel, self.acc,
                          gate=gate, clock=clock,
                          document_end=m.eod_id if m.attention_mask == "document" else None,
                          loss_mask_end=m.eod_id if cfg.data.eod_mask_loss else None)

    @property
    def device(self) -> torch.device:
        return torch.device(self.acc.current_device_name())


def unfused_wrapper_note(cfg: Config, device_type: str) -> str | None:
    """A note when DeepSpeed will wrap the optimizer in its unfused fp16/bf16 wrapper (its choice
    for fp16 at ZeRO stage 0, and for bf16 there outside pipelining): that wrapper checks every
    parameter's gradient for overflow with a read to the host, one wait for the device per
    parameter per step (docs/benchmarks.md). None on the CPU, where the host is the device."""
    precision, pipelined = cfg.training.precision, cfg.parallel.pipeline > 1
    if (device_type == "cpu" or cfg.parallel.deepspeed_zero_stage != 0 or precision == "fp32"
            or (precision == "bf16" and pipelined)):
        return None
    return (f"note: {precision} at parallel.zero_stage=0 goes through DeepSpeed's unfused "
            "mixed-precision wrapper, which reads every parameter's gradient to the host each step "
            "(a small model's step can take twice as long); parallel.zero_stage=1 avoids it and, "
            "at data parallel 1, holds the same memory")


def refuse_what_this_machine_cannot_run(cfg: Config, dims: ParallelDims, acc) -> None:
    """Collective: raise ``DeviceError`` on every rank if any rank's machine (its device, its
    libraries, its DeepSpeed release) cannot run the recipe's features (nodes may differ)."""
    def check() -> None:
        p = cfg.parallel
        for problem in (devmod.float8_problem(acc) if cfg.model.fp8 else None,
                        float8_library_problem() if cfg.model.fp8 else None,
                        loss_kernel_problem(cfg.training.kernels, acc.device_name()),
                        devmod.nvme_problem(acc, p.offload_optimizer, p.offload_params),
                        pipeline_problem(p.pipeline)):
            if problem:
                raise devmod.DeviceError(problem)

    on_every_rank(check, dims, "checking the machine for the recipe's features")


def build(cfg: Config, dims: ParallelDims, acc, vocab: int | None, iters: int,
          eod: int | None = None, initial: InitialValue | None = None, checked: bool = False) -> Components:
    """Build this rank's part of the model for ``vocab`` token ids (None: ``model.vocab_size``)
    and the tokenizer's end-of-document id ``eod`` (None: ``model.eod_id``), from the weights
    ``initial`` gives by name (None: the seeded initial values), put the device's and the
    recipe's kernels into it, compile it when asked and wrap it in the DeepSpeed engine, whose
    schedule plans for ``iters`` steps. ``checked``: the caller already ran
    ``refuse_what_this_machine_cannot_run`` (a run does, before its data)."""
    if not checked:  # before anything is built
        refuse_what_this_machine_cannot_run(cfg, dims, acc)
    model_cfg = resolve_model(cfg.model, vocab, cfg.data.seq_length, dims.tensor, eod)
    require_document_end(model_cfg, cfg.data.eod_mask_loss)
    torch.manual_seed(rank_seed(cfg.training.seed, dims))  # which dropout masks agree: see there
    zero_partition, dtype = partitioned_init(cfg, dims)
    model = build_parallel_model(model_cfg, dims, acc.current_device_name(), cfg.training.seed,
                                 cfg.parallel.pipeline_partition, cfg.parallel.tile_factor,
                                 zero_partition, dtype, dims.grad_accumulation(cfg), initial)
    if cfg.data.eod_mask_loss:
        use_loss_mask(model)
    device_type = acc.device_name()
    notes = []
    kernels = devmod.device_kernels(acc)
    fused = use_device_kernels(model, kernels) + (["adamw"] if kernels.adamw else [])
    if fused:
        notes.append(f"{device_type} fused kernels: {', '.join(fused)}")
    if use_loss_kernel(model, cfg.training.kernels, device_type):
        notes.append("output layer + loss: Liger Kernel's fused linear cross-entropy")
    if cfg.model.fp8:
        n = convert_blocks_to_float8(model)
        notes.append(f"float8: {n} block linear layer(s) on this rank"
                     + (" (emulated on the CPU: slower)" if device_type == "cpu" else ""))
    if cfg.training.compile or (device_type == "hpu" and cfg.training.hpu_mode == "compile"):
        n = compile_blocks(model, acc.get_compile_backend())
        notes.append(f"torch.compile: {n} transformer block(s) on this rank, backend "
                     f"{acc.get_compile_backend()}")
    plan = batch_plan(cfg.training, dims.global_batch(cfg))
    ramped = cfg.training.rampup_batch_size is not None
    # Under a ramp the schedule counts full batches, and each step sits where its samples put it.
    schedule_steps = planned_steps(cfg, plan)[1] if ramped else iters
    engine = build_engine(model, cfg, dims, schedule_steps, device_type, kernels.adamw,
                          plan.position if ramped else None)
    note = unfused_wrapper_note(cfg, device_type)
    if note:
        notes.append(note)
    runner_args = (cfg, dims, dims.grad_accumulation(cfg), devmod.graph_break(acc, cfg.training.hpu_mode),
                   kernels.clip_norm)
    return Components(acc, model_cfg, engine, iters, flops_per_token(model_cfg, cfg.data.seq_length),
                      plan, notes, runner_args)
