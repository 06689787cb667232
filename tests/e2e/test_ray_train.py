"""launch/ray_train.py on a local Ray cluster: two gloo workers train shakespeare-char with
torchrun's per-step losses, and a worker killed mid-run is replaced by Ray, the run resuming from
the newest committed checkpoint and finishing with the uninterrupted losses, bit for bit."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import pytest
import torch

from tests.conftest import REPO, char_overrides, check, cpu_env, read_metrics, run_pretrain

ITERS, SAVE_EVERY = 60, 10


def recipe(tmp, run: str) -> list[str]:
    return ["recipes/shakespeare-char.yaml", *char_overrides(tmp)[:3], f"logging.dir={tmp}/{run}",
            f"training.iters={ITERS}", "training.log_interval=1", "training.eval_interval=1000",
            "training.eval_iters=2", "training.global_batch_size=24", "training.sample_tokens=0"]


def losses(records: list[dict]) -> dict[int, float]:
    """Step -> loss; a step logged twice (before a failure and again after the resume) keeps
    its last value."""
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_ray_matches_torchrun_and_resumes_after_a_worker_is_killed(tmp_path):
    import ray  # noqa: F401  (an optional extra: pip install -e .[ray], part of .[test])

    check(run_pretrain(recipe(tmp_path, "torchrun"), nproc=2))
    reference = losses(read_metrics(tmp_path / "torchrun"))
    assert sorted(reference) == list(range(1, ITERS + 1))

    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, str(REPO / "launch" / "ray_train.py"), *recipe(tmp_path, "ray"),
           f"checkpoint.dir={ckpt}", f"checkpoint.save_interval={SAVE_EVERY}", "checkpoint.keep_last=10",
           "--num-workers", "2", "--max-failures", "1", "--report-interval", "20"]
    env = {k: v for k, v in cpu_env().items() if k != "MASTER_ADDR"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[str] = []
    killed: list[int] = []
    first_rank1: list[int] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"pid=(\d+)\) world_rank=1\b", line)
            if m and not first_rank1:
                first_rank1.append(int(m.group(1)))
            # The first checkpoint is committed and training goes on: kill rank 1's process.
            if not killed and first_rank1 and f"saved checkpoint {ckpt}/step_{SAVE_EVERY:08d}" in line:
                os.kill(first_rank1[0], signal.SIGKILL)
                killed.append(first_rank1[0])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=420)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=10)
    out = "".join(lines)
    (tmp_path / "launcher.log").write_text(out)
    assert proc.returncode == 0, out[-6000:]
    assert killed, f"the run ended before its first checkpoint was reported\n{out[-4000:]}"

    # The rendezvous stayed on loopback, both times the workers started.
    meetings = re.findall(r"rendezvous at (\S+):(\d+)", out)
    assert len(meetings) == 2 and {host for host, _ in meetings} == {"127.0.0.1"}, meetings
    resumed = re.findall(rf"resumed from {ckpt}/step_(\d+) at step (\d+)", out)
    assert len(resumed) == 1, out[-6000:]
    resume_step = int(resumed[0][1])
    assert SAVE_EVERY <= resume_step < ITERS

    got = losses(read_metrics(tmp_path / "ray"))
    assert sorted(got) == list(range(1, ITERS + 1))
    # Ray's two workers compute what torchrun's two processes compute ...
    torch.testing.assert_close(torch.tensor([got[s] for s in sorted(got)], dtype=torch.float64),
                               torch.tensor([reference[s] for s in sorted(got)], dtype=torch.float64),
                               rtol=1e-5, atol=1e-5)
    # ... and after the resume, exactly what the uninterrupted run computed.
    after = [s for s in sorted(got) if s > resume_step]
    assert [got[s] for s in after] == [reference[s] for s in after]
    # The records went to Ray as well, the last step's among them.
    assert f"ray: received the report of step {ITERS}: loss {got[ITERS]!r}" in out, out[-3000:]


@pytest.mark.parametrize("args,says", [
    (["training.itres=5", "--num-workers", "2"], "training.itres"),
    (["--num-workers", "2"], "training.global_batch_size=12 is not a multiple"),  # the layout for 2
    (["--num-workers", "0"], "--num-workers 0: must be at least 1"),
])
def test_ray_launcher_refuses_bad_input_before_starting_ray(args, says):
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "ray_train.py"),
                           "recipes/shakespeare-char.yaml", *args], cwd=REPO, env=cpu_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert "Ray instance" not in proc.stderr + proc.stdout


def test_a_failing_worker_ends_the_launcher_with_its_reason(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "ray_train.py"),
                           "recipes/shakespeare-char.yaml", f"data.prefix={tmp_path}/missing",
                           "data.build_from=null", "training.global_batch_size=24",
                           f"logging.dir={tmp_path}/run", "--num-workers", "2"], cwd=REPO,
                          env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"error: training failed on Ray \(--max-failures 0\): rank [01]: "
        rf"dataset '{tmp_path}/missing.bin/.idx' "
        "does not exist; build it with tools/preprocess_data.py or set data.build_from to the raw text "
        "to build it from", last), proc.stderr[-3000:]
