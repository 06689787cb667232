"""bench/step.py runs end to end and reports what docs/performance.md says (no timing asserted)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.conftest import NO_TENSORBOARD, REPO, char_overrides, cpu_env

SHORT = ["--warmup", "1", "--steps", "2", "--rounds", "1", "--breakdown", "1"]


@pytest.mark.parametrize("kind", ["gpt2-style-dataset", "llama-synthetic"])
def test_bench_step_reports_throughput_breakdown_and_ratio(tmp_path, kind):
    if kind == "gpt2-style-dataset":
        args = ["recipes/shakespeare-char.yaml", *char_overrides(tmp_path)[:3]]
    else:
        args = ["recipes/quickstart.yaml", "model.vocab_size=512", "model.n_layers=2", "model.d_model=64",
                "model.n_heads=4", "model.n_kv_heads=2", "data.seq_length=32", "training.micro_batch_size=2",
                "training.global_batch_size=4", "--synthetic"]
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench/step.py"), *args, *SHORT, "--json", str(out)],
                          cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["world_size"] == 1 and r["step_ms"] > 0 and r["mfu"] is None  # CPU: no peak
    assert r["tokens_per_sec"] == pytest.approx(r["tokens_per_step"] / r["step_ms"] * 1000)
    assert set(r["breakdown_ms"]) == {"data wait", "forward", "backward", "optimizer",
                                      "communication (in backward/optimizer)"}
    assert r["baseline_step_ms"] > 0 and r["ratio_vs_transformers"] == pytest.approx(
        r["baseline_step_ms"] / r["step_ms"])
    assert "transformers plain loop" in proc.stdout


def test_bench_cpu_threads_times_every_case():
    """bench/cpu_threads.py runs each way of sharing two cores (the all-reduce case through a real
    two-process gloo group) and prints a ratio for each."""
    from bench.cpu_threads import CASES

    small = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "training.micro_batch_size=4",
             "training.global_batch_size=4"]
    command = [sys.executable, str(REPO / "bench/cpu_threads.py"), "recipes/shakespeare-char.yaml",
               "--steps", "5", "--rounds", "1", "--cores", "2", *small]
    proc = subprocess.run(command, cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = {c: line for c in CASES for line in proc.stdout.splitlines() if line.strip().startswith(c + " ")}
    assert set(lines) == set(CASES), proc.stdout
    for line in lines.values():
        assert float(line.split("ms/step")[0].split()[-1]) > 0 and "baseline / case" in line


def test_bench_loss_speed_names_the_path_the_trainer_takes():
    """bench/loss_speed.py times both loss paths on every shape and names the one the trainer
    takes for it (the plain loss up to SMALL_LOGITS)."""
    from megatron_lite.model.loss import SMALL_LOGITS

    proc = subprocess.run([sys.executable, str(REPO / "bench/loss_speed.py"), "--rounds", "1"], cwd=REPO,
                          env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if "plain / fused" in line]
    assert len(rows) == 7, proc.stdout
    for row in rows:
        tokens, vocab = (int(x) for x in row.split("(")[0].split(" x "))
        assert row.endswith("plain" if tokens * vocab <= SMALL_LOGITS else "fused"), row


def test_bench_lean_loop_times_both_loops_with_the_same_evaluation(tmp_path):
    """bench/lean_loop.py runs ours and the nanoGPT-structure loop in one invocation and prints
    the ratio, each run's validation loss and phases. Run without DS_ACCELERATOR (ours picks its
    accelerator from training.device, as a user's run does)."""
    env = {k: v for k, v in cpu_env().items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run([sys.executable, str(REPO / "bench/lean_loop.py"), "--iters", "4", "--rounds", "1",
                           f"--prefix={tmp_path}/data/tiny_text_document", *char_overrides(tmp_path)[:3],
                           NO_TENSORBOARD, "training.eval_interval=2", "training.eval_iters=2",
                           "training.sample_tokens=5"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    round1 = re.search(r"round 1: ours [0-9.]+ s \(val ([0-9.]+)\) \| lean loop [0-9.]+ s \(val ([0-9.]+)\) "
                       r"\| lean / ours ([0-9.]+)", proc.stdout)
    assert round1, proc.stdout
    ours, lean, ratio = map(float, round1.groups())
    assert 0 < ours < 5 and 0 < lean < 5 and ratio > 0  # character-level losses start near ln 65
    assert re.search(r"ours: startup [0-9.]+ s, training [0-9.]+ s, evaluation [0-9.]+ s", proc.stdout)
    assert "4 iterations, 1 rounds: lean / ours median" in proc.stdout
