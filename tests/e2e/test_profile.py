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
