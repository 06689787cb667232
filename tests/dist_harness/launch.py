"""``python tests/dist_harness/launch.py NPROC SCRIPT ARGS...``: the tests' launcher of
multi-rank runs on this machine (tests only).

It starts NPROC ranks as torchrun does (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; rank 0's store serves the rendezvous, as
under mpiexec), and ends as torchrun ends: the first rank to exit with a failure has every
other rank sent SIGTERM (SIGKILL after ``STOP_GRACE_S``), its status is reported as
``exitcode  : N`` and the launcher exits 1; SIGTERM and SIGINT to the launcher go to every rank,
each rank running in a session of its own.

Why not torchrun itself: its launcher imports torch (about 1.5 s of CPU per launch, before any
rank starts), and the suite launches a hundred multi-rank runs on two cores. Tests of what
torchrun itself does keep torchrun (``tests.conftest.torchrun``).

The port: drawn below the kernel's ephemeral range (as ``tests.conftest._free_port``) and held
bound, with ``SO_REUSEADDR`` and without listening, until the ranks end. Rank 0's store binds it
too (torch's store server sets ``SO_REUSEADDR``) and listens; meanwhile nothing else can take
it: the kernel hands out no bound port, and another draw's plain ``bind`` is refused.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

STOP_GRACE_S = 30.0  # torchrun's: SIGTERM, then SIGKILL after this long


def held_port() -> socket.socket:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", random.randrange(10000, max(low, 10001))))
        except OSError:
            s.close()
            continue
        return s
    raise RuntimeError("no free port below the ephemeral range after 100 draws")


def main(argv: list[str]) -> int:
    nproc, cmd = int(argv[0]), [sys.executable, *argv[1:]]
    port = held_port()
    base = {**os.environ, "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port.getsockname()[1])}
    # Each rank in a session of its own, as torchrun starts them: a signal to the launcher's
    # process group reaches the ranks only through the launcher.
    ranks = [subprocess.Popen(cmd, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, start_new_session=True)
             for r in range(nproc)]

    def stop(sig: int) -> None:
        for p in ranks:
            if p.poll() is None:
                p.send_signal(sig)

    signal.signal(signal.SIGTERM, lambda s, f: stop(signal.SIGTERM))
    signal.signal(signal.SIGINT, lambda s, f: stop(signal.SIGINT))
    failed: tuple[int, int] | None = None
    while [p.poll() for p in ranks].count(None):  # every rank polled, each time
        if failed is None:
            failed = next(((r, p.returncode) for r, p in enumerate(ranks)
                           if p.returncode not in (None, 0)), None)
            if failed is not None:
                stop(signal.SIGTERM)
                deadline = time.monotonic() + STOP_GRACE_S
        elif time.monotonic() > deadline:
            stop(signal.SIGKILL)
        time.sleep(0.05)
    port.close()
    if failed is None:
        failed = next(((r, p.returncode) for r, p in enumerate(ranks) if p.returncode != 0), None)
    if failed is None:
        return 0
    rank, status = failed
    print(f"launch: rank {rank} failed\n  rank      : {rank}\n  exitcode  : {status}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
