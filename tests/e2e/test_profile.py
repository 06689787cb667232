"""Profiling on demand: profile.steps writes one Chrome trace per profiled rank."""

from __future__ import annotations

import json

from tests.conftest import char_overrides, check, run_pretrain


def test_profile_steps_write_a_trace_of_those_steps(tmp_path):
    proc = check(run_pretrain(["recipes/shakespeare-char.yaml", *char_overrides(tmp_path),
                               "training.iters=5", "training.eval_interval=1000", "training.eval_iters=1",
                               "training.sample_tokens=0", "profile.steps=[2,3]"]))
    traces = sorted((tmp_path / "run" / "profile").glob("rank0*.pt.trace.json"))
    assert len(traces) == 1, list((tmp_path / "run").rglob("*"))
    trace = json.loads(traces[0].read_text())  # what chrome://tracing, Perfetto and TensorBoard read
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {n for n in names if n and n.startswith("train_step#")} == {"train_step#2", "train_step#3"}
    assert any(n and "aten::" in n for n in names)  # the operators of the steps
    assert "profile of steps 2-3 (rank 0) written to" in proc.stdout


def test_a_bad_profile_window_is_refused_naming_the_key(tmp_path):
    proc = run_pretrain(["recipes/shakespeare-char.yaml", *char_overrides(tmp_path), "profile.steps=[3,2]"])
    assert proc.returncode == 2 and "'profile.steps' = [3, 2]" in proc.stderr


def test_hsdp_replica_all_reduces_start_during_the_backward_pass(tmp_path):
    """HSDP 2 × 2: the trace of rank 0 shows its replica all-reduces beginning while backward
    operators still run (each bucket's as soon as ZeRO-3 has reduce-scattered it), not after.
    No other all-reduce runs inside this layout's backward pass."""
    check(run_pretrain(["recipes/shakespeare-char.yaml", *char_overrides(tmp_path), "parallel.hsdp=true",
                        "parallel.hsdp_shard_size=2", "training.micro_batch_size=3", "training.iters=2",
                        "training.eval_interval=1000", "training.eval_iters=1", "training.sample_tokens=0",
                        "profile.steps=[2,2]",
                        # Buckets of 50k elements: this 0.8M-parameter model's gradients in ~20.
                        "deepspeed.zero_optimization.reduce_bucket_size=50000"], nproc=4))
    trace = json.loads(next((tmp_path / "run" / "profile").glob("rank0*.pt.trace.json")).read_text())
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    backward_end = max(e["ts"] + e["dur"] for e in spans if e["name"].startswith("autograd::engine::"))
    all_reduces = sorted(e["ts"] for e in spans if e["name"] == "c10d::allreduce_")
    reduce_scatters = [e for e in spans if e["name"] == "c10d::_reduce_scatter_base_"]
    assert len(reduce_scatters) > 10  # the buckets
    assert all_reduces and all_reduces[0] < backward_end
    # Most of the shard's pieces are on their way before the backward pass ends.
    assert sum(t < backward_end for t in all_reduces) > len(all_reduces) / 2, (len(all_reduces), backward_end)
