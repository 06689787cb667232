"""Per-phase timings in training records, throughput after warm-up, and slowdown events."""

from tests.conftest import char_overrides, check, read_metrics, run_pretrain

PHASES = ("data", "forward", "backward", "optimizer")


def test_records_time_each_phase_and_a_slow_data_step_is_a_slowdown_naming_data(tmp_path):
    batch = 4
    slow_step = 12
    # Each sample of step 12 takes 0.1 s longer to read (a test-only wrapper of the dataset).
    first = (slow_step - 1) * batch
    proc = check(run_pretrain(
        ["recipes/shakespeare-char.yaml", *char_overrides(tmp_path), "training.iters=16",
         "training.log_interval=1", "training.eval_interval=8", "training.eval_iters=1",
         "training.sample_tokens=0", f"training.global_batch_size={batch}",
         f"training.micro_batch_size={batch}",
         f"checkpoint.dir={tmp_path}/ckpt", "checkpoint.save_interval=5", "monitor.min_history=5"],
        env={"FAULT_SLOW_DATA": f"{first}:{first + batch}:0.1"}))
    records = read_metrics(tmp_path / "run")
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 17))

    # Every record: each phase, evaluation and checkpoint time, memory; the first also start-up.
    for r in train:
        assert all(r[f"{p}_ms"] >= 0 for p in PHASES), r
        # The phases are parts of the step (on CPU, the host clock times them all).
        assert sum(r[f"{p}_ms"] for p in PHASES) <= r["step_time_ms"] * 1.001 + 0.01, r
        assert r["eval_ms"] >= 0 and r["checkpoint_ms"] >= 0 and r["host_rss_gib"] > 0
        assert "memory_allocated_gib" not in r  # CPU: host memory only
    assert train[0]["startup_s"] > 0 and all("startup_s" not in r for r in train[1:])
    assert "startup: " in proc.stdout
    # Saves at steps 5, 10, 15 and the evaluation at step 8 are counted in the next record
    # (the record's interval runs from the end of the previous log line), not as step time.
    assert all(train[s]["checkpoint_ms"] > 0 for s in (5, 10, 15))
    assert train[8]["eval_ms"] > 0 and train[8]["eval_ms"] == max(r["eval_ms"] for r in train)
    evals = [r for r in records if "val_loss" in r]
    assert evals and all(r["eval_ms"] > 0 for r in evals)

    # training.throughput_warmup_steps (2): steps 1 and 2 have no throughput; the rest do.
    for r in train[:2]:
        assert all(r[k] is None for k in ("tokens_per_sec", "samples_per_sec", "tflops_per_device")), r
    for r in train[2:]:
        assert r["samples_per_sec"] * 64 == r["tokens_per_sec"] and r["tokens_per_sec"] > 0
    assert "throughput: warm-up" in proc.stdout.split("step      3/16")[0]

    # The slow step's data wait shows in its record, and it is a slowdown naming data.
    slow = train[slow_step - 1]
    assert slow["data_ms"] > 0.4 * 1000 * 0.9
    slowdowns = [r for r in records if r.get("event") == "slowdown"]
    assert any(e["step"] == slow_step and e["phase"] == "data" for e in slowdowns), slowdowns
    assert f"slowdown at step {slow_step}: " in proc.stdout
