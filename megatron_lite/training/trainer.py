"""The training loop: steps, spike handling, metrics; evaluation (``evaluator.py``) and saves
(``saving.py``) decide their own timing.

No host-device synchronisation inside a step: losses are summed on the device and read only at
log intervals, and each step's report (the loss over the ranks, the gradient norm, the run
control's flags) is read when the next step has been queued (``step_report.py``), or at once
where the next thing is not a step (a log line, an evaluation, a save, the end). Where the spike
policy must decide before the update (``step.py``), the report is read inside the step instead.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_lite.checkpoint import Checkpointer, Loaded
from megatron_lite.config.schema import Config
from megatron_lite.data.gpt_dataset import GlobalBatchSampler, past_skipped
from megatron_lite.data.phases import DataPhaseError, PhaseDataset, first_phase, phases_at_resume
from megatron_lite.data.source import DataSource
from megatron_lite.distributed import device as devmod
from megatron_lite.distributed import hang
from megatron_lite.distributed.collectives import mean_over_ranks, on_every_rank, on_one_rank_then_all
from megatron_lite.distributed.parallel_dims import ParallelDims
from megatron_lite.logging import MetricsLogger, console_line
from megatron_lite.model.flops import mfu
from megatron_lite.spikes import SpikeStop, SpikeTracker, StepContext
from megatron_lite.training.build import Components
from megatron_lite.training.control import RunControl
from megatron_lite.training.evaluator import Evaluator
from megatron_lite.training.monitor import SlowdownMonitor, StragglerCheck
from megatron_lite.training.profiling import StepProfiler
from megatron_lite.training.rollback import roll_back
from megatron_lite.training.saving import SavePolicy
from megatron_lite.training.step import UpdateGate
from megatron_lite.training.step_report import PendingReport, StepReport
from megatron_lite.training.timing import IntervalClock, PhaseClock, process_age_s

THROUGHPUT_KEYS = ("tokens_per_sec", "samples_per_sec", "tokens_per_sec_per_device", "tflops_per_device",
                   "mfu")
"""Null in a record whose steps were all warm-up (``training.throughput_warmup_steps``)."""


@dataclass
class TrainState:
    """Where the run is; saved in each checkpoint's manifest."""

    step: int = 0
    consumed_samples: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        # In place: the training loop holds this object.
        self.step, self.consumed_samples = state["step"], state["consumed_samples"]


@dataclass
class RunResult:
    steps: int
    final_val_loss: float | None
    sample_text: str | None
    history: list[dict] = field(default_factory=list)
    stopped: str | None = None
    """Why the run stopped before ``training.iters`` (a signal, the time limit), if it did."""


class Trainer:
    """The loop: each part decides its own timing (``Evaluator.maybe_run``, ``SavePolicy.maybe_save``);
    every step goes through the spike tracker (``SpikeTracker.track``)."""

    def __init__(self, cfg: Config, dims: ParallelDims, parts: Components, data: DataSource,
                 logger: MetricsLogger, log: Callable[[str], None], checkpointer: Checkpointer | None = None,
                 on_record: Callable[[dict], None] | None = None, clock: PhaseClock | None = None):
        """``clock``: the phase timings of training steps (None: a ``PhaseClock``)."""
        self.cfg, self.dims, self.parts, self.data = cfg, dims, parts, data
        self.engine, self.device = parts.engine, parts.device
        self.checkpointer, self.logger, self.log = checkpointer, logger, log
        self.on_record = on_record
        self.total_iters = parts.iters
        self.global_batch = dims.global_batch(cfg)
        self.plan = parts.plan
        self.peak = devmod.peak_flops(devmod.device_name(parts.acc), cfg.training.precision)
        self.state = TrainState()
        self.phases = first_phase(cfg.data)
        self.base_train = data.train  # the current phase's dataset, before any phase offset
        locate = getattr(data.train, "locate", None)
        self.spikes = SpikeTracker(cfg.spikes, logger.run_dir, dims.is_main, locate, log, logger)
        self.control = RunControl(cfg, dims)
        self.clock = clock if clock is not None else PhaseClock(parts.acc)
        gate = UpdateGate(self.spikes.judge, self.control.flags,
                          RunControl.N_FLAGS if self.control.active else 0)
        self.step_runner = parts.step_runner(gate, self.clock)
        self.profiler = StepProfiler(cfg, dims.rank, devmod.device_name(parts.acc), log)
        self.evaluator = Evaluator(cfg, dims, parts, self.step_runner, data, logger, log)
        self.interval = IntervalClock(cfg.training.throughput_warmup_steps)
        self.slowdowns = SlowdownMonitor(cfg.monitor)
        self.stragglers = StragglerCheck(cfg, dims)
        self.peak_memory_gib = 0.0
        self.startup_s: float | None = None
        self._unread: tuple[StepContext, PendingReport] | None = None
        """The last step's report, not yet read (judged after the update)."""
        self.saves = (SavePolicy(cfg, checkpointer, logger, log, self.state_dict, self.control.saved)
                      if checkpointer is not None else None)

    # ---- checkpoints ----
    def state_dict(self) -> dict:
        """The trainer's own state saved with each checkpoint (the checkpointer saves the engine's
        and each rank's random state, ``checkpoint/run_state.py``): the spike tracker's."""
        return {"spikes": self.spikes.state_dict(), "data_phases": self.phases,
                "batch_ramp": self.plan.ramp and list(self.plan.ramp)}

    def maybe_resume(self) -> None:
        """Claim the checkpoint directory, then resume from its latest checkpoint (when there is
        one and resuming is on), with the spike tracker's state; ``spikes.jsonl`` is cut back to
        match."""
        loaded = None
        if self.checkpointer is not None:
            self.checkpointer.claim()
            if self.cfg.checkpoint.resume:
                loaded = self.checkpointer.load()
        extra = loaded.extra if loaded is not None and loaded.extra else {}
        # Rank 0 reads; a bad file stops every rank, not rank 0 alone.
        log = on_one_rank_then_all(self.spikes.read_log, self.dims, "reading the spike log", share=True)
        history = (self.checkpointer.rollback_history(resuming=loaded is not None)
                   if self.checkpointer is not None else [])
        # Rank 0 cuts spikes.jsonl back (or moves an old one aside): a failure stops every rank.
        on_every_rank(lambda: self.spikes.resume(extra.get("spikes"), log, history), self.dims,
                      f"repairing {self.spikes.path}")
        if loaded is None:
            self.logger.start_fresh(self.log)
        else:
            saved_ramp = extra.get("batch_ramp")
            if saved_ramp != (self.plan.ramp and list(self.plan.ramp)):
                raise ValueError(f"training.rampup_batch_size={self.cfg.training.rampup_batch_size}, but "
                                 f"{loaded.path} was trained with {saved_ramp}: the steps' batches would "
                                 "not follow its samples; keep the checkpoint's ramp-up")
            self.phases = phases_at_resume(extra.get("data_phases"), self.cfg.data, loaded.step,
                                           loaded.consumed_samples, str(loaded.path), self.log)
            self._use_phase()
            self._continue_from(loaded)

    def _use_phase(self) -> None:
        """Training reads the current data phase's samples (the run's sample ``i`` is the
        phase's ``i - start``)."""
        phase = self.phases[-1]
        if phase["start"] > 0:
            self.data.train = PhaseDataset(self.base_train, phase["phase"], phase["start"])
            self.spikes.locate = self.data.train.locate

    def _continue_from(self, loaded: Loaded) -> None:
        """The run goes on from ``loaded`` (a resume or a rollback; the spike tracker's state is
        restored by each in its own way): its step, and its data position past the skipped
        windows."""
        start = self.phases[-1]["start"]
        if loaded.consumed_samples < start:
            raise DataPhaseError(f"{loaded.path} (sample {loaded.consumed_samples}) is from before data "
                                 f"phase {self.phases[-1]['phase']}, which starts at sample {start}: "
                                 "a rollback does not go back across a change of data")
        position = past_skipped(loaded.consumed_samples, self.spikes.skip)
        self.state.load_state_dict({"step": loaded.step, "consumed_samples": position})
        self.saves.restored(loaded.step, loaded.consumed_samples)

    def _batches(self, dataset, consumed: int, wrap: int | None, workers: bool,
                 skip: list[tuple[int, int]] = (), batches=None):
        sampler = GlobalBatchSampler(consumed, self.global_batch, self.cfg.training.micro_batch_size,
                                     self.dims.dp_rank, self.dims.data, wrap=wrap, skip=skip,
                                     batches=batches)
        if not workers:
            return (torch.stack([dataset[i] for i in idx]) for idx in sampler)
        return self.data.loader(dataset, sampler)

    # ---- training ----
    def _train_batches(self):
        first = self.state.step
        return self._batches(self.data.train, self.state.consumed_samples, None,
                             workers=self.data.num_workers > 0, skip=self.spikes.skip,
                             batches=lambda k: self.plan.batch(first + k))

    def train(self) -> RunResult:
        """The training loop. However it ends, the save in flight (``checkpoint.async_save``)
        is finished first: on an exception exit it is waited for, or reported abandoned, before
        the exception goes on."""
        try:
            return self._train()
        except BaseException as failure:
            if self.saves is not None:
                self.saves.settle_before_exit(failure)
            raise

    def _train(self) -> RunResult:
        engine, st, t = self.engine, self.state, self.cfg.training
        batches = self._train_batches()
        result = RunResult(st.step, None, None)
        loss_sum = torch.zeros((), device=self.device)
        loss_steps = torch.zeros((), device=self.device)  # applied steps (their losses are averaged)
        self.step_runner.require_reads()  # this loop reads every step's report; none may be lost
        engine.train()
        self.startup_s = process_age_s()
        if self.startup_s is not None:
            self.log(f"startup: {self.startup_s:.1f} s from the process's start to its first step")
        self.interval.restart()
        if st.step >= self.total_iters:
            self.log(f"nothing to train: resumed at step {st.step}, and the run has {self.total_iters} "
                     "(raise training.iters or train_tokens to go on)")
        while st.step < self.total_iters:
            lr = engine.optimizer.param_groups[0]["lr"]
            batch = self.plan.batch(st.step)
            self.step_runner.use_batch(batch)
            after = past_skipped(st.consumed_samples + batch, self.spikes.skip)
            ctx = StepContext(st.step + 1, st.consumed_samples, lr, batch, after)
            self.profiler.before(st.step + 1)
            step_loss, action = self.spikes.track(ctx, functools.partial(self.train_step, batches))
            st.step, st.consumed_samples = st.step + 1, after
            self.profiler.after(st.step)
            last = st.step == self.total_iters
            judged = []
            rolled_back = False
            for spike_ctx, spike_action, report in self._verdicts(ctx, action, last):
                judged.append(report)
                if spike_action == "stop":
                    raise SpikeStop(f"{self.cfg.spikes.max_consecutive_nonfinite} non-finite steps in a row "
                                    f"(spikes.max_consecutive_nonfinite) at step {spike_ctx.step}; see "
                                    f"{self.spikes.path}")
                if spike_action == "rollback" and self.rollback(spike_ctx):
                    rolled_back = True
                    break
            if rolled_back:
                if self._unread is not None:  # the step after the spike: rolled back with it
                    self._unread[1].discard()
                    self._unread = None
                batches = self._train_batches()
                loss_sum.zero_()
                loss_steps.zero_()
                self.clock.read()
                self.interval.restart()
                continue
            self.interval.step_done()
            applied = self.step_runner.applied
            step_loss = step_loss / self.step_runner.grad_accum  # the step's mean micro-batch loss
            if isinstance(applied, torch.Tensor):  # the device's verdict, read later
                loss_sum += torch.where(applied, step_loss, torch.zeros_like(step_loss))
                loss_steps += applied
            elif applied:
                loss_sum += step_loss
                loss_steps += 1
            logs = st.step % t.log_interval == 0 or last
            if logs:
                record = self._train_record(loss_sum, loss_steps, lr)
                result.history.append(record)
                self.logger.log(record)
                self.log(console_line(record, self.total_iters, self.control.time_left()))
                self._watch(record)
                if self.on_record is not None:
                    self.on_record(record)
                if self.saves is not None:
                    self.saves.warn_if_old(st.step, st.consumed_samples)
                loss_sum.zero_()
                loss_steps.zero_()
                self.interval.restart()  # logging is not step time
            started = time.perf_counter()
            evaluated = self.evaluator.maybe_run(st.step, st.consumed_samples, last)
            self.evaluator.maybe_score_tasks(st.step, last)
            self.interval.add("eval", time.perf_counter() - started)
            if evaluated is not None:
                result.final_val_loss, result.sample_text = evaluated
            decision = self.control.decide(self._agreed_flags(judged))
            if decision.asked is not None and self.saves is not None:
                self.log(f"saving at step {st.step}: {decision.asked}")
            if self.saves is not None:
                started = time.perf_counter()
                self.saves.maybe_save(st.step, st.consumed_samples, last=last, asked=decision.save)
                self.interval.add("checkpoint", time.perf_counter() - started)
            if decision.stop is not None and last:  # nothing left to stop
                self.log(f"{decision.stop} at the last step: no step is left to train")
            elif decision.stop is not None:
                self.log(f"stopping at step {st.step}: {decision.stop}")
                self.logger.event(st.step, "stop", decision.stop)
                result.stopped = decision.stop
                break
        self.profiler.close()
        if self.saves is not None:
            self.saves.finish()
            self.saves.require_saved(st.step, result.stopped)
        result.steps = st.step
        return result

    def _verdicts(self, ctx: StepContext, action: str, last: bool):
        """The steps judged now, in order, each (context, action, report): this step where it
        was judged before its update; else the step before it (its report has landed), then
        this one if a log line, an evaluation, a save or a stop follows. Lazy: the trainer
        stops at a rollback or a stop, and the rest stays unread."""
        if not self.step_runner.late:
            yield ctx, action, self.step_runner.report
            return
        previous, self._unread = self._unread, (ctx, self.step_runner.report)
        asked = False
        if previous is not None:
            judged = self._judge(*previous)
            asked = any(judged[2].flags)
            yield judged
        if asked or self._next_is_not_a_step(ctx.step, last):
            current, self._unread = self._unread, None
            yield self._judge(*current)

    def _judge(self, ctx: StepContext, pending: PendingReport) -> tuple[StepContext, str, StepReport]:
        """A step judged after its update, from its report: (its context, the action, the report)."""
        report = pending.read()
        return ctx, self.spikes.record(ctx, report), report

    def _next_is_not_a_step(self, step: int, last: bool) -> bool:
        """Whether a log line, an evaluation or a save follows step ``step``: its report must be
        read first (a save holds the spike tracker's state after it; a log line its loss)."""
        return (step % self.cfg.training.log_interval == 0 or last or self.evaluator.due(step, last)
                or (self.saves is not None and self.saves.due(step, last)))

    def _agreed_flags(self, reports: list[StepReport]) -> tuple[bool, ...]:
        """The run control's flags of the reports read after this step, OR-ed (all false where
        none was read: the next step's read brings them)."""
        flags = [False] * (self.control.N_FLAGS if self.control.active else 0)
        for report in reports:
            flags = [a or b for a, b in zip(flags, report.flags, strict=True)]
        return tuple(flags)

    def train_step(self, batches) -> torch.Tensor:
        """One optimizer step; returns the summed micro-batch losses as a device tensor."""
        hang.progress()  # a step begun: this rank moves (distributed/hang.py)
        return self.step_runner.train_step(batches, self.device)

    def rollback(self, spike: StepContext) -> bool:
        """Collective. See ``training/rollback.py``."""
        return roll_back(self, spike)

    def _train_record(self, loss_sum: torch.Tensor, loss_steps: torch.Tensor, lr: float) -> dict:
        """The log interval's record: ``loss_sum`` over ``loss_steps`` applied steps. The loss
        read is the interval's one wait for the device; the phase timings are read after it.
        Times are this rank's (rank 0's in the logs)."""
        summed, applied = torch.stack([loss_sum, loss_steps.to(loss_sum.dtype)]).tolist()
        mean = summed / applied if applied else math.nan
        loss = mean_over_ranks(mean, self.dims, "the logged loss")
        now = time.perf_counter()
        span, timed = self.interval.all, self.interval.timed
        gnorm = self.step_runner.grad_norm
        record = {"step": self.state.step, "loss": loss, "lr": lr,
                  "grad_norm": float(gnorm) if gnorm is not None else None,
                  "skipped_steps": self.interval.all.steps - round(applied),
                  "step_time_ms": 1000.0 * span.step_seconds(now) / span.steps}
        for phase, ms in self.clock.read().items():
            record[f"{phase}_ms"] = ms / span.steps
        record.update(eval_ms=1000.0 * span.eval_s, checkpoint_ms=1000.0 * span.checkpoint_s)
        record.update(self._throughput(timed.steps, timed.step_seconds(now)) if timed and timed.steps
                      else dict.fromkeys(THROUGHPUT_KEYS))
        acc = self.parts.acc
        self.peak_memory_gib = max(self.peak_memory_gib, devmod.memory_gib(acc))
        record.update(memory_gib=self.peak_memory_gib, **devmod.device_memory_gib(acc),
                      host_rss_gib=devmod.host_rss_gib())
        if self.startup_s is not None:  # the process's first record
            record["startup_s"], self.startup_s = self.startup_s, None
        record.update(consumed_samples=self.state.consumed_samples,
                      consumed_tokens=self.state.consumed_samples * self.cfg.data.seq_length)
        return record

    def _throughput(self, steps: int, seconds: float) -> dict:
        """Over the last ``steps`` steps (their batches: a ramp-up changes them)."""
        seconds = max(seconds, 1e-9)
        step = self.state.step
        samples = self.plan.samples_before(step) - self.plan.samples_before(step - steps)
        tokens_per_sec = samples * self.cfg.data.seq_length / seconds
        per_device = tokens_per_sec / self.dims.world_size
        return {"tokens_per_sec": tokens_per_sec, "samples_per_sec": samples / seconds,
                "tokens_per_sec_per_device": per_device,
                "tflops_per_device": per_device * self.parts.flops_per_token / 1e12,
                "mfu": mfu(per_device, self.parts.flops_per_token, self.peak)}

    def _watch(self, record: dict) -> None:
        """Slowdown (rank 0's records) and, when due, straggler events (collective)."""
        events = []
        if self.dims.is_main:
            slowdown = self.slowdowns.observe(record)
            if slowdown is not None:
                events.append(slowdown)
        if self.stragglers.due(record["step"]):
            events += self.stragglers.check(record["step"], record)
        for kind, message, fields in events:
            self.log(f"{kind} at step {record['step']}: {message}")
            self.logger.event(record["step"], kind, message, **fields)
