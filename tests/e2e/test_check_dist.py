"""tools/check_dist.py: passes on 4 gloo ranks with a tensor × data layout and under the DeepSpeed
launcher, and fails naming the rank when one rank has a wrong group or stops answering
(launch/polaris.sh's CHECK=1 path is in test_launch.py)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO, _free_port, cpu_env, torchrun


def _run(script: str, nproc: int, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [*torchrun(nproc), str(REPO / script), *args]
    return subprocess.run(cmd, cwd=REPO, env={**cpu_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=300)


def test_four_ranks_pass_every_group_and_collective():
    proc = _run("tools/check_dist.py", 4, "recipes/shakespeare-char.yaml", "parallel.tensor=2",
                "--iters", "2", "--timeout-s", "60")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "check_dist: 4 ranks up; layout tensor 2 × ulysses 1 × context 1 × data 2 × pipeline 1" in out
    for rank in range(4):  # the per-rank table: rank, host, local rank, launcher
        assert any(line.split()[:1] == [str(rank)] and "torchrun" in line for line in out.splitlines())
    for group, ranks in [("tensor", "[0, 1]"), ("tensor", "[2, 3]"), ("data", "[0, 2]"), ("data", "[1, 3]")]:
        for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            assert f"{group:<14} {ranks:<20} {op:<15}" in out, (group, ranks, op)
    for group in ("control", "checkpoint", "setup", "watch", "world"):
        assert f"{group:<14} {'[0, 1, 2, 3]':<20} {'all_reduce':<15}" in out
    assert "DS_ACCELERATOR=cpu" in out and "LOCAL_RANK=0   (differs on ranks [1, 2, 3])" in out
    assert "groups of one rank (created and checked, no traffic): context, pipeline, sequence, ulysses" in out
    assert "check_dist: OK (4 ranks, 12 groups per rank)" in out


def test_the_deepspeed_launcher_runs_it_on_a_pipeline_layout():
    # The launcher passes --local_rank to the script and sets RANK/LOCAL_RANK/WORLD_SIZE itself.
    # Two pipeline stages: their embedding group (the first and last stage) is checked too.
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
           str(_free_port()), str(REPO / "tools/check_dist.py"), "recipes/shakespeare-char.yaml",
           "parallel.pipeline=2", "--iters", "1", "--timeout-s", "60"]
    proc = subprocess.run(cmd, cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("check_dist: 2 ranks up; layout tensor 1 × ulysses 1 × context 1 × data 1 × pipeline 2"
            in proc.stdout)
    assert any(line.split()[:2] == ["embedding", "[0,"] for line in proc.stdout.splitlines()), proc.stdout
    assert "LOCAL_RANK=0   (differs on ranks [1])" in proc.stdout
    assert "check_dist: OK (2 ranks" in proc.stdout


def test_a_wrong_group_on_one_rank_is_named():
    proc = _run("tests/e2e/wrong_group_check_dist.py", 2, "parallel.tensor=2", "--timeout-s", "60")
    assert proc.returncode != 0
    assert "check_dist: FAILED on rank 0" in proc.stderr, proc.stderr[-3000:]
    assert "rank 1: group 'tensor' has ranks [1], the layout says [0, 1]" in proc.stderr
    assert "rank 1: group 'data' has ranks [0, 1], the layout says [1]" in proc.stderr


def test_a_rank_that_stops_answering_is_named():
    proc = _run("tools/check_dist.py", 2, "--timeout-s", "10",
                env={"DIST_HARNESS_STALL": "1:all_present:2:600"})
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "[harness] rank 1 stalls" in out
    assert "check_dist: FAILED on rank 0" in out, out[-3000:]
    assert "waiting for every rank before all_reduce on group 'checkpoint'" in out
    assert "Rank 1 failed to pass monitoredBarrier" in out, out[-3000:]


def test_a_bad_recipe_is_a_usage_error_before_any_rank_waits(tmp_path):
    """Exit status 2, as pretrain.py gives a bad recipe: nothing was tried on the network."""
    proc = subprocess.run([sys.executable, str(REPO / "tools/check_dist.py"), f"{tmp_path}/nope.yaml"],
                          cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"recipe file '{tmp_path}/nope.yaml' does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr and "starting" not in proc.stdout
