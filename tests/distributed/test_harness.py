"""Accelerator semantics on CPU (tests/dist_harness): the mistakes NCCL/HCCL would reject fail
here too, a one-process run takes every collective path a multi-process run takes, every group
gets ``distributed.timeout_minutes``, and a stuck rank ends the whole run within the timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil

from tests.conftest import REPO, char_overrides, check, cpu_env, launch_ranks, pretrain_command, run_pretrain
from tests.dist_harness.checks import DEVICE_ROLE, HOST_ROLE


def _launch(script: str, *args: str) -> list[str]:
    return [*launch_ranks(2), str(REPO / script), *args]


def _args(tmp) -> list[str]:
    return ["recipes/shakespeare-char.yaml", *char_overrides(tmp)[:3], "training.log_interval=2",
            "training.eval_interval=0", "training.eval_iters=1", "training.global_batch_size=8",
            "training.micro_batch_size=4", "training.sample_tokens=0", "model.vocab_size=66",
            "model.n_layers=2", "model.d_model=64", "model.n_heads=2"]


def test_the_old_raise_together_fails_naming_the_call(tmp_path):
    proc = subprocess.run(_launch("tests/distributed/old_raise_together.py", *_args(tmp_path),
                                  "training.iters=2", f"logging.dir={tmp_path}/run"),
                          cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "all_reduce of a host (cpu) tensor on the default process group, called at" in out, out[-3000:]
    assert "old_raise_together.py" in out and "in raise_together" in out, out[-3000:]


def test_the_harness_refuses_what_an_accelerator_group_would(tmp_path):
    proc = subprocess.run(_launch("tests/distributed/harness_probe.py", str(tmp_path)), cwd=REPO,
                          env=cpu_env(), capture_output=True, text=True, timeout=300)
    check(proc)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["host tensor, default group"].startswith("AcceleratorSemanticsError: all_reduce of a host")
        assert "harness_probe.py" in got["host tensor, default group"]
        assert got["object, default group"].startswith("AcceleratorSemanticsError: broadcast_object_list")
        assert got["object, accelerator group"].startswith("AcceleratorSemanticsError: broadcast_object_list")
        assert got["device helper, default group"].startswith("CollectiveError: all_reduce: a host (cpu)")
        assert got["p2p, unbatched"].startswith("AcceleratorSemanticsError: isend on an accelerator")
        assert "batch_isend_irecv" in got["p2p, unbatched"]
        assert got["oneccl: AVG"].startswith("AcceleratorSemanticsError: all_reduce with ReduceOp.AVG on an "
                                             "accelerator"), got["oneccl: AVG"]
        assert got["oneccl: BOR"].startswith("AcceleratorSemanticsError: all_reduce with ReduceOp.BOR")
        assert got["oneccl: int16"].startswith("AcceleratorSemanticsError: all_reduce of a int16 tensor")
        assert got["oneccl: split_group"].startswith("AcceleratorSemanticsError: split_group")
        for case in ("control: any_rank", "control: broadcast_object", "control: raise_together",
                     "device: all_reduce", "device: ring_exchange", "oneccl: MAX of int32"):
            assert got[case] == "ok", (case, got[case])
        assert got["any_rank value"] == [True]


def _report(tmp, nproc: int, iters: int, extra: list[str]) -> list[dict]:
    report = tmp / f"report-{nproc}-{iters}"
    check(run_pretrain([*_args(tmp), f"training.iters={iters}", "checkpoint.save_interval=2",
                        f"checkpoint.dir={tmp}/ck{nproc}", f"logging.dir={tmp}/run{nproc}",
                        "distributed.timeout_minutes=3", *extra], nproc=nproc,
                       env={"DIST_HARNESS_REPORT": str(report)}))
    return [json.loads((report / f"rank{r}.json").read_text()) for r in range(nproc)]


def test_one_process_takes_every_collective_path_of_two(tmp_path):
    """A one-GPU run is the only multi-rank path users can try before their allocation: it must
    execute the project's collectives exactly as a two-rank run does (data build agreement,
    stop flags, spike check, checkpoint votes in sync and async saves, resume), and every group,
    DeepSpeed's included, must carry distributed.timeout_minutes."""
    paths, inside_deepspeed = {}, {}
    for nproc in (1, 2):
        first = _report(tmp_path, nproc, 4, ["checkpoint.async_save=true"])
        resumed = _report(tmp_path, nproc, 6, ["checkpoint.async_save=false"])
        reports = first + resumed
        paths[nproc] = {(c["name"], c["role"], c["site"]) for rep in reports for c in rep["calls"]
                        if c["issuer"] == "project"}
        inside_deepspeed[nproc] = {(c["name"], c["role"]) for rep in reports for c in rep["calls"]
                                   if c["issuer"] == "deepspeed"}
        for rep in reports:
            assert rep["world_timeout_s"] == 180.0
            # Every group but the one ranks wait in while the dataset is built (its own timeout,
            # distributed.setup_timeout_minutes: 60 by default) and the hang watchers' (a minute at
            # most: a watcher that stops answering is reported early).
            timeouts = sorted(g["timeout_s"] for g in rep["groups"])
            assert timeouts[0] == 60.0 and timeouts[-1] == 3600.0, rep["groups"]
            assert set(timeouts[1:-1]) == {180.0}, rep["groups"]
            assert {c["role"] for c in rep["calls"]} <= {HOST_ROLE, DEVICE_ROLE}
    sites = {site for _, _, site in paths[2]}
    for expected in ("training/run.py:_run_on_groups", "training/step_report.py:start",
                     "training/trainer.py:_train_record", "checkpoint/save.py:_write_and_commit",
                     "checkpoint/load.py:load", "checkpoint/save.py:save"):
        assert expected in sites, (expected, sorted(sites))
    assert paths[1] == paths[2], {"only with 2": sorted(paths[2] - paths[1]),
                                  "only with 1": sorted(paths[1] - paths[2])}
    # DeepSpeed's gradient all-reduce over a data-parallel group of one is skipped (engine/initialize.py);
    # test_skipping_the_gradient_all_reduce_over_one_rank_changes_nothing proves it equivalent.
    assert inside_deepspeed[2] - inside_deepspeed[1] <= {("all_reduce", DEVICE_ROLE)}


SKIP_CHECK = """
import sys, torch
from megatron_lite.config import load_config
from megatron_lite.distributed import detect, init_distributed
from megatron_lite.model import resolve_model
from megatron_lite.parallel import build_parallel_model
from megatron_lite.engine.versions import GAS_SCALING_ALWAYS, deepspeed_version
from megatron_lite.engine import initialize as engine_module
from megatron_lite.engine.initialize import build_engine
from megatron_lite.training.step import StepRunner
from packaging.version import Version

cfg = load_config("recipes/shakespeare-char.yaml", ["model.n_layers=2", "model.d_model=64",
                  "model.n_heads=2", "model.vocab_size=66", "training.micro_batch_size=2",
                  "training.global_batch_size=4", "training.iters=3", "data.seq_length=32"])
dims, acc = init_distributed(cfg, detect())
data = torch.randint(0, 66, (12, 33), generator=torch.Generator().manual_seed(0))
weights = []
# The shortcut build_engine takes for one rank where DeepSpeed still averages over the
# accumulation steps (2 here) without its all-reduce; older releases do not, and keep it.
taken = deepspeed_version() >= GAS_SCALING_ALWAYS
for allreduce in (False, True) if taken else (True,):
    torch.manual_seed(0)
    model = build_parallel_model(resolve_model(cfg.model, None, 32, 1), dims, "cpu", 1234, "parameters")
    engine = build_engine(model, cfg, dims, 3, "cpu")
    assert engine.enable_backward_allreduce is not taken
    engine.enable_backward_allreduce = allreduce
    runner = StepRunner(cfg, dims, engine, dims.grad_accumulation(cfg))
    batches = iter(data.split(2))
    for _ in range(3):
        runner.train_step(batches, torch.device("cpu"))
    weights.append([p.detach().clone() for p in engine.module.parameters()])
for a, b in (zip(*weights, strict=True) if taken else ()):
    assert torch.equal(a, b)
engine_module.deepspeed_version = lambda: Version("0.16.1+hpu")  # Habana's fork: declined
model = build_parallel_model(resolve_model(cfg.model, None, 32, 1), dims, "cpu", 1234, "parameters")
assert build_engine(model, cfg, dims, 3, "cpu").enable_backward_allreduce is True
print("equal")
from megatron_lite.distributed.startup import shutdown_distributed
from megatron_lite.training.entry import exit_process
shutdown_distributed(dims)
exit_process(0)  # as pretrain.py: no interpreter finalization after the groups are gone (a rare abort)
"""


def test_skipping_the_gradient_all_reduce_over_one_rank_changes_nothing():
    proc = subprocess.run([sys.executable, "-c", SKIP_CHECK], cwd=REPO, env=cpu_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("equal"), proc.stderr[-3000:]


def test_a_stuck_rank_ends_the_run_within_the_timeout_and_says_where_each_rank_was(tmp_path):
    """Rank 1 sleeps before its third log line (tests/faults.py); rank 0 waits in that line's
    loss average until distributed.timeout_minutes (9 s), exits naming it, and the launcher
    stops rank 1. Half-way through the wait (distributed.hang_dump_after) both ranks write where
    they are: tools/hang_report.py and rank 0's error line name rank 1 as the one missing."""
    timeout_s = 9
    env = {**cpu_env(), "FAULT_STALL_LOG": "3:900:1"}
    cmd = pretrain_command([*_args(tmp_path), "training.iters=20", f"logging.dir={tmp_path}/run",
                            f"distributed.timeout_minutes={timeout_s / 60}",
                            "distributed.hang_dump_after=0.5"], nproc=2)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    # Reading stops when every process has closed its output; a watchdog kills them all
    # should that never happen.
    watchdog = threading.Timer(300, lambda: os.killpg(proc.pid, signal.SIGKILL))
    watchdog.start()
    lines, stalled, ranks = [], None, []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "[fault] rank 1 stalls" in line:
                stalled, stalled_wall = time.monotonic(), time.time()
                ranks = psutil.Process(proc.pid).children(recursive=True)
        proc.wait()
    finally:
        watchdog.cancel()
    ended = time.monotonic()
    out = "".join(lines)
    assert stalled is not None, out[-3000:]
    assert proc.returncode != 0
    assert ended - stalled < timeout_s + 60, f"{ended - stalled:.0f} s\n{out[-3000:]}"
    assert "error: rank 0: the logged loss (a collective on a gloo control group) failed: " \
           "Timed out" in out, out[-3000:]
    # Both ranks wrote where they were before the timeout; the report and the error line agree.
    for rank in (0, 1):
        dump = json.loads((tmp_path / "run" / "hang" / f"rank{rank}.json").read_text())
        assert dump["time"] - stalled_wall < timeout_s, (rank, dump["time"] - stalled_wall)
    report = subprocess.run([sys.executable, "tools/hang_report.py", str(tmp_path / "run")], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    verdict = report.stdout.splitlines()[0]
    assert verdict.startswith("hang: rank 0 waits in all_reduce 'the logged loss' (#"), report.stdout
    assert "on the control group, gloo, ranks 0, 1) for " in verdict, report.stdout
    # Rank 1 is named with where its main thread is: the fault's sleep, called from the loop.
    assert "; missing: rank 1 (has begun " in verdict, report.stdout
    assert "in stalled_record (called from _train)" in verdict, report.stdout
    error_line = next(line for line in lines if line.startswith("error: rank 0: the logged loss"))
    assert verdict in error_line, error_line
    # No rank is left behind (the launcher starts each in a session of its own: its
    # process group does not hold them).
    _, alive = psutil.wait_procs(ranks, timeout=30)
    assert ranks and not alive, alive


def test_ranks_wait_for_the_dataset_build_longer_than_a_collective_and_sigusr2_says_where(tmp_path):
    """Rank 0 takes 14 s before the dataset-build agreement (as indexing a large corpus does);
    rank 1 waits in it for distributed.setup_timeout_minutes, not the 9 s collective timeout:
    no hang is reported. SIGUSR2 to rank 1 meanwhile has both ranks write where they are (the
    watchers pass the request on), and the run goes on to its end."""
    cmd = pretrain_command([*_args(tmp_path), "training.iters=2", f"logging.dir={tmp_path}/run",
                            "distributed.timeout_minutes=0.15"], nproc=2)
    env = {**cpu_env(), "DIST_HARNESS_STALL": "0:_run_on_groups:1:14"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    watchdog = threading.Timer(300, lambda: os.killpg(proc.pid, signal.SIGKILL))
    watchdog.start()
    lines, sent = [], False
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "[harness] rank 0 stalls 14 s" in line and not sent:
                time.sleep(2)  # rank 1 is in the barrier by then
                ranks = psutil.Process(proc.pid).children(recursive=True)
                next(p for p in ranks if p.environ().get("RANK") == "1").send_signal(signal.SIGUSR2)
                sent = True
        proc.wait()
    finally:
        watchdog.cancel()
    out = "".join(lines)
    assert sent and proc.returncode == 0, out[-3000:]
    assert "[harness] rank 0 stalls 14 s before barrier in training/run.py:_run_on_groups" in out
    dumps = {r: json.loads((tmp_path / "run" / "hang" / f"rank{r}.json").read_text()) for r in (0, 1)}
    # Only the signal's dump: the long wait, in a group whose timeout is that long, is no hang.
    assert [d["reason"] for d in dumps.values()] == ["SIGUSR2 received"] * 2
    (waiting,) = dumps[1]["waiting"]
    assert waiting["name"] == "barrier" and waiting["what"] == "waiting for the dataset build", waiting
    main = next(t for t in dumps[0]["threads"] if t["main"])
    assert any(f["function"] == "_run_on_groups" for f in main["frames"]), main["frames"][-4:]
