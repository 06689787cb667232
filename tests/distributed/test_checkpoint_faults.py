"""Checkpoints under real faults: a signal to one rank, a time limit, a full filesystem."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from tests.conftest import NO_TENSORBOARD, REPO, check, cpu_env, launch_ranks, read_metrics, run_pretrain
from tests.distributed.test_checkpoint import _args, _records


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def test_sigterm_to_one_rank_saves_on_every_rank_and_resumes_exactly(tmp_path):
    """Data parallel with ZeRO-1, dropout and background saves: SIGTERM to rank 1 alone saves
    every rank at one step, and the resume from that save continues bit for bit."""
    full = _args(tmp_path, "training.iters=16", "parallel.zero_stage=1", "model.dropout=0.1",
                 "checkpoint.async_save=true")
    check(run_pretrain([*full, f"logging.dir={tmp_path}/full"], nproc=2))
    ck = [f"checkpoint.dir={tmp_path}/ck"]
    cmd = [*launch_ranks(2), str(REPO / "pretrain.py"), *full, *ck, f"logging.dir={tmp_path}/a",
           NO_TENSORBOARD]
    proc = subprocess.Popen(cmd, cwd=REPO, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith("step      3/"):
            os.kill(_children(proc.pid)[1], signal.SIGTERM)  # rank 1 only
    assert proc.wait(timeout=120) == 0, "".join(out[-30:])
    stopped = [x for x in out if x.startswith("stopping at step")]
    assert len(stopped) == 1 and "signal" in stopped[0], "".join(out[-30:])
    step = int(stopped[0].split()[3].rstrip(":"))
    assert step < 16
    latest = (tmp_path / "ck/latest").read_text().strip()
    assert latest == f"step_{step:08d}"
    manifest = json.loads((tmp_path / "ck" / latest / "manifest.json").read_text())
    assert [f["name"] for f in manifest["files"]] == ["rank_00000.pt", "rank_00001.pt"]

    check(run_pretrain([*full, *ck, f"logging.dir={tmp_path}/b"], nproc=2))
    want, got = _records(tmp_path / "full", step + 1), _records(tmp_path / "b", 1)
    assert got[0]["step"] == step + 1 and got[-1]["step"] == 16
    for key in ("loss", "grad_norm", "lr", "consumed_samples"):
        assert [r[key] for r in got] == [r[key] for r in want], key


def test_time_limit_saves_and_exits_zero(tmp_path):
    proc = check(run_pretrain([*_args(tmp_path, "training.iters=1000", "training.exit_duration_mins=0.001"),
                               f"checkpoint.dir={tmp_path}/ck", f"logging.dir={tmp_path}/run"]))
    # 0.06 s: the limit is found reached after the first step or two (a fast machine's first).
    stopped = re.findall(r"stopping at step (\d+): training.exit_duration_mins=0.001 reached", proc.stdout)
    assert len(stopped) == 1 and int(stopped[0]) <= 3, proc.stdout[-2000:]
    assert (tmp_path / "ck/latest").read_text().strip() == f"step_{int(stopped[0]):08d}"
    assert any(r.get("event") == "stop" for r in read_metrics(tmp_path / "run"))
    assert not (tmp_path / "run/finished.json").exists()  # a chained job's successor trains on

    # The limit found reached at the last step (the launcher started an hour ago): the run is
    # complete, and says so to a chained job, which would otherwise queue an empty successor.
    proc = check(run_pretrain([*_args(tmp_path, "training.iters=1", "training.exit_duration_mins=0.001"),
                               f"checkpoint.dir={tmp_path}/ck2", f"logging.dir={tmp_path}/run2"],
                              env={"LAUNCH_START_EPOCH": str(time.time() - 3600)}))
    assert "at the last step: no step is left to train" in proc.stdout, proc.stdout[-2000:]
    assert json.loads((tmp_path / "run2/finished.json").read_text())["steps"] == 1
    # Resumed again at its last step: nothing to train, and said so (not a silent exit 0).
    proc = check(run_pretrain([*_args(tmp_path, "training.iters=1"), f"checkpoint.dir={tmp_path}/ck2",
                               f"logging.dir={tmp_path}/run2"]))
    assert "nothing to train: resumed at step 1, and the run has 1 (raise training.iters" in proc.stdout

    # Without a checkpoint.dir the stop hands nothing over: not a success.
    proc = run_pretrain([*_args(tmp_path, "training.iters=1000", "training.exit_duration_mins=0.001"),
                         f"logging.dir={tmp_path}/run3"])
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(r"error: stopped at step \d+ of 1000 \(training.exit_duration_mins=0.001 reached\) "
                     r"with nothing saved: checkpoint.dir is null", proc.stderr), proc.stderr[-2000:]
    assert not (tmp_path / "run3/finished.json").exists()


SMALL_FS = 14 * 2**20
"""Room for one checkpoint of the test model (~9.8 MB), not two."""


@pytest.fixture(params=["tmpfs", "emulated"])
def small_fs(request, tmp_path):
    """(directory, environment) of a 14 MiB filesystem: a real tmpfs where this user may mount
    one (root), and in every case the tests' emulation of one (``FAULT_DISK_SIZE``: the free
    space reported and the rank-file writes that fail with ENOSPC), so a non-root run tests the
    same paths."""
    mount = tmp_path / "small"
    mount.mkdir()
    if request.param == "emulated":
        yield mount, {"FAULT_DISK_SIZE": f"{SMALL_FS}:{mount}"}
        return
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root (the emulated filesystem runs instead)")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_FS // 2**20}m", "tmpfs", str(mount)],
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()} (the emulated one runs instead)")
    yield mount, {}
    subprocess.run(["umount", "-l", str(mount)], check=False, timeout=60)


def test_disk_full_stops_cleanly_and_keeps_the_previous_checkpoint(tmp_path, small_fs):
    small, env = small_fs
    ck = [f"checkpoint.dir={small}/ck", "checkpoint.save_interval=2", "checkpoint.keep_last=0"]
    proc = run_pretrain([*_args(tmp_path, "training.iters=6", "parallel.zero_stage=1"), *ck,
                         f"logging.dir={tmp_path}/run"], nproc=2, timeout=300, env=env)
    assert proc.returncode != 0
    assert f"not enough free space in {small}/ck" in proc.stderr and "MiB are free" in proc.stderr
    assert "on_save_failure=stop" in proc.stderr
    assert (small / "ck/latest").read_text().strip() == "step_00000002"
    assert sorted(p.name for p in (small / "ck").iterdir()) == [".lock", "latest", "step_00000002"]
    events = [r for r in read_metrics(tmp_path / "run") if r.get("event") == "checkpoint_save_failed"]
    assert len(events) == 1 and events[0]["step"] == 4
    # What is left is a checkpoint that loads: the run resumes from it (its own saves fail
    # again, and it trains on), and its last step, which no save could keep, is no success.
    proc = run_pretrain([*_args(tmp_path, "training.iters=4", "parallel.zero_stage=1"), *ck,
                         "checkpoint.on_save_failure=continue", f"logging.dir={tmp_path}/again"],
                        nproc=2, timeout=300, env=env)
    assert "step_00000002 at step 2" in proc.stdout
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert ("training reached its last step (4) but could not save it (1 save(s) in a row failed"
            in proc.stderr)
    assert not (tmp_path / "again/finished.json").exists()


def test_write_error_on_a_full_disk_is_reported_on_every_rank_and_continue_trains_on(tmp_path, small_fs):
    # Without the free-space estimate the write itself runs into ENOSPC.
    small, env = small_fs
    ck = [f"checkpoint.dir={small}/ck", "checkpoint.save_interval=2", "checkpoint.keep_last=0",
          "checkpoint.check_free_space=false", "checkpoint.on_save_failure=continue"]
    proc = run_pretrain([*_args(tmp_path, "training.iters=6", "parallel.zero_stage=1"), *ck,
                         f"logging.dir={tmp_path}/run"], nproc=2, timeout=300, env=env)
    assert "No space left on device" in proc.stdout
    # The last step's save failed too: the trained state is on no disk, so the run has not
    # finished (a chained job's successor trains the steps after the last good checkpoint again).
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert ("the last good checkpoint is step 2; once the cause is fixed, the same command resumes from it "
            "and trains the 4 steps after it again") in proc.stderr
    assert proc.stderr.count("error: training reached its last step") == 1  # the same on both ranks
    assert not (tmp_path / "run/finished.json").exists()
    assert "warning: the last good checkpoint (step 2) is" in proc.stdout
    assert (small / "ck/latest").read_text().strip() == "step_00000002"
    # A stop (the time limit) whose save fails hands nothing over to the next job: no success.
    proc = run_pretrain([*_args(tmp_path, "training.iters=1000", "training.exit_duration_mins=0.001"),
                         *[c for c in ck if not c.startswith("checkpoint.dir")],
                         f"checkpoint.dir={small}/ck2", f"logging.dir={tmp_path}/stopped"],
                        timeout=300, env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert re.search(r"error: training stopped at step \d+ \(training.exit_duration_mins=0.001 reached\) but "
                     r"could not save it", proc.stderr), proc.stderr[-2000:]
    assert not (tmp_path / "stopped/finished.json").exists()
    assert not list((small / "ck").glob(".tmp-*"))  # the partial save was removed
    steps = [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_crash_inside_a_save_keeps_the_previous_checkpoint(tmp_path):
    """A rank really dies (SIGKILL) inside the second save: after its shard is written but before
    the commit; then the run resumed from what that left dies again, after the commit but before
    ``latest`` moved. ``latest`` still names the first checkpoint each time, and the run resumes
    from it to the same losses as an uninterrupted run. (The uninterrupted run gives the losses
    and, as it was right after its first save, the checkpoint the crashed run starts from.)"""
    import shutil

    args = _args(tmp_path, "training.iters=6", "parallel.zero_stage=1")
    check(run_pretrain([*args, f"logging.dir={tmp_path}/full", f"checkpoint.dir={tmp_path}/ck-full",
                        "checkpoint.save_interval=2", "checkpoint.keep_last=0"], nproc=2))
    want = _records(tmp_path / "full", 3)
    ck_dir = tmp_path / "ck"
    shutil.copytree(tmp_path / "ck-full", ck_dir,
                    ignore=shutil.ignore_patterns("step_00000004", "step_00000006"))
    (ck_dir / "latest").write_text("step_00000002\n")
    ck = [f"checkpoint.dir={ck_dir}", "checkpoint.save_interval=2"]
    for n, crash in enumerate(["after_rank_file:1", "before_latest"]):
        cmd = [*launch_ranks(2), str(REPO / "pretrain.py"), *args, *ck, f"logging.dir={tmp_path}/a{n}",
               NO_TENSORBOARD]
        # The kill fires at every save: this run's first save (step 4) is the second one.
        crashed = subprocess.run(cmd, cwd=REPO, env={**cpu_env(), "FAULT_KILL_AT": crash},
                                 capture_output=True, text=True, timeout=300)
        assert crashed.returncode != 0, crash
        assert "step_00000002 at step 2" in crashed.stdout, (crash, crashed.stdout[-3000:])
        assert (ck_dir / "latest").read_text().strip() == "step_00000002", crash
        # Killed before the commit: no step 4; after it: step 4 complete, only `latest` behind.
        committed = (ck_dir / "step_00000004" / "manifest.json").is_file()
        assert committed == (crash == "before_latest"), (crash, sorted(p.name for p in ck_dir.iterdir()))
    proc = check(run_pretrain([*args, *ck, f"logging.dir={tmp_path}/b"], nproc=2))
    assert "resumed from" in proc.stdout and "step_00000002 at step 2" in proc.stdout
    assert not list(ck_dir.glob(".tmp-*"))
    got = _records(tmp_path / "b", 1)
    assert [r["step"] for r in got] == [3, 4, 5, 6]
    assert [r["loss"] for r in got] == [r["loss"] for r in want]


def test_a_stop_while_a_background_save_is_in_flight_waits_for_the_save(tmp_path):
    """The step-2 save is still being written (a slow filesystem) when step 3's NaN stops the
    run: the exit waits for it, so step 2 is committed and `latest` names it."""
    ck = tmp_path / "ck"
    args = _args(tmp_path, "training.iters=6", "checkpoint.async_save=true", "checkpoint.save_interval=2",
                 f"checkpoint.dir={ck}", "spikes.max_consecutive_nonfinite=1", f"logging.dir={tmp_path}/run")
    proc = run_pretrain(args, env={"FAULT_NAN_LOSS": "3", "FAULT_SLOW_SAVE": "4"})
    assert proc.returncode == 1
    assert "1 non-finite steps in a row" in proc.stderr
    assert (ck / "latest").exists() and (ck / "latest").read_text().strip() == "step_00000002"
    assert not list(ck.glob(".tmp-*"))
    assert ("waiting for the checkpoint save of step 2 still in flight before exiting (SpikeStop)"
            in proc.stdout)
    assert "the checkpoint save of step 2 completed" in proc.stdout


def test_a_save_failing_on_rank_0_alone_is_continued_on_every_rank(tmp_path):
    """Rank 0 cannot create step 4's directory (a file is in the way); under
    on_save_failure=continue every rank handles the same CheckpointError and trains on."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / ".tmp-step_00000004").write_text("in the way")
    proc = check(run_pretrain([*_args(tmp_path, "training.iters=6", "parallel.zero_stage=1"),
                               f"checkpoint.dir={ck}", "checkpoint.save_interval=2",
                               "checkpoint.on_save_failure=continue", f"logging.dir={tmp_path}/run"],
                              nproc=2, timeout=300))
    assert "checkpoint save failed (1 in a row): cannot create" in proc.stdout
    assert (ck / "latest").read_text().strip() == "step_00000006"
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [1, 2, 3, 4, 5, 6]
