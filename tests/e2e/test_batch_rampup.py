"""``training.rampup_batch_size``: Megatron's batch ramp-up (the accumulation steps change), the
learning rate following samples, data-parallel equality and an exact resume inside the ramp."""

import math

import pytest

from megatron_lite.data.batch_plan import BatchPlan
from tests.conftest import char_overrides, check, pretrain_main, read_metrics, run_pretrain

SEQ = 32
# Global batch 12 ramped from 4 by 4 over 24 samples: two increments, one every 12 samples.
# Samples trained before each step: 0, 4, 8 (batch 4), 12, 20 (batch 8), 28, 40, ... (12).
RAMP = ["training.rampup_batch_size=[4,4,24]", "training.global_batch_size=12", "training.iters=null",
        "training.micro_batch_size=2", f"data.seq_length={SEQ}", "model.n_layers=2", "model.d_model=64",
        "model.n_heads=4", "training.eval_iters=1", "training.sample_tokens=0", "training.log_interval=1",
        "schedule.warmup_iters=2", "schedule.decay_style=cosine", "schedule.decay_iters=6",
        "optimizer.lr=1e-3", "optimizer.min_lr=1e-4", "training.eval_interval=0"]
TRAINED_AFTER = [4, 8, 12, 20, 28, 40, 52]


def megatron_batch(consumed: int, start: int, increment: int, samples: int, final: int) -> int:
    """Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator, written from its description."""
    if consumed > samples:
        return final
    steps = int(consumed / (samples / ((final - start) // increment)))
    return start + steps * increment


@pytest.mark.parametrize("ramp,final", [((4, 4, 24), 12), ((32, 32, 4000), 1024), ((16, 48, 1000), 256),
                                        ((8, 8, 7), 64)])
def test_the_plan_follows_megatrons_rule(ramp, final):
    plan = BatchPlan(final, ramp)
    consumed = 0
    for step in range(2000):
        assert plan.samples_before(step) == consumed
        assert plan.batch(step) == megatron_batch(consumed, *ramp, final)
        consumed += plan.batch(step)
    assert plan.steps_for(consumed) == 2000 and plan.steps_for(consumed + 1) == 2001


def _records(run_dir):
    return [r for r in read_metrics(run_dir) if "loss" in r]


def _lr_by_hand(samples_before: int) -> float:
    p = samples_before / 12  # full batches
    if p < 2:
        return 1e-3 * (p + 1) / 3
    return 1e-4 + 0.5 * (1 + math.cos(math.pi * (p - 2) / 4)) * (1e-3 - 1e-4)


def test_a_ramped_run_trains_megatrons_batches_in_every_layout_and_resumes_exactly(tmp_path):
    base = ["recipes/shakespeare-char.yaml", *char_overrides(tmp_path), *RAMP]
    check(run_pretrain([*base, f"training.train_tokens={52 * SEQ}"]))
    one = _records(tmp_path / "run")
    assert [r["consumed_samples"] for r in one] == TRAINED_AFTER
    for r, before in zip(one, [0, *TRAINED_AFTER[:-1]], strict=True):
        assert r["lr"] == pytest.approx(_lr_by_hand(before), rel=1e-9), r["step"]

    # Two data-parallel ranks: each step's batch split over both, as DeepSpeed averages them.
    check(run_pretrain([*base, f"training.train_tokens={52 * SEQ}", f"logging.dir={tmp_path}/dp2"], nproc=2))
    dp2 = _records(tmp_path / "dp2")
    assert [r["consumed_samples"] for r in dp2] == TRAINED_AFTER
    for a, b in zip(one, dp2, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), a["step"]

    # Stopped after step 4 (inside the batch-8 part of the ramp) and resumed: the same steps.
    ck = [f"checkpoint.dir={tmp_path}/ck", f"logging.dir={tmp_path}/resumed"]
    check(run_pretrain([*base, *ck, f"training.train_tokens={20 * SEQ}"]))
    check(run_pretrain([*base, *ck, f"training.train_tokens={52 * SEQ}"]))
    resumed = _records(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(1, 8))
    for a, b in zip(one[4:], resumed[4:], strict=True):
        assert (b["loss"], b["grad_norm"], b["lr"]) == (a["loss"], a["grad_norm"], a["lr"]), a["step"]

    # Another ramp at the resume would not follow the checkpoint's samples: refused.
    proc = run_pretrain([*base, *ck, "training.rampup_batch_size=[4,8,24]",
                         f"training.train_tokens={60 * SEQ}"])
    assert proc.returncode == 1 and "keep the checkpoint's ramp-up" in proc.stderr, proc.stderr[-2000:]


def test_ramp_settings_that_cannot_work_are_refused_together(tmp_path):
    proc = pretrain_main(["recipes/shakespeare-char.yaml", *char_overrides(tmp_path), *RAMP,
                          "training.rampup_batch_size=[5,3,24]", "training.iters=10", "--dry-run"])
    assert proc.returncode == 2
    assert "the start must be below 'training.global_batch_size' = 12 by a multiple" in proc.stderr
    assert "give 'training.train_tokens' instead of 'training.iters'" in proc.stderr
    proc = pretrain_main(["recipes/shakespeare-char.yaml", *char_overrides(tmp_path), *RAMP,
                          "training.rampup_batch_size=[2,5,12]", "parallel.pipeline=2", "--dry-run"])
    assert proc.returncode == 2
    assert "must be multiples of 'training.micro_batch_size' = 2" in proc.stderr
    assert "'parallel.pipeline' > 1 is not supported" in proc.stderr
