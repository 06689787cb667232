"""The tests' launcher of multi-rank runs (tests/dist_harness/launch.py) starts and ends ranks as
torchrun does: torchrun's variables, the rendezvous port held from other binds while the ranks
run, each rank in a session of its own, and on the first failure SIGTERM to the other ranks, the
failed rank's status as ``exitcode  : N`` and exit status 1."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO, cpu_env, launch_ranks

# Each line in one write: the ranks share the launcher's output.
RANK = """
import os, signal, socket, sys, time
def say(*words):
    os.write(1, (" ".join(map(str, words)) + chr(10)).encode())
r = int(os.environ["RANK"])
say(r, os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_WORLD_SIZE"],
    os.environ["MASTER_ADDR"], os.getsid(0) == os.getpid())
if r == 1:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
        say("rank 1: the port was free")
    except OSError:
        say("rank 1: the port is held")
    time.sleep(0.5)
    sys.exit(int(sys.argv[1]))
signal.signal(signal.SIGTERM, lambda *a: (say(f"rank {r}: SIGTERM"), sys.exit(0)))
time.sleep(120)
"""


def _launch(nproc: int, status: int) -> subprocess.CompletedProcess:
    return subprocess.run([*launch_ranks(nproc), "-c", RANK, str(status)], cwd=REPO, env=cpu_env(),
                          capture_output=True, text=True, timeout=60)


def test_a_failing_rank_stops_the_others_and_the_launcher_reports_its_status():
    proc = _launch(3, 3)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert sorted(line for line in lines if line[0].isdigit()) == [
        f"{r} {r} 3 3 127.0.0.1 True" for r in range(3)]
    assert "rank 1: the port is held" in lines
    assert {"rank 0: SIGTERM", "rank 2: SIGTERM"} <= set(lines), proc.stdout
    assert "exitcode  : 3" in proc.stderr and "rank      : 1" in proc.stderr, proc.stderr


def test_ranks_that_all_succeed_end_the_launcher_with_status_0():
    code = "import os; os.write(1, (os.environ['RANK'] + chr(10)).encode())"
    proc = subprocess.run([*launch_ranks(2), "-c", code], cwd=REPO, env=cpu_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and sorted(proc.stdout.split()) == ["0", "1"], proc.stderr
    assert os.path.basename(launch_ranks(2)[1]) == "launch.py" and launch_ranks(2)[0] == sys.executable
