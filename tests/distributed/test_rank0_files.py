"""Rank 0's file work at start-up (the run directory, the metrics sinks) fails on every rank:
the other ranks stop with rank 0's reason instead of waiting for it in their next collective."""

from __future__ import annotations

import pytest

from tests.conftest import char_overrides, run_pretrain


@pytest.mark.parametrize("broken", ["run-dir", "metrics"])
def test_a_rank0_file_failure_at_start_stops_every_rank_with_its_reason(tmp_path, broken):
    run = tmp_path / "run"
    if broken == "run-dir":
        (tmp_path / "file").write_text("not a directory")
        run = tmp_path / "file" / "run"  # config.yaml cannot be written
        what = "writing"
    else:
        (run / "metrics.jsonl").mkdir(parents=True)  # metrics.jsonl cannot be opened
        what = "opening the metrics sinks"
    proc = run_pretrain(["recipes/shakespeare-char.yaml", *char_overrides(tmp_path)[:3], f"logging.dir={run}",
                         "training.iters=2", "training.global_batch_size=4", "training.micro_batch_size=2",
                         "training.eval_interval=0", "distributed.timeout_minutes=1"], nproc=2,
                        # One case under torchrun itself, whose store lives in its launcher
                        # (rank 0's end does not take it away), one under the tests' launcher,
                        # whose store lives in rank 0 as under mpiexec.
                        launcher="torchrun" if broken == "run-dir" else "tests")
    assert proc.returncode != 0, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    # Rank 1 names rank 0's failure, not a lost peer in a later collective.
    rank1 = [line for line in out.splitlines() if line.startswith("error: rank 1: ")]
    assert len(rank1) == 1 and f"rank 0 failed during {what}" in rank1[0], out
    # A path the user gave that cannot be written is a one-line reason, not a traceback.
    # (torchrun prints a traceback of its own; none of the ranks' frames may show.)
    assert not [line for line in out.splitlines() if line.strip().startswith('File "') and
                "megatron_lite" in line], out
