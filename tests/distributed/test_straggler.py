"""A rank slower than the others is named, with its host, by the straggler check."""

import socket

from tests.conftest import char_overrides, check, read_metrics, run_pretrain


def test_a_rank_with_slow_data_is_named_a_straggler(tmp_path):
    # Every training sample takes 50 ms longer to read on rank 1 (a test-only dataset wrapper).
    proc = check(run_pretrain(
        ["recipes/shakespeare-char.yaml", *char_overrides(tmp_path), "training.iters=6",
         "training.log_interval=3", "training.eval_interval=0", "training.eval_iters=1",
         "training.sample_tokens=0", "training.global_batch_size=8", "training.micro_batch_size=4",
         "monitor.straggler_interval=3"], nproc=2, env={"FAULT_SLOW_DATA": "0:1000000000:0.05:1"}))
    events = [r for r in read_metrics(tmp_path / "run") if r.get("event") == "straggler"]
    # Checked at steps 3 and 6: rank 1 both times, rank 0 never.
    assert [(e["step"], e["rank"]) for e in events] == [(3, 1), (6, 1)], events
    assert all(e["host"] == socket.gethostname() and e["local_ms"] > 4 * 50 * 0.9 for e in events)
    assert f"rank 1 on {socket.gethostname()} spends " in proc.stdout
