"""Spike rollback: the trainer reloads an earlier checkpoint and skips the data window that led
to the spike (``spikes.policy: rollback``)."""

from __future__ import annotations

from typing import Any

from megatron_lite.data.gpt_dataset import past_skipped
from megatron_lite.spikes import SpikeStop, StepContext


# ``self``: the ``Trainer`` (not imported: the trainer imports this module).
def roll_back(self: Any, spike: StepContext) -> bool:
    """Collective. The trainer ``self`` reloads the newest checkpoint at least
    ``spikes.rollback.min_steps_back`` steps before the ``spike`` step and skips the data up to
    it plus ``skip_batches``; False (the step stays skipped) when there is no such checkpoint."""
    rb = self.cfg.spikes.rollback
    spike_step = spike.step
    if self.checkpointer is None:
        return False
    self.saves.finish()
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
    phase = self.phases[-1]
    if position < phase["start"]:
        # Checked before anything is touched: the checkpoints, ``latest`` and the skip windows
        # of the current phase stay as they are.
        self.spikes.record_note("rollback_unavailable", (
            f"the checkpoint to roll back to ({target.name}, sample {position}) is from before data "
            f"phase {phase['phase']}, which starts at sample {phase['start']}: a rollback does not go "
            "back across a change of data; the step was skipped instead"))
        return False
    window = self.spikes.rollback_window(position, spike.consumed_after)
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
    self._continue_from(loaded)
    return True
