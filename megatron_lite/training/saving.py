"""When the run saves and what a failed save means: ``checkpoint.save_interval``, the last step,
a save the run control asks for (a signal, the time limit); saves in the background
(``checkpoint.async_save``); ``checkpoint.on_save_failure``. The checkpointer itself
(``checkpoint/``) writes and reads; this decides.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_lite.checkpoint import Checkpointer, CheckpointError
from megatron_lite.config.schema import Config
from megatron_lite.distributed.collectives import first_line
from megatron_lite.logging import MetricsLogger


class UnsavedEnd(CheckpointError):
    """The run ended without the checkpoint it needed: its last step's save failed, or it
    stopped early (the time limit) with no ``checkpoint.dir`` to save to. The same on every rank
    (every rank learns of a failed save; the stop is agreed), so one rank reports it."""


class SavePolicy:
    """When the trainer saves (the interval, the last step, what the run control asks) and what
    a failed save does (``checkpoint.on_save_failure``): the trainer's side of the checkpointer."""

    def __init__(self, cfg: Config, checkpointer: Checkpointer, logger: MetricsLogger,
                 log: Callable[[str], None], extra: Callable[[], dict], on_saved: Callable[[], None]):
        """``extra``: the trainer's state to save with the checkpoint (the spike tracker's);
        ``on_saved``: called after every save attempt (the run control's save clock)."""
        self.cfg, self.checkpointer, self.logger, self.log = cfg, checkpointer, logger, log
        self.extra, self.on_saved = extra, on_saved
        self.failures = 0
        self.last_good: tuple[int, int] | None = None  # (step, consumed samples) of the last save
        self.pending: tuple[int, int] | None = None  # a background save in flight

    def due(self, step: int, last: bool) -> bool:
        """Whether ``step`` saves whatever the run control asks: the interval, the last step."""
        interval = self.cfg.checkpoint.save_interval
        return bool(interval and step % interval == 0) or last

    def maybe_save(self, step: int, consumed_samples: int, last: bool, asked: bool = False) -> None:
        """Collective: save at the interval, at the last step, or when ``asked``."""
        if self.due(step, last) or asked:
            self.save(step, consumed_samples)

    def save(self, step: int, consumed_samples: int) -> None:
        """Collective. A failure is reported everywhere and handled by
        ``checkpoint.on_save_failure``."""
        self.finish()
        try:
            path = self.checkpointer.save(step, consumed_samples,
                                          background=self.cfg.checkpoint.async_save, extra=self.extra())
        except CheckpointError as e:
            self._failed(e, step)
            return
        finally:
            self.on_saved()
        if path is None:
            self.pending = (step, consumed_samples)
        else:
            self._succeeded((step, consumed_samples))
            self.log(f"saved checkpoint {path}")

    def restored(self, step: int, consumed_samples: int) -> None:
        """The run continues from the checkpoint of ``step`` (a resume or a rollback)."""
        self.last_good = (step, consumed_samples)

    def finish(self) -> None:
        """Collective: wait for the save in flight and account for its outcome."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        try:
            self.checkpointer.wait()
        except CheckpointError as e:
            self._failed(e, pending[0])
            return
        self._succeeded(pending)

    def settle_before_exit(self, failure: BaseException) -> None:
        """The run is ending with ``failure``: wait for the save in flight, or report it
        abandoned (the other ranks may be gone), before the failure goes on."""
        if self.pending is None:
            return
        step, self.pending = self.pending[0], None
        self.log(f"waiting for the checkpoint save of step {step} still in flight before exiting "
                 f"({type(failure).__name__})")
        try:
            path = self.checkpointer.wait()
        except BaseException as e:  # the writer's own failure, or the other ranks are gone
            self.log(f"error: the checkpoint save of step {step} was abandoned: {first_line(e)}; "
                     f"the previous checkpoint stays the latest")
            return
        self.log(f"the checkpoint save of step {step} completed: {path}")

    def require_saved(self, step: int, stopped: str | None = None) -> None:
        """The run has reached its last step ``step``, or stopped there (``stopped``: why, a
        signal or the time limit): raise ``UnsavedEnd`` unless that step's save succeeded
        (whatever ``checkpoint.on_save_failure`` says). A run whose trained state is on no disk
        has not finished, nor handed over to the next job: no exit status 0, no
        ``finished.json``, and the same command resumes from the last good checkpoint. The same
        on every rank (a failed save is reported everywhere)."""
        if not self.failures:
            return
        fixed = "once the cause is fixed, the same command"
        if self.last_good is None:
            since = f"no checkpoint of this run was saved; {fixed} starts it again"
        else:
            since = (f"the last good checkpoint is step {self.last_good[0]}; {fixed} resumes from it "
                     f"and trains the {step - self.last_good[0]} steps after it again")
        reached = f"stopped at step {step} ({stopped})" if stopped else f"reached its last step ({step})"
        raise UnsavedEnd(f"training {reached} but could not save it "
                         f"({self.failures} save(s) in a row failed; the errors are above): {since}")

    def warn_if_old(self, step: int, consumed_samples: int) -> None:
        if not self.failures:
            return
        if self.last_good is None:
            self.log(f"warning: no checkpoint saved yet; the last {self.failures} save(s) failed")
            return
        steps = step - self.last_good[0]
        tokens = (consumed_samples - self.last_good[1]) * self.cfg.data.seq_length
        self.log(f"warning: the last good checkpoint (step {self.last_good[0]}) is {steps} steps and "
                 f"{tokens:,} tokens old; {self.failures} save(s) in a row failed")

    def _succeeded(self, saved: tuple[int, int]) -> None:
        self.failures = 0
        self.last_good = saved

    def _failed(self, error: CheckpointError, step: int) -> None:
        ck = self.cfg.checkpoint
        self.failures += 1
        self.log(f"error: checkpoint save failed ({self.failures} in a row): {error}")
        self.logger.event(step, "checkpoint_save_failed", str(error), failures=self.failures)
        if ck.on_save_failure == "stop" and self.failures >= ck.max_save_failures:
            raise CheckpointError(f"{error}\nstopping: checkpoint.on_save_failure=stop "
                                  f"(checkpoint.max_save_failures={ck.max_save_failures})") from None
