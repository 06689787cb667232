"""The tests' launcher of multi-rank runs (tests/dist_harness/launch.py) starts and ends ranks as
torchrun does: torchrun's variables, the rendezvous port held from other binds while the ranks
run, each rank in a session of its own; on the first failure, or a signal to the launcher,
SIGTERM to every other rank's process group (its children too), the failed rank's status as
``exitcode  : N``, and exit status 1."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import psutil

from tests.conftest import REPO, cpu_env, launch_ranks

# A rank: says its variables, stops on SIGTERM saying so, and once every rank is ready (a file
# each in READY) does what ``sys.argv[2]`` says. Each line in one write: the ranks share the
# launcher's output.
RANK = """
import os, signal, socket, subprocess, sys, time
from pathlib import Path
def say(*words):
    os.write(1, (" ".join(map(str, words)) + chr(10)).encode())
r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
ready, what = Path(sys.argv[1]), sys.argv[2]
signal.signal(signal.SIGTERM, lambda *a: (say(f"rank {r}: SIGTERM"), sys.exit(0)))
say(r, os.environ["LOCAL_RANK"], n, os.environ["LOCAL_WORLD_SIZE"], os.environ["MASTER_ADDR"],
    os.getsid(0) == os.getpid())
if what == "child" and r == 0:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    (ready / "child").write_text(str(child.pid))
(ready / str(r)).touch()
while len([p for p in ready.iterdir() if p.name.isdigit()]) < n:
    time.sleep(0.05)
if r == 1 and what in ("fail", "child"):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
        say("rank 1: the port was free")
    except OSError:
        say("rank 1: the port is held")
    sys.exit(3)
if what != "succeed":
    time.sleep(120)
"""


def _launch(nproc: int, ready: Path, what: str, **kwargs) -> subprocess.Popen:
    ready.mkdir()
    return subprocess.Popen([*launch_ranks(nproc), "-c", RANK, str(ready), what], cwd=REPO, env=cpu_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_a_failing_rank_stops_the_others_and_the_launcher_reports_its_status(tmp_path):
    proc = _launch(3, tmp_path / "ready", "fail")
    out, err = proc.communicate(timeout=60)
    lines = out.splitlines()
    assert proc.returncode == 1, out + err
    assert sorted(line for line in lines if line[0].isdigit()) == [
        f"{r} {r} 3 3 127.0.0.1 True" for r in range(3)]
    assert "rank 1: the port is held" in lines
    assert {"rank 0: SIGTERM", "rank 2: SIGTERM"} <= set(lines), out
    assert "exitcode  : 3" in err and "rank      : 1" in err, err


def test_a_failure_stops_a_ranks_children_too(tmp_path):
    proc = _launch(2, tmp_path / "ready", "child")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "rank 0: SIGTERM" in out, out + err
    child = int((tmp_path / "ready" / "child").read_text())
    gone, alive = psutil.wait_procs([psutil.Process(child)] if psutil.pid_exists(child) else [], timeout=10)
    assert not alive, f"rank 0's child {child} outlived the run"


def test_a_signal_to_the_launcher_stops_every_rank(tmp_path):
    ready = tmp_path / "ready"
    proc = _launch(2, ready, "wait")
    deadline = time.monotonic() + 30
    while len(list(ready.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGHUP)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, out + err
    assert {"rank 0: SIGTERM", "rank 1: SIGTERM"} <= set(out.splitlines()), out
    assert "launch: stopped by SIGHUP" in err and "exitcode" not in err, err


def test_ranks_that_all_succeed_end_the_launcher_with_status_0(tmp_path):
    proc = _launch(2, tmp_path / "ready", "succeed")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and err == "", out + err
    assert sorted(line for line in out.splitlines() if line[0].isdigit()) == [
        f"{r} {r} 2 2 127.0.0.1 True" for r in range(2)]
