"""One optimizer step and one evaluation batch, for every parallel layout.

The trainer and the layout tests drive the engine only through ``StepRunner``: it splits
sequences for Ulysses, hands micro-batches to DeepSpeed's pipeline engine under pipeline
parallelism, and clips gradients itself where DeepSpeed would not report the norm.

Update gate (spike tracking): DeepSpeed owns the step from gradient reduction to the update,
and its ZeRO, bf16 and pipeline paths differ, but all of them end in the torch optimizer's
``step`` after the gradients are reduced and their norm is known. ``StepRunner.gate`` wraps that
one method; on its first call in a step it takes the step's report (the loss over all ranks, the
global gradient norm, the run control's flags). It does so in one of two ways:

- **After the update** (the default, where the optimizer can skip an update on the device): the
  report is built on the device and read by the host one step late (``step_report.py``); a
  non-finite update is skipped by the device itself, and the judge sees the step when the next
  one has been queued. No host synchronisation and no host collective in the step.
- **Before the update** (``spikes.policy=skip_step``, which must decline a finite update, and
  ``rollback``, which skips the update where no rollback is possible; fp16, whose loss scaler
  decides on the host anyway; an optimizer without a device-side skip, such as DeepSpeed's CPU
  Adam under offload or Gaudi's fused AdamW): the loss and the flags are reduced
  over the control group and read at once, and the judge decides before the update. Declining
  leaves the parameters and the Adam state untouched while DeepSpeed still zeroes the gradients
  and advances the LR schedule. This costs one host synchronisation and one host collective per
  step, as Megatron's own finite-gradient check does.

Where DeepSpeed skips the update itself (a non-finite gradient norm), the report is taken after
the step and the LR schedule is advanced here, so a skipped step always advances it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from megatron_lite.config.schema import Config
from megatron_lite.distributed import collectives
from megatron_lite.distributed.parallel_dims import ParallelDims
from megatron_lite.distributed.shard_spec import spec
from megatron_lite.engine import internals as ds
from megatron_lite.engine.config import sequence_gradient_factor, trainer_clips_gradients
from megatron_lite.engine.pipeline import loss_scale
from megatron_lite.model.loss import IGNORED
from megatron_lite.model.transformer import document_ids
from megatron_lite.parallel.ring import sequence_positions
from megatron_lite.training.replica_average import ReplicaAverage
from megatron_lite.training.step_report import PendingReport, StepReport, StepReporter, skips_on_device
from megatron_lite.training.timing import NoClock


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, dims: ParallelDims,
                   fused: Callable | None = None) -> torch.Tensor:
    """Clip to the global gradient norm over all tensor-parallel slices (a replicated parameter
    counted once); returns the norm before clipping. Gradients must already be averaged over
    the data-parallel ranks. ``fused``: a device's clipping kernel (``DeviceKernels.clip_norm``),
    used where this rank holds whole gradients (no tensor parallelism) and clipping is on."""
    if fused is not None and dims.tensor == 1 and max_norm > 0 and math.isfinite(max_norm):
        return fused([p for p in params if p.grad is not None], max_norm)
    grads = [p.grad for p in params if p.grad is not None and (dims.tp_rank == 0 or spec(p).sharded)]
    # torch's multi-tensor norm and scaling (one launch each per dtype, not one per tensor). torch
    # leaves them off for CPU tensors by default; its C++ loop there still beats one Python call
    # per tensor (docs/benchmarks-history.md, "Where the step's time goes").
    foreach = True if params[0].device.type == "cpu" else None
    norm = torch.nn.utils.get_total_norm(grads, foreach=foreach).float() if grads \
        else torch.zeros((), device=params[0].device)
    if dims.tensor > 1:
        square = norm.square()
        collectives.all_reduce(square, dims.group("tensor"))
        norm = square.sqrt()
    if max_norm > 0 and math.isfinite(max_norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=foreach)
    return norm


Judge = Callable[[float, "float | None", bool], bool]
"""(mean loss over all ranks, global gradient norm, fp16 loss-scale overflow) -> apply the update?"""


@dataclass(frozen=True)
class UpdateGate:
    """Who is asked at every update (see the module docstring)."""

    judge: Judge
    """Decides on the step's report (the spike tracker's ``judge``)."""
    flags: Callable[[], list[bool]] = list
    """This rank's run-control flags, OR-ed over the ranks in the report."""
    n_flags: int = 0
    """How many flags ``flags`` returns."""


def judged_after_update(cfg: Config, opt: torch.optim.Optimizer) -> bool:
    """Whether the step's report can be read one step late (see the module docstring)."""
    return cfg.spikes.policy == "log" and cfg.training.precision != "fp16" and skips_on_device(opt)


class StepRunner:
    def __init__(self, cfg: Config, dims: ParallelDims, engine, grad_accum: int,
                 graph_break: Callable[[], None] = lambda: None, clip_kernel: Callable | None = None,
                 acc=None, *, gate: UpdateGate | None = None, clock: NoClock | None = None,
                 document_end: int | None = None, loss_mask_end: int | None = None):
        """``gate``: judge every update (at most one runner per engine has one: it wraps the
        optimizer's ``step``); without one, every update is applied unreported. ``clock``: the
        phase timings of training steps (``training/timing.py``). ``document_end``: the token id
        that ends a document when attention stays within documents (``model.attention_mask``);
        ``loss_mask_end``: the one whose predictions the loss leaves out (``data.eod_mask_loss``)."""
        self.document_end, self.loss_mask_end = document_end, loss_mask_end
        self.cfg, self.dims, self.engine, self.grad_accum = cfg, dims, engine, grad_accum
        # Evaluation batches stay full-sized while a batch ramp-up changes the training ones.
        self.eval_accum = grad_accum
        self.ramped = cfg.training.rampup_batch_size is not None
        self.acc = acc  # DeepSpeed's accelerator: pinned memory and events for the late report
        self.clip_kernel = clip_kernel  # a device's fused clipping (distributed/device.py)
        # Where Gaudi's lazy mode runs the graph built so far (device.graph_break); else a no-op.
        self.graph_break = graph_break
        self.pipelined = dims.pipeline > 1
        # The factor the pipeline's training losses carry (the pipeline module was built with it).
        self.train_scale = loss_scale(dims, grad_accum) if self.pipelined else 1.0
        # Without a pipeline the factor goes on the loss given to backward alone.
        self.backward_scale = sequence_gradient_factor(cfg, dims)
        self.own_clipping = trainer_clips_gradients(cfg) and not self.pipelined
        # Taken once: walking the module's parameters costs as much per step as a small model's
        # optimizer update (the parameters are fixed once the engine is built).
        self._params = list(engine.module.parameters())
        self.grad_norm: torch.Tensor | None = None
        self.judge: Judge | None = gate.judge if gate is not None else None
        self.applied: bool | torch.Tensor = True
        """Whether the last step's update was applied: a device bool when judged after it."""
        self.late = False  # the report is read after the update (see the module docstring)
        self.report: PendingReport | StepReport | None = None
        """The last step's report: pending (on its way to the host) when judged after the update."""
        self._flags: Callable[[], list[bool]] = list
        self._reporter: StepReporter | None = None
        self._armed = False
        self._loss_sum: torch.Tensor | None = None
        self.clock = clock if clock is not None else NoClock()
        # HSDP: DeepSpeed averages the gradients within the shard group (its whole data-parallel
        # world); each rank's shard is averaged over the copies of its shard group too, bucket by
        # bucket during the backward pass. One per engine: a second runner shares the first's.
        self.replica_average: ReplicaAverage | None = None
        if dims.hsdp_replicas > 1 and not self.pipelined:
            self.replica_average = getattr(engine, "replica_average", None) or ReplicaAverage(
                engine, dims.group("replica"), dims.hsdp_replicas)
            engine.replica_average = self.replica_average
        if gate is not None:
            self._install_gate(gate)

    # ---------------------------------------------------------------- gate
    def _install_gate(self, gate: UpdateGate) -> None:
        """Take a report at every update and ask the gate's judge (see the module docstring)."""
        judge, self._flags, n_flags = gate.judge, gate.flags, gate.n_flags
        opt = ds.torch_optimizer(self.engine)
        self.late = judged_after_update(self.cfg, opt)
        if self.late:
            device = next(iter(self._params)).device
            self._reporter = StepReporter(self.dims, self.acc, device, self.grad_accum, n_flags)
        update = opt.step

        def gated_step(*args, **kwargs):
            if self._armed:
                self._armed = False
                if self.late:
                    self.report, skip = self._reporter.start(self._local_loss(), self._norm_tensor(),
                                                             self._flags())
                    opt.found_inf = skip  # torch's fused Adam skips the whole update where 1
                    self.applied = skip == 0
                else:
                    self.report = self._report_now(self._norm_now())
                    self.applied = judge(self.report.loss, self.report.grad_norm, False)
            if self.applied is True or self.late:
                return update(*args, **kwargs)
            ds.count_declined_update(opt)
            return None

        ds.install_update_gate(opt, gated_step)

    def require_reads(self) -> None:
        """From now on a late report that was never read is an error, not dropped (the
        training loop reads them all; a benchmark's steps need not)."""
        if self._reporter is not None:
            self._reporter.must_read = True

    def _local_loss(self) -> torch.Tensor | None:
        """This rank's summed micro-batch losses of the step (a device scalar), or None on a
        pipeline stage that holds none."""
        if self.pipelined:
            loss = ds.pipeline_step_loss(self.engine)
            return loss / self.train_scale if loss is not None else None
        return self._loss_sum

    def _report_now(self, norm: float | None) -> StepReport:
        """Before the update: the loss and the flags over the control group, read at once."""
        local = self._local_loss()
        # The step's one host synchronisation; the agreement itself is host control.
        mine = [float(local.detach().reshape(())), 1.0] if local is not None else [0.0, 0.0]
        flags = self._flags()
        total, count, *agreed = collectives.sum_over_ranks(mine + [float(f) for f in flags], self.dims,
                                                           "the step's loss and run-control flags")
        return StepReport(total / count / self.grad_accum, norm, True, tuple(f > 0 for f in agreed))

    def _norm_tensor(self):
        """The global gradient norm as DeepSpeed (or our clipping) left it: a device scalar where
        it stays on the device, a float where DeepSpeed read it already, or None."""
        return self.grad_norm if self.own_clipping else ds.reported_grad_norm(self.engine)

    def _norm_now(self) -> float | None:
        """The global gradient norm DeepSpeed (or our clipping) computed for this step, read."""
        norm = self._norm_tensor()
        if norm is None:
            return None
        norm = float(norm)
        # ZeRO reports a non-finite norm as -1 when it does not skip the step itself (bf16).
        return math.inf if norm < 0 else norm

    def _after_step(self) -> None:
        """The update was not reached (DeepSpeed skipped it): report now (judged now, or one
        step late), advance the schedule."""
        if not self._armed:
            return
        self._armed = False
        overflow = self.cfg.training.precision == "fp16"
        assert self.judge is not None
        if self.late:
            self.report, _ = self._reporter.start(self._local_loss(), math.inf, self._flags())
        else:
            self.report = self._report_now(math.inf)
            self.judge(self.report.loss, math.inf, overflow)  # records the event; nothing was applied
        self.applied = False
        scheduler = self.engine.lr_scheduler
        if scheduler is not None and not overflow:
            scheduler.step()

    # ---------------------------------------------------------------- steps
    def split(self, batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(B, T+1) token windows -> this rank's (inputs, targets), and the document of each
        token of the whole sequence (B, T) when attention stays within documents."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        documents = None if self.document_end is None else document_ids(inputs == self.document_end)
        if self.loss_mask_end is not None:
            targets = targets.masked_fill(inputs == self.loss_mask_end, IGNORED)
        if self.dims.sequence > 1:
            d = self.dims
            held = sequence_positions(inputs.size(1), d.ulysses, d.ulysses_rank, d.context, d.context_rank,
                                      inputs.device)
            inputs, targets = inputs[:, held], targets[:, held]
        return (inputs, targets) if documents is None else (inputs, targets, documents)

    def _pairs(self, batches: Iterator[torch.Tensor], device) -> Iterator[tuple[torch.Tensor, ...]]:
        for batch in batches:
            yield self.split(batch.to(device, non_blocking=True))

    def _timed_pairs(self, batches: Iterator[torch.Tensor],
                     device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The pipeline engine pulls micro-batches inside its schedule: time each pull as data."""
        pairs = self._pairs(batches, device)
        while True:
            self.clock.mark("data")
            pair = next(pairs, None)
            self.clock.mark(None)
            if pair is None:
                return
            yield pair

    def _stage_pairs(self, pairs: Iterator[tuple[torch.Tensor, ...]]) -> Iterator[tuple[torch.Tensor, ...]]:
        """What DeepSpeed's pipeline engine pulls: (inputs, targets). With documents, this
        stage's micro-batches are read first, on every stage (the engine pulls only on the first
        and last), and their documents queued for the stage (``engine/pipeline.py``)."""
        if self.document_end is None:
            return pairs
        read = [next(pairs) for _ in range(self.grad_accum)]
        stage = self.engine.module
        if stage.documents:
            raise RuntimeError(f"pipeline stage: {len(stage.documents)} micro-batch(es) of documents "
                               "were never run")
        stage.takes_documents = True
        stage.documents.extend(documents for _, _, documents in read)
        return iter([(inputs, targets) for inputs, targets, _ in read])

    def use_batch(self, global_batch: int) -> None:
        """The next steps take ``global_batch`` samples (a batch ramp-up): as many more or fewer
        micro-batches, in DeepSpeed's accounting too (its gradient averaging)."""
        accum = global_batch // (self.cfg.training.micro_batch_size * self.dims.data)
        if accum == self.grad_accum:
            return
        self.grad_accum = accum
        self.engine.set_train_batch_size(
            self.engine.train_micro_batch_size_per_gpu() * accum * self.engine.dp_world_size)
        if self._reporter is not None:
            self._reporter.grad_accum = accum

    def train_step(self, batches: Iterator[torch.Tensor], device) -> torch.Tensor:
        """One optimizer step over ``grad_accum`` micro-batches; returns the sum of the
        micro-batch losses as a device tensor. ``clock`` gets the step's phases (under pipeline
        parallelism, whose schedule interleaves them, only the data wait)."""
        engine, clock = self.engine, self.clock
        self._armed, self.applied = self.judge is not None, True
        if self.pipelined:
            loss = engine.train_batch(data_iter=self._stage_pairs(self._timed_pairs(batches, device)))
            self.grad_norm = engine.get_global_grad_norm()
            if self.judge is not None:
                self._after_step()
            return loss.detach().float() * self.grad_accum / self.train_scale
        loss_sum = torch.zeros((), device=device)
        pairs = self._pairs(batches, device)
        for micro in range(self.grad_accum):
            clock.mark("data")
            pair = next(pairs)
            clock.mark("forward")
            last = micro == self.grad_accum - 1
            if self.ramped:
                # DeepSpeed finds the boundary from its count of micro-steps modulo the current
                # accumulation steps, which a change of batch leaves out of phase.
                engine.set_gradient_accumulation_boundary(last)
            loss = engine(*pair)
            clock.mark("backward")
            if self.replica_average is not None:
                self.replica_average.armed = last
            engine.backward(loss * self.backward_scale if self.backward_scale != 1 else loss)
            self.graph_break()
            loss_sum += loss.detach().float()
            clock.mark("optimizer")
            if last and self.replica_average is not None:
                self.replica_average.finish()
            if self.own_clipping and last:
                self.grad_norm = clip_grad_norm(self._params, self.cfg.optimizer.grad_clip, self.dims,
                                                self.clip_kernel)
            if last:
                self._loss_sum = loss_sum
            engine.step()
        self.graph_break()
        if not self.own_clipping:
            self.grad_norm = engine.get_global_grad_norm()
        if self.judge is not None:
            self._after_step()
        clock.mark(None)
        return loss_sum

    @torch.no_grad()
    def eval_loss(self, batches: Iterator[torch.Tensor], device) -> torch.Tensor:
        """Mean loss of the micro-batches of one full global batch."""
        if self.pipelined:
            loss = self.engine.eval_batch(self._stage_pairs(self._pairs(batches, device)),
                                          num_micro_batches=self.eval_accum)
            return loss.float().reshape(())
        total = torch.zeros((), device=device)
        pairs = self._pairs(batches, device)
        for _ in range(self.eval_accum):
            total += self.engine(*next(pairs)).float()
            # Gaudi's lazy mode: one graph per forward, not one across the whole evaluation.
            self.graph_break()
        return total / self.eval_accum
