"""launch/ray_train.py on Ray clusters of this machine: two gloo workers train shakespeare-char
with torchrun's per-step losses; a worker killed mid-run is replaced by Ray, the run resuming from
the newest committed checkpoint with the uninterrupted losses, bit for bit; SIGTERM to the launcher
or to a worker saves every rank's checkpoint at one step and ends the run with status 0; a
rendezvous host that is not rank 0's node is ignored with a warning; secrets reach the workers
but never Ray's records."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, char_overrides, check, cpu_env, read_metrics, run_pretrain

ITERS, SAVE_EVERY, STOP_AT = 60, 10, 30
SLOW_FROM = STOP_AT * 24  # the first slow training sample (global batch 24)
ELSEWHERE = "198.51.100.7"
"""An address of no machine (TEST-NET-2): a MASTER_ADDR that is not rank 0's node."""
SECRET = "wandb-test-0f1e2d3c4b5a69788796a5b4c3d2e1f0"


def recipe(tmp, run: str, iters: int = ITERS) -> list[str]:
    return ["recipes/shakespeare-char.yaml", *char_overrides(tmp)[:3], f"logging.dir={tmp}/{run}",
            f"training.iters={iters}", "training.log_interval=1", "training.eval_interval=1000",
            "training.eval_iters=2", "training.global_batch_size=24", "training.sample_tokens=0"]


def losses(records: list[dict]) -> dict[int, float]:
    """Step -> loss; a step logged twice (before a failure and again after the resume) keeps
    its last value."""
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@contextlib.contextmanager
def ray_cluster(records: Path, env: dict[str, str]) -> Iterator[str]:
    """A Ray cluster of this machine started in a process of its own, as ``ray start --head``
    starts one, with ``env`` added to the test environment (its workers inherit it: not the
    launcher's secrets); Ray writes its records (logs, session files) under ``records``. Yields
    its address."""
    env = {**cpu_env(), **env, "RAY_TMPDIR": str(records), "RAY_AUTH_MODE": "disabled"}
    head = subprocess.Popen([sys.executable, "-c", "import ray, time; ray.init(include_dashboard=False); "
                             "print(ray.get_runtime_context().gcs_address, flush=True); time.sleep(3600)"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert head.stdout is not None
        yield head.stdout.readline().strip()
    finally:
        head.terminate()  # ray.init's handler: shuts its cluster down
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[str, Path]]:
    """One Ray cluster for this module's runs (starting one costs more than most of them):
    (its address, the folder of its records). Its workers read training samples from
    ``SLOW_FROM`` on 0.02 s late (0.24 s per step at 12 samples per rank): the cluster test's stop
    comes before its run's end however fast the machine; the other runs end long before those
    samples."""
    # Short: Ray's socket paths under it must fit in 107 characters.
    records = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    try:
        with ray_cluster(records, {"FAULT_SLOW_DATA": f"{SLOW_FROM}:{ITERS * 24}:0.02"}) as address:
            yield address, records
    finally:
        shutil.rmtree(records, ignore_errors=True)


def launch(cmd: list[str], env: dict[str, str], on_line: Callable[[str, subprocess.Popen], None],
           timeout: float) -> tuple[int, str]:
    """Run the launcher, handing each output line to ``on_line``; (exit status, output)."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            on_line(line, proc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=10)
    return proc.returncode, "".join(lines)


def worker_pid(line: str, rank: int) -> int | None:
    """The process of ``rank`` from Ray's line about a worker group it started."""
    m = re.search(rf"pid=(\d+)\) world_rank={rank}\b", line)
    return int(m.group(1)) if m else None


def logged_step(line: str) -> int | None:
    m = re.search(r"\bstep\s+(\d+)/\d+ \|", line)
    return int(m.group(1)) if m else None


def files_holding(text: str, *roots: Path) -> list[Path]:
    needle = text.encode()
    return [p for root in roots for p in root.rglob("*")
            if p.is_file() and not p.is_symlink() and needle in p.read_bytes()]


def test_ray_cluster_matches_torchrun_resumes_after_a_kill_and_saves_when_stopped(tmp_path, cluster):
    address, records = cluster

    check(run_pretrain(recipe(tmp_path, "torchrun"), nproc=2))
    reference = losses(read_metrics(tmp_path / "torchrun"))
    assert sorted(reference) == list(range(1, ITERS + 1))

    ckpt = tmp_path / "ckpt"
    launcher_tmp = tmp_path / "launcher_tmp"
    launcher_tmp.mkdir()
    # The launcher's shell names a rendezvous host that is not rank 0's node, and a secret.
    env = {**cpu_env(), "MASTER_ADDR": ELSEWHERE, "WANDB_API_KEY": SECRET, "TMPDIR": str(launcher_tmp),
           "RAY_AUTH_MODE": "disabled"}
    killed: list[int] = []
    rank1: list[int] = []
    stopped: list[int] = []
    resumed: list[str] = []

    def on_line(line: str, proc: subprocess.Popen) -> None:
        if (pid := worker_pid(line, 1)) and not rank1:
            rank1.append(pid)
        # The first checkpoint is committed and training goes on: kill rank 1's process.
        if not killed and rank1 and f"saved checkpoint {ckpt}/step_{SAVE_EVERY:08d}" in line:
            os.kill(rank1[0], signal.SIGKILL)
            killed.append(rank1[0])
        if "resumed from" in line:
            resumed.append(line)
        # Well after the resume: stop the job as `ray job stop` or a scheduler does.
        if resumed and not stopped and (logged_step(line) or 0) >= STOP_AT:
            os.kill(proc.pid, signal.SIGTERM)
            stopped.append(logged_step(line) or 0)

    # Steps after STOP_AT read slowly (the cluster fixture): the stop, which takes a few steps to
    # reach the workers, comes before the run's end however fast the machine.
    status, out = launch(
        [sys.executable, str(REPO / "launch" / "ray_train.py"), *recipe(tmp_path, "ray"),
         f"checkpoint.dir={ckpt}", f"checkpoint.save_interval={SAVE_EVERY}",
         "checkpoint.keep_last=10", "--num-workers", "2", "--max-failures", "1",
         "--report-interval", "20", "--address", address], env, on_line, timeout=420)
    (tmp_path / "launcher.log").write_text(out)
    assert status == 0, out[-6000:]
    assert killed, f"the run ended before its first checkpoint was reported\n{out[-4000:]}"
    assert stopped, f"the run ended before step {STOP_AT} after its resume\n{out[-4000:]}"

    # Both times the workers started, rank 0 ignored MASTER_ADDR, which is not its node, and
    # the ranks met on loopback (the whole job is on rank 0's node).
    meetings = re.findall(r"rendezvous at (\S+):(\d+)", out)
    assert len(meetings) == 2 and {host for host, _ in meetings} == {"127.0.0.1"}, meetings
    assert out.count(f"warning: MASTER_ADDR={ELSEWHERE} is not an address of the node Ray placed "
                     "rank 0 on") == 2, out[-6000:]
    # The workers had the secret, from the launcher's private file (their cluster lacks it) ...
    assert out.count("ray: secrets (kept out of Ray's records): WANDB_API_KEY from the launcher's "
                     "private file") == 2, out[-6000:]
    # ... which is gone, and the value is in none of Ray's records or the run's files.
    assert not list(launcher_tmp.glob("megatron_lite-ray-*"))
    assert SECRET not in out
    assert files_holding(SECRET, records, tmp_path) == []

    resumes = re.findall(rf"resumed from {ckpt}/step_(\d+) at step (\d+)", out)
    assert len(resumes) == 1, out[-6000:]
    resume_step = int(resumes[0][1])
    assert SAVE_EVERY <= resume_step < STOP_AT

    # SIGTERM to the launcher: every rank saved at the step it reached, and the run ended.
    stop = re.findall(r"stopping at step (\d+): signal SIGTERM \(to the launcher\)", out)
    assert len(stop) == 1, out[-6000:]
    last = int(stop[0])
    assert stopped[0] <= last < ITERS
    assert f"saved checkpoint {ckpt}/step_{last:08d}" in out
    assert (ckpt / "latest").read_text().strip() == f"step_{last:08d}"
    assert f"ray: stopped by SIGTERM; the checkpoint of the last step is in {ckpt}" in out

    got = losses(read_metrics(tmp_path / "ray"))
    assert sorted(got) == list(range(1, last + 1))
    # Ray's two workers compute what torchrun's two processes compute ...
    torch.testing.assert_close(torch.tensor([got[s] for s in sorted(got)], dtype=torch.float64),
                               torch.tensor([reference[s] for s in sorted(got)], dtype=torch.float64),
                               rtol=1e-5, atol=1e-5)
    # ... and after the resume, exactly what the uninterrupted run computed.
    after = [s for s in sorted(got) if s > resume_step]
    assert [got[s] for s in after] == [reference[s] for s in after]
    # The records went to Ray as well.
    assert f"ray: received the report of step 20: loss {got[20]!r}" in out, out[-3000:]


def test_sigterm_to_a_worker_saves_every_rank_at_one_step_and_ends_the_run(tmp_path, cluster):
    """As SIGTERM to one rank under mpiexec (a node shutting down): the other rank learns of it
    at the next step, both save that step, and the launcher exits 0."""
    ckpt = tmp_path / "ckpt"
    sent: list[int] = []
    rank1: list[int] = []

    def on_line(line: str, proc: subprocess.Popen) -> None:
        if (pid := worker_pid(line, 1)) and not rank1:
            rank1.append(pid)
        if rank1 and not sent and (logged_step(line) or 0) >= 3:
            os.kill(rank1[0], signal.SIGTERM)
            sent.append(logged_step(line) or 0)

    status, out = launch([sys.executable, str(REPO / "launch" / "ray_train.py"),
                          *recipe(tmp_path, "run", 200), f"checkpoint.dir={ckpt}",
                          "checkpoint.save_interval=1000", "--num-workers", "2",
                          "--report-interval", "1000", "--address", cluster[0]],
                         {**cpu_env(), "RAY_AUTH_MODE": "disabled"}, on_line, timeout=300)
    assert status == 0 and sent, out[-6000:]
    stop = re.findall(r"stopping at step (\d+): signal received by another rank", out)
    assert len(stop) == 1, out[-6000:]
    last = int(stop[0])
    assert sent[0] <= last < 200
    assert (ckpt / "latest").read_text().strip() == f"step_{last:08d}"
    assert sorted(losses(read_metrics(tmp_path / "run"))) == list(range(1, last + 1))


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


def test_a_failing_worker_ends_the_launcher_with_its_reason(tmp_path, cluster):
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "ray_train.py"),
                           "recipes/shakespeare-char.yaml", f"data.prefix={tmp_path}/missing",
                           "data.build_from=null", "training.global_batch_size=24",
                           f"logging.dir={tmp_path}/run", "--num-workers", "2", "--address", cluster[0]],
                          cwd=REPO, env={**cpu_env(), "RAY_AUTH_MODE": "disabled"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"error: training failed on Ray \(--max-failures 0\): rank [01]: "
        rf"dataset '{tmp_path}/missing.bin/.idx' "
        "does not exist; build it with tools/preprocess_data.py or set data.build_from to the raw text "
        "to build it from", last), proc.stderr[-3000:]
