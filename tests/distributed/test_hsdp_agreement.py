"""HSDP's default shard group (one node's ranks) is agreed on by every rank before any group of
the layout exists: nodes with different numbers of ranks are refused on every rank, at once."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.conftest import NO_TENSORBOARD, REPO, _free_port, char_overrides, cpu_env

REFUSAL = "parallel.hsdp: the default shard group is the ranks of one node"


def _launch_by_hand(tmp_path, local_sizes: list[int], *overrides: str) -> list[tuple[int, str]]:
    """pretrain.py as one rank each, with the variables a launcher sets (as torchrun names them):
    each rank believes what its own LOCAL_WORLD_SIZE says."""
    port = str(_free_port())
    args = [sys.executable, str(REPO / "pretrain.py"), "recipes/shakespeare-char.yaml",
            *char_overrides(tmp_path)[:3], "parallel.hsdp=true", "parallel.zero_stage=3",
            "training.iters=2", "training.global_batch_size=8", "training.micro_batch_size=2",
            "training.eval_interval=0", "training.sample_tokens=0", "distributed.timeout_minutes=2",
            f"logging.dir={tmp_path}/run", NO_TENSORBOARD, *overrides]
    procs = []
    for rank, local in enumerate(local_sizes):
        env = {**cpu_env(), "RANK": str(rank), "WORLD_SIZE": str(len(local_sizes)), "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": str(local), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    out = []
    deadline = time.monotonic() + 240
    try:
        for proc in procs:
            text, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((proc.returncode, text))
    finally:
        for proc in procs:
            proc.kill()
    return out


def test_nodes_with_different_rank_counts_are_refused_on_every_rank(tmp_path):
    # A node of three ranks and a node of one (a mis-set hostfile): 3 does not divide the 4 data
    # ranks, 1 does -- each rank alone would refuse or build its own groups and wait.
    # Every rank exits at once (no rank left waiting for the others' groups), with the reason
    # printed once, by rank 0 (a layout error is the same on every rank).
    results = _launch_by_hand(tmp_path, [3, 3, 3, 1])
    assert [code for code, _ in results] == [2, 2, 2, 2], results
    assert REFUSAL in results[0][1] and "ranks 0-2: 3 per node; rank 3: 1 per node" in results[0][1]
    assert not any("Traceback" in text for _, text in results), results
