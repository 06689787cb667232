"""A text sample that fails on one rank: every rank goes on training, in training mode."""

from __future__ import annotations

from tests.conftest import char_overrides, check, read_metrics, run_pretrain


def test_a_sample_failing_on_one_tensor_rank_leaves_no_rank_behind_and_dropout_on(tmp_path):
    # Tensor parallelism: every generated token is a forward with collectives over both ranks.
    # Rank 1 fails at the second token; rank 0 must not go on into the third token's collectives
    # (without agreement it waits there until the timeout), and after the failed sample both
    # train with dropout again: the losses after it equal a run whose sample succeeded.
    common = ["recipes/shakespeare-char.yaml", *char_overrides(tmp_path)[:3], "parallel.tensor=2",
              "model.dropout=0.1", "training.iters=4", "training.eval_interval=2", "training.eval_iters=1",
              "training.sample_tokens=3", "training.log_interval=1", "training.global_batch_size=4",
              "training.micro_batch_size=2", "distributed.timeout_minutes=1"]
    failed = check(run_pretrain([*common, f"logging.dir={tmp_path}/failed"], nproc=2,
                                env={"FAULT_SAMPLE_ERROR": "2:1"}))
    assert ("warning: sampling at step 2 failed (IndexError: rank 1 failed during the text sample: "
            "list index out of range (injected))") in failed.stdout, failed.stdout
    check(run_pretrain([*common, f"logging.dir={tmp_path}/sampled"], nproc=2))

    def losses(run):
        return [(r["step"], r["loss"]) for r in read_metrics(tmp_path / run) if "loss" in r]

    assert [s for s, _ in losses("failed")] == [1, 2, 3, 4]
    assert losses("failed") == losses("sampled")
