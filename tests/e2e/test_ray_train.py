"""launch/ray_train.py on Ray clusters of this machine: two gloo workers train shakespeare-char
with torchrun's per-step losses; a worker killed mid-run is replaced by Ray, the run resuming from
the newest committed checkpoint with the uninterrupted losses, bit for bit; SIGTERM to the launcher
or to a worker, or a node that Ray drains (a preemption), saves every rank's checkpoint at one
step and ends the run with status 0; a rendezvous host that is not rank 0's node is ignored with
a warning; secrets reach the workers but never Ray's records."""

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import REPO, char_overrides, check, cpu_env, read_metrics, run_pretrain

ITERS, SAVE_EVERY, STOP_AT = 60, 10, 30
SLOW_FROM = STOP_AT * 24  # the first slow training sample (global batch 24)
ELSEWHERE = "198.51.100.7"
"""An address of no machine (TEST-NET-2): a MASTER_ADDR that is not rank 0's node."""
SECRET = "wandb-test-0f1e2d3c4b5a69788796a5b4c3d2e1f0"
WORKERS_NODE = "c0ffee" * 9 + "00"
"""The id of the node the workers start on (a Ray node id: 28 bytes in hex)."""


def recipe(tmp, run: str, iters: int = ITERS) -> list[str]:
    return ["recipes/shakespeare-char.yaml", *char_overrides(tmp)[:3], f"logging.dir={tmp}/{run}",
            f"training.iters={iters}", "training.log_interval=1", "training.eval_interval=1000",
            "training.eval_iters=2", "training.global_batch_size=24", "training.sample_tokens=0"]


def losses(records: list[dict]) -> dict[int, float]:
    """Step -> loss; a step logged twice (before a failure and again after the resume) keeps
    its last value."""
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@contextlib.contextmanager
def ray_cluster(records: Path, env: dict[str, str], num_cpus: int | None = None) -> Iterator[tuple[str, str]]:
    """A Ray cluster of this machine started in a process of its own, as ``ray start --head``
    starts one, with ``env`` added to the test environment (its workers inherit it: not the
    launcher's secrets), of ``num_cpus`` CPUs (the machine's by default); Ray writes its records
    (logs, session files) under ``records``. Yields its address and its node's id."""
    env = {**cpu_env(), **env, "RAY_TMPDIR": str(records), "RAY_AUTH_MODE": "disabled"}
    head = subprocess.Popen([sys.executable, "-c", f"import ray, time; ray.init(include_dashboard=False, "
                             f"num_cpus={num_cpus}); "
                             "c = ray.get_runtime_context(); print(c.gcs_address, c.get_node_id(), "
                             "flush=True); time.sleep(3600)"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert head.stdout is not None
        address, node = head.stdout.readline().split()
        yield address, node
    finally:
        head.terminate()  # ray.init's handler: shuts its cluster down
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)


@contextlib.contextmanager
def ray_node(address: str, cpus: int, records: Path, env: dict[str, str],
             node_id: str | None = None) -> Iterator[None]:
    """One more Ray node of this machine in ``address``'s cluster, as ``ray start`` on another
    host joins it, with ``env`` added to the test environment and the id ``node_id`` (Ray's own
    testing hook; a random one by default); removed (its processes killed) at the end. Its
    records go to a folder of its own under ``records``, as on another host (in one folder, each
    node's log monitor would pass every worker's lines to the driver)."""
    env = {**cpu_env(), **env, "RAY_AUTH_MODE": "disabled"}
    if node_id:
        env["RAY_OVERRIDE_NODE_ID_FOR_TESTING"] = node_id
    # A node's raylet waits for its dashboard agent, and `ray start` for the raylet, 30 s at most
    # (fixed in Ray): with both cores busy (the other test worker) the agent's start has taken
    # longer. Such a start is retried once; anything else fails at once.
    for attempt in (1, 2):
        own = tempfile.mkdtemp(prefix="n", dir=records)
        node = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", f"--address={address}",
                                 f"--num-cpus={cpus}", f"--temp-dir={own}", "--block"], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        assert node.stdout is not None
        said = []
        for line in node.stdout:
            said.append(line)
            if "Ray runtime started" in line:
                break
        else:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait(timeout=60)
            if attempt == 1 and "timed out during startup" in "".join(said):
                continue
            raise AssertionError("the Ray node did not start:\n" + "".join(said[-40:]))
        break
    try:
        threading.Thread(target=node.stdout.read, daemon=True).start()  # its pipe never fills
        yield
    finally:
        os.killpg(node.pid, signal.SIGKILL)
        node.wait(timeout=60)


@dataclass
class Cluster:
    """A Ray cluster of this machine: a head without CPUs (the launcher's node, which stays) and
    one node of 2 CPUs that takes the workers, ``workers_node``."""

    address: str
    records: Path
    workers_node: str
    env: dict[str, str]
    nodes: contextlib.ExitStack

    def add_node(self) -> None:
        """Another node of 2 CPUs joins, kept to the cluster's end (an autoscaler's replacement)."""
        self.nodes.enter_context(ray_node(self.address, 2, self.records, self.env))


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """One Ray cluster for this module's runs (starting one costs more than most of them). Its
    workers read training samples from ``SLOW_FROM`` on 0.02 s late (0.24 s per step at 12
    samples per rank): the cluster test's stop comes before its run's end however fast the
    machine; the other runs end long before those samples or do not depend on their pace."""
    # Short: Ray's socket paths under it must fit in 107 characters.
    records = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    # Ray Train's preemption watcher polls every 5 s by default: at 1 s, the restart follows the
    # deadline sooner (the test's time, not what it checks).
    env = {"FAULT_SLOW_DATA": f"{SLOW_FROM}:{ITERS * 24}:0.02", "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1"}
    try:
        with ray_cluster(records, env, num_cpus=0) as (address, _), contextlib.ExitStack() as nodes:
            nodes.enter_context(ray_node(address, 2, records, env, node_id=WORKERS_NODE))
            yield Cluster(address, records, WORKERS_NODE, env, nodes)
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
    address, records = cluster.address, cluster.records

    check(run_pretrain(recipe(tmp_path, "torchrun"), nproc=2, launcher="torchrun"))
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


def test_a_preempted_node_saves_and_the_run_goes_on_elsewhere_until_a_worker_is_stopped(tmp_path, cluster):
    """A preemption as Ray sees it (the cloud's or KubeRay's notice, ``ray start`` given
    SIGTERM): Ray drains the node, ends its workers at the deadline without a signal and starts
    the group on other nodes. Here the workers' node is drained with Ray's own command, as its
    autoscaler does, and a replacement node joins: every rank saves at one step before the
    deadline, the new group resumes from that save and computes the steps the first group had
    run past it, bit for bit. Then SIGTERM to one worker, as to one rank under mpiexec (a node
    shutting down): every rank saves at one step and the launcher exits 0."""
    ckpt = tmp_path / "ckpt"
    env = {**cpu_env(), **cluster.env, "RAY_AUTH_MODE": "disabled"}
    events: dict[str, Any] = {}

    def on_line(line: str, proc: subprocess.Popen) -> None:
        if "drain" not in events and (logged_step(line) or 0) >= 3:
            events["drain"] = subprocess.run(
                [sys.executable, "-m", "ray.scripts.scripts", "drain-node", "--address", cluster.address,
                 "--node-id", cluster.workers_node, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                 "--reason-message", "spot instance reclaimed", "--deadline-remaining-seconds", "6"],
                cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
            cluster.add_node()
        if (pid := worker_pid(line, 1)) and "drain" in events:
            events["rank1"] = pid  # of the group Ray started elsewhere
        if "resumed from" in line:
            events["resumed"] = True
        # The run went on elsewhere: end it with SIGTERM to one worker, as a node shutting down
        # under mpiexec does; the other rank learns of it at the next step.
        if "resumed" in events and "stop" not in events and "rank1" in events \
                and (logged_step(line) or 0) > 0:
            events["stop"] = logged_step(line) or 0
            os.kill(events["rank1"], signal.SIGTERM)

    status, out = launch([sys.executable, str(REPO / "launch" / "ray_train.py"),
                          *recipe(tmp_path, "run", 2000), f"checkpoint.dir={ckpt}",
                          "checkpoint.save_interval=1000", "--num-workers", "2", "--report-interval", "1000",
                          "--address", cluster.address], env, on_line, timeout=300)
    (tmp_path / "launcher.log").write_text(out)
    drain = events.get("drain")
    assert isinstance(drain, subprocess.CompletedProcess) and drain.returncode == 0, (drain, out[-6000:])
    assert status == 0, out[-6000:]
    saved = re.findall(rf"saving at step (\d+): Ray drains node {cluster.workers_node[:12]} "
                       r"\(ranks 0, 1; its deadline is in \d+ s\)", out)
    assert len(saved) == 1, out[-6000:]
    step = int(saved[0])
    assert f"saved checkpoint {ckpt}/step_{step:08d}" in out
    assert re.search(rf"resumed from {ckpt}/step_{step:08d} at step {step}\b", out), out[-6000:]
    # The new group recomputed the steps the first one had run past the save, bit for bit.
    records_ = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    first: dict[int, float] = {}
    again: dict[int, float] = {}
    for r in records_:
        (again if r["step"] in first and r["step"] > step else first).setdefault(r["step"], r["loss"])
    assert again, "the first group ran no step past the save before the deadline"
    assert {s: first[s] for s in again} == again
    # SIGTERM to a worker: every rank saved the step it reached, and the run ended with status 0.
    stop = re.findall(r"stopping at step (\d+): signal received by another rank", out)
    assert len(stop) == 1, out[-6000:]
    last = int(stop[0])
    assert events["stop"] <= last < 2000
    assert (ckpt / "latest").read_text().strip() == f"step_{last:08d}"
    assert records_[-1]["step"] == last


@pytest.mark.parametrize("args,says", [
    (["training.itres=5", "--num-workers", "2"], "training.itres"),
    (["--num-workers", "2"], "training.global_batch_size=12 is not a multiple"),  # the layout for 2
    (["--num-workers", "0"], "--num-workers 0: must be at least 1"),
    (["--num-workers", "2", "--max-failures", "-1"], "--max-failures -1: must be 0 or more"),
    (["--num-workers", "2", "--cpus-per-worker", "0"], "--cpus-per-worker 0: must be more than 0"),
    # Nobody listens there: one line at once (Ray itself retries for minutes).
    (["--num-workers", "2", "training.global_batch_size=24", "--address", "127.0.0.1:1"],
     "--address 127.0.0.1:1: no Ray cluster reached (ConnectionRefusedError"),
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
                           f"logging.dir={tmp_path}/run", "--num-workers", "1", "--address", cluster.address],
                          cwd=REPO, env={**cpu_env(), "RAY_AUTH_MODE": "disabled"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"error: training failed on Ray \(--max-failures 0\): rank 0: "
        rf"dataset '{tmp_path}/missing.bin/.idx' "
        "does not exist; build it with tools/preprocess_data.py or set data.build_from to the raw text "
        "to build it from", last), proc.stderr[-3000:]
