"""Two gloo processes train exactly like one process with the same global batch."""

import torch

from tests.conftest import char_overrides, check, read_metrics, run_pretrain


def _losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def test_two_process_data_parallel_matches_single_process(tmp_path):
    common = ["recipes/shakespeare-char.yaml", *char_overrides(tmp_path)[:3], "training.iters=5",
              "training.log_interval=1", "training.eval_interval=0", "training.eval_iters=2",
              "training.global_batch_size=8", "training.micro_batch_size=4", "training.sample_tokens=0"]
    # One process accumulates 2 micro-batches; two processes take one each, read by a
    # data-loader worker process (which must not change the batches either).
    check(run_pretrain([*common, f"logging.dir={tmp_path}/one"]))
    proc = check(run_pretrain([*common, f"logging.dir={tmp_path}/two", "data.num_workers=1"], nproc=2))
    assert "world 2 (dp 2)" in proc.stdout
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(one) == len(two) == 5
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=0, atol=1e-5)
    val = [[r["val_loss"] for r in read_metrics(tmp_path / d) if "val_loss" in r] for d in ("one", "two")]
    torch.testing.assert_close(torch.tensor(val[1]), torch.tensor(val[0]), rtol=0, atol=1e-5)


def test_missing_dataset_fails_every_rank_quickly(tmp_path):
    proc = run_pretrain(["recipes/shakespeare-char.yaml", f"data.prefix={tmp_path}/none_text_document",
                         "data.build_from=null", "training.micro_batch_size=6",
                         f"logging.dir={tmp_path}/run"], nproc=2, timeout=180)
    assert proc.returncode != 0
    assert "preprocess_data.py" in proc.stderr


def test_resume_with_a_different_data_parallel_size_continues_the_same_stream(tmp_path):
    common = ["recipes/shakespeare-char.yaml", *char_overrides(tmp_path)[:3], "training.log_interval=1",
              "training.eval_interval=0", "training.eval_iters=1", "training.global_batch_size=8",
              "training.micro_batch_size=4", "training.sample_tokens=0"]
    check(run_pretrain([*common, "training.iters=6", f"logging.dir={tmp_path}/full"]))
    # Interrupted at step 3 on one process, resumed on two.
    ck = [f"checkpoint.dir={tmp_path}/ck", "checkpoint.save_interval=3"]
    check(run_pretrain([*common, *ck, "training.iters=3", f"logging.dir={tmp_path}/a"]))
    check(run_pretrain([*common, *ck, "training.iters=6", f"logging.dir={tmp_path}/b"], nproc=2))
    full = _losses(tmp_path / "full")
    resumed = [r for r in read_metrics(tmp_path / "b") if "loss" in r]
    assert [r["step"] for r in resumed] == [4, 5, 6]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in resumed]), torch.tensor(full[3:]),
                               rtol=0, atol=1e-5)
