"""The training loop: steps, metrics, evaluation, samples and checkpoints.

No host-device synchronisation inside a step: losses are summed on the device and read only at
log intervals.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_lite.checkpoint import Checkpointer, CheckpointError, Loaded
from megatron_lite.config.schema import Config
from megatron_lite.data.gpt_dataset import GlobalBatchSampler, past_skipped
from megatron_lite.data.source import DataSource
from megatron_lite.distributed import device as devmod
from megatron_lite.distributed.collectives import (
    broadcast_object,
    first_line,
    mean_over_ranks,
    raise_together,
)
from megatron_lite.distributed.parallel_dims import ParallelDims
from megatron_lite.logging import MetricsLogger, console_line
from megatron_lite.model.flops import mfu
from megatron_lite.spikes import SpikeStop, SpikeTracker, StepContext
from megatron_lite.training.control import RunControl
from megatron_lite.training.generate import sample
from megatron_lite.training.step import StepRunner


@dataclass
class TrainState:
    step: int = 0
    consumed_samples: int = 0


@dataclass
class RunResult:
    steps: int
    final_val_loss: float | None
    sample_text: str | None
    history: list[dict] = field(default_factory=list)
    stopped: str | None = None
    """Why the run stopped before ``training.iters`` (a signal, the time limit), if it did."""


class Trainer:
    def __init__(self, cfg: Config, dims: ParallelDims, acc, engine, data: DataSource,
                 logger: MetricsLogger, total_iters: int, flops_per_token: float,
                 log: Callable[[str], None], checkpointer: Checkpointer | None = None):
        self.cfg, self.dims, self.acc, self.engine, self.data = cfg, dims, acc, engine, data
        self.checkpointer = checkpointer
        self.logger, self.total_iters, self.log = logger, total_iters, log
        self.flops_per_token = flops_per_token
        self.device = torch.device(acc.current_device_name())
        self.global_batch = dims.global_batch(cfg)
        self.grad_accum = dims.grad_accumulation(cfg)
        self.tokens_per_step = self.global_batch * cfg.data.seq_length
        self.peak = devmod.peak_flops(devmod.device_name(acc), cfg.training.precision)
        self.state = TrainState()
        self.steps = StepRunner(cfg, dims, engine, self.grad_accum,
                                devmod.graph_break(acc, cfg.training.hpu_mode),
                                devmod.device_kernels(acc).clip_norm)
        locate = getattr(data.train, "locate", None) if data is not None else None
        self.spikes = SpikeTracker(cfg.spikes, logger.run_dir, dims.is_main, locate, log, logger)
        self.steps.gate(self.spikes.judge)
        self.control = RunControl(cfg, dims)
        self.save_failures = 0
        self.last_good: tuple[int, int] | None = None  # (step, consumed samples) of the last save
        self.pending_save: tuple[int, int] | None = None  # a background save in flight

    # ---- checkpoints ----
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
        log, error = None, None
        if self.dims.is_main:  # rank 0 reads; a bad file stops every rank, not rank 0 alone
            try:
                log = self.spikes.read_log()
            except Exception as e:
                error = e
        raise_together(error, self.dims, "reading the spike log")
        log = broadcast_object(log, self.dims, "the spike log")
        history = (self.checkpointer.rollback_history(resuming=loaded is not None)
                   if self.checkpointer is not None else [])
        self.spikes.resume(extra.get("spikes"), log, history)
        if loaded is not None:
            self._restore(loaded)

    def _restore(self, loaded: Loaded) -> None:
        # In place: the training loop holds this object.
        self.state.step = loaded.step
        self.state.consumed_samples = past_skipped(loaded.consumed_samples, self.spikes.skip)
        self.last_good = (loaded.step, loaded.consumed_samples)

    def _trainer_state(self) -> dict:
        return {"spikes": self.spikes.state_dict()}

    def save(self) -> None:
        """Save (in the background with ``checkpoint.async_save``); a failure is reported
        everywhere and handled by ``checkpoint.on_save_failure``."""
        self.finish_background_save()
        st = self.state
        try:
            path = self.checkpointer.save(st.step, st.consumed_samples,
                                          background=self.cfg.checkpoint.async_save,
                                          extra=self._trainer_state())
        except CheckpointError as e:
            self._save_failed(e, st.step)
            return
        finally:
            self.control.saved()
        if path is None:
            self.pending_save = (st.step, st.consumed_samples)
        else:
            self._save_succeeded((st.step, st.consumed_samples))
            self.log(f"saved checkpoint {path}")

    def finish_background_save(self) -> None:
        """Collective: wait for the save in flight and account for its outcome."""
        if self.pending_save is None:
            return
        pending, self.pending_save = self.pending_save, None
        try:
            self.checkpointer.wait()
        except CheckpointError as e:
            self._save_failed(e, pending[0])
            return
        self._save_succeeded(pending)

    def _save_succeeded(self, saved: tuple[int, int]) -> None:
        self.save_failures = 0
        self.last_good = saved

    def _save_failed(self, error: CheckpointError, step: int) -> None:
        ck = self.cfg.checkpoint
        self.save_failures += 1
        self.log(f"error: checkpoint save failed ({self.save_failures} in a row): {error}")
        self.logger.event(step, "checkpoint_save_failed", str(error), failures=self.save_failures)
        if ck.on_save_failure == "stop" and self.save_failures >= ck.max_save_failures:
            raise CheckpointError(f"{error}\nstopping: checkpoint.on_save_failure=stop "
                                  f"(checkpoint.max_save_failures={ck.max_save_failures})") from None

    def _warn_if_checkpoint_is_old(self) -> None:
        if not self.save_failures:
            return
        st = self.state
        if self.last_good is None:
            self.log(f"warning: no checkpoint saved yet; the last {self.save_failures} save(s) failed")
            return
        steps = st.step - self.last_good[0]
        tokens = (st.consumed_samples - self.last_good[1]) * self.cfg.data.seq_length
        self.log(f"warning: the last good checkpoint (step {self.last_good[0]}) is {steps} steps and "
                 f"{tokens:,} tokens old; {self.save_failures} save(s) in a row failed")

    # ---- evaluation ----
    def _batches(self, dataset, consumed: int, wrap: int | None, workers: bool,
                 skip: list[tuple[int, int]] = ()):
        sampler = GlobalBatchSampler(consumed, self.global_batch, self.cfg.training.micro_batch_size,
                                     self.dims.dp_rank, self.dims.data, wrap=wrap, skip=skip)
        if not workers:
            return (torch.stack([dataset[i] for i in idx]) for idx in sampler)
        return self.data.loader(dataset, sampler)

    @torch.no_grad()
    def evaluate(self) -> float:
        self.engine.eval()
        batches = self._batches(self.data.valid, 0, len(self.data.valid), workers=False)
        total = torch.zeros((), device=self.device)
        n = self.cfg.training.eval_iters
        for _ in range(n):
            total += self.steps.eval_loss(batches, self.device)
        self.engine.train()
        return mean_over_ranks((total / n).item(), self.dims, "the validation loss")

    def generate_sample(self) -> str | None:
        t = self.cfg.training
        if not t.sample_prompt or t.sample_tokens <= 0:
            return None
        p = self.cfg.parallel
        if p.pipeline > 1 or p.ulysses > 1 or (p.sequence_parallel and p.tensor > 1):
            return None  # generation runs whole prompts through one model replica
        tok = self.data.tokenizer
        model = self.engine.module
        was_training = model.training
        model.eval()
        ids = sample(model, tok.encode(t.sample_prompt), t.sample_tokens, self.cfg.data.seq_length,
                     t.sample_temperature, t.sample_top_k, t.seed, self.device)
        model.train(was_training)
        return t.sample_prompt + tok.decode(ids)

    def _eval_and_sample(self) -> tuple[float, str | None]:
        val = self.evaluate()
        try:
            text = self.generate_sample()
        except Exception as e:  # a sample is for reading; it never fails a run
            text = None
            self.log(f"warning: sampling at step {self.state.step} failed ({type(e).__name__}: "
                     f"{first_line(e)}); training goes on")
        record = {"step": self.state.step, "val_loss": val,
                  "val_ppl": math.exp(min(val, 50.0)), "consumed_samples": self.state.consumed_samples}
        self.logger.log(record)
        self.log(f"eval step {self.state.step}: val_loss {val:.4f} | val_ppl {record['val_ppl']:.2f}")
        if text is not None:
            self.logger.text("sample", text, self.state.step)
            self.log(f"sample at step {self.state.step}:\n{text}\n" + "-" * 40)
        return val, text

    # ---- training ----
    def _train_batches(self):
        return self._batches(self.data.train, self.state.consumed_samples, None,
                             workers=self.data.num_workers > 0, skip=self.spikes.skip)

    def train(self) -> RunResult:
        """The training loop. However it ends, the save in flight (``checkpoint.async_save``)
        is finished first: on an exception exit it is waited for, or reported abandoned, before
        the exception goes on."""
        try:
            return self._train()
        except BaseException as failure:
            self._settle_save_before_exit(failure)
            raise

    def _settle_save_before_exit(self, failure: BaseException) -> None:
        if self.pending_save is None:
            return
        step, self.pending_save = self.pending_save[0], None
        self.log(f"waiting for the checkpoint save of step {step} still in flight before exiting "
                 f"({type(failure).__name__})")
        try:
            path = self.checkpointer.wait()
        except BaseException as e:  # the writer's own failure, or the other ranks are gone
            self.log(f"error: the checkpoint save of step {step} was abandoned: {first_line(e)}; "
                     f"the previous checkpoint stays the latest")
            return
        self.log(f"the checkpoint save of step {step} completed: {path}")

    def _train(self) -> RunResult:
        cfg, engine, st = self.cfg, self.engine, self.state
        t = cfg.training
        batches = self._train_batches()
        result = RunResult(st.step, None, None)
        loss_sum = torch.zeros((), device=self.device)
        # Steps and applied steps (whose losses are averaged) since the last log line.
        interval_steps, loss_steps, interval_start = 0, 0, time.perf_counter()
        engine.train()
        while st.step < self.total_iters:
            lr = engine.optimizer.param_groups[0]["lr"]
            self.spikes.begin_step(StepContext(st.step + 1, st.consumed_samples, lr, self.global_batch))
            step_loss = self.train_step(batches)
            st.step += 1
            st.consumed_samples = past_skipped(st.consumed_samples + self.global_batch, self.spikes.skip)
            action = self.spikes.end_step(st.consumed_samples)
            if action == "stop":
                raise SpikeStop(f"{self.cfg.spikes.max_consecutive_nonfinite} non-finite steps in a row "
                                f"(spikes.max_consecutive_nonfinite) at step {st.step}; see "
                                f"{self.spikes.path}")
            if action == "rollback" and self.rollback():
                batches = self._train_batches()
                loss_sum.zero_()
                interval_steps, loss_steps, interval_start = 0, 0, time.perf_counter()
                continue
            interval_steps += 1
            if self.steps.applied:
                loss_sum += step_loss
                loss_steps += 1
            last = st.step == self.total_iters
            if st.step % t.log_interval == 0 or last:
                mean = loss_sum / (loss_steps * self.grad_accum) if loss_steps else loss_sum + math.nan
                record = self._train_record(mean, lr, interval_steps, time.perf_counter() - interval_start)
                record["skipped_steps"] = interval_steps - loss_steps
                result.history.append(record)
                self.logger.log(record)
                self.log(console_line(record, self.total_iters))
                self._warn_if_checkpoint_is_old()
                loss_sum.zero_()
                interval_steps = loss_steps = 0
            if (t.eval_interval and st.step % t.eval_interval == 0) or last:
                result.final_val_loss, result.sample_text = self._eval_and_sample()
            ck = cfg.checkpoint
            decision = self.control.decide()
            if ck.dir and ((ck.save_interval and st.step % ck.save_interval == 0) or last or decision.save):
                self.save()
            if decision.stop is not None:
                self.log(f"stopping at step {st.step}: {decision.stop}")
                self.logger.event(st.step, "stop", decision.stop)
                result.stopped = decision.stop
                break
            if st.step % t.log_interval == 0 or last:
                interval_start = time.perf_counter()  # evaluation and saving are not step time
        if self.checkpointer is not None:
            self.finish_background_save()
        result.steps = st.step
        return result

    def train_step(self, batches) -> torch.Tensor:
        """One optimizer step; returns the summed micro-batch losses as a device tensor."""
        return self.steps.train_step(batches, self.device)

    def rollback(self) -> bool:
        """Collective. Reload the newest checkpoint at least ``spikes.rollback.min_steps_back``
        steps before the spike and skip the data up to the spike plus ``skip_batches``; False
        (the step stays skipped) when there is no such checkpoint."""
        rb, st = self.cfg.spikes.rollback, self.state
        spike_step = st.step
        if self.checkpointer is None:
            return False
        self.finish_background_save()
        found = self.checkpointer.rollback_target(spike_step - rb.min_steps_back)
        if found is None:
            self.spikes.record_note("rollback_unavailable", f"no committed checkpoint at or before step "
                                    f"{spike_step - rb.min_steps_back}; the step was skipped instead")
            return False
        if self.spikes.rollbacks >= rb.max_rollbacks:
            message = (f"a rollback is needed at step {spike_step} but spikes.rollback.max_rollbacks="
                       f"{rb.max_rollbacks} were used; the data or the settings need a look (see "
                       f"{self.spikes.path}; raise max_rollbacks to go on)")
            self.spikes.record_note("stop", message)
            raise SpikeStop(message)
        target, to_step, position = found
        window = self.spikes.rollback_window(position, st.consumed_samples)
        # The data indices were planned for a budget of rollbacks (run.train_samples) assuming
        # saves every save_interval; after failed saves the target can be further back and the
        # window longer. Past the planned samples every rank would fail at a different moment.
        resume_at = past_skipped(position, [*self.spikes.skip, window])
        end = resume_at + (self.total_iters - to_step) * self.global_batch
        if end > len(self.data.train):
            self.spikes.record_note("rollback_unavailable", (
                f"rolling back to step {to_step} and skipping samples {window[0]}..{window[1] - 1} "
                f"would need {end} training samples, beyond the {len(self.data.train)} planned; "
                "the step was skipped instead"))
            return False
        self.checkpointer.record_rollback({"rollbacks": self.spikes.rollbacks + 1, "step": spike_step,
                                           "to_step": to_step, "skip_samples": list(window)})
        self.checkpointer.abandon_after(target, f"rollback{self.spikes.rollbacks + 1}")
        loaded = self.checkpointer.load(target)
        assert loaded is not None
        self.spikes.record_rollback(loaded.step, str(target), window)
        self.spikes.restore_statistics((loaded.extra or {}).get("spikes"))
        self._restore(loaded)
        return True

    def _train_record(self, mean_loss: torch.Tensor, lr: float, steps: int, seconds: float) -> dict:
        loss = mean_over_ranks(mean_loss.item(), self.dims, "the logged loss")
        gnorm = self.steps.grad_norm
        tokens_per_sec = self.tokens_per_step * steps / max(seconds, 1e-9)
        per_device = tokens_per_sec / self.dims.world_size
        tflops = per_device * self.flops_per_token / 1e12
        return {
            "step": self.state.step, "loss": loss, "lr": lr,
            "grad_norm": float(gnorm) if gnorm is not None else None,
            "step_time_ms": 1000.0 * seconds / steps, "tokens_per_sec": tokens_per_sec,
            "tokens_per_sec_per_device": per_device, "tflops_per_device": tflops,
            "mfu": mfu(per_device, self.flops_per_token, self.peak),
            "memory_gib": devmod.memory_gib(self.acc),
            "consumed_samples": self.state.consumed_samples,
            "consumed_tokens": self.state.consumed_samples * self.cfg.data.seq_length,
        }
