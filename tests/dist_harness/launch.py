"""``python tests/dist_harness/launch.py NPROC SCRIPT ARGS...``: the tests' launcher of
multi-rank runs on this machine (tests only).

It starts NPROC ranks with torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), each in a session of its own, and ends
them as torchrun does: on the first rank to exit with a failure, or on SIGTERM, SIGINT, SIGHUP
or SIGQUIT to the launcher, every other rank's process group is sent SIGTERM (the launcher's
signal), then SIGKILL after ``STOP_GRACE_S``; a failure is reported as ``exitcode  : N``, and the
launcher exits 1 after either. Unlike torchrun, rank 0's store serves the rendezvous (as under
mpiexec; torchrun keeps it in its launcher): ``tests/distributed/test_rank0_files.py`` runs one
case under each.

Why not torchrun itself: its launcher imports torch (1.3 s of CPU per launch, before any rank
starts), and the suite launches a hundred multi-rank runs on two cores. Tests of what torchrun
itself does keep torchrun (``tests.conftest.torchrun``).

The port: one the kernel hands out (port 0), held bound with ``SO_REUSEADDR`` and without
listening until the ranks end. Rank 0's store binds it too (torch's store server sets
``SO_REUSEADDR``) and listens. The kernel hands a bound port to no other ``bind`` on port 0 or
outgoing connection, and a ``bind`` to it without ``SO_REUSEADDR`` is refused.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

STOP_GRACE_S = 30.0  # torchrun's: SIGTERM, then SIGKILL after this long
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)  # torchrun's


def held_port() -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


def main(argv: list[str]) -> int:
    nproc, cmd = int(argv[0]), [sys.executable, *argv[1:]]
    port = held_port()
    base = {**os.environ, "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port.getsockname()[1])}
    ranks = [subprocess.Popen(cmd, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, start_new_session=True)
             for r in range(nproc)]
    stopping: dict[str, float] = {}

    def stop(sig: int) -> None:
        """``sig`` to each live rank's process group (a rank's own children too, as torchrun)."""
        stopping.setdefault("deadline", time.monotonic() + STOP_GRACE_S)
        for p in ranks:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    signalled: list[int] = []
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda s, f: (signalled.append(s), stop(signal.SIGTERM)))
    failed: tuple[int, int] | None = None
    while [p.poll() for p in ranks].count(None):  # every rank polled, each time
        if failed is None:
            failed = next(((r, p.returncode) for r, p in enumerate(ranks)
                           if p.returncode not in (None, 0)), None)
            if failed is not None:
                stop(signal.SIGTERM)
        if time.monotonic() > stopping.get("deadline", float("inf")):
            stop(signal.SIGKILL)
        time.sleep(0.05)
    port.close()
    if failed is None:
        failed = next(((r, p.returncode) for r, p in enumerate(ranks) if p.returncode != 0), None)
    if failed is not None:
        rank, status = failed
        print(f"launch: rank {rank} failed\n  rank      : {rank}\n  exitcode  : {status}", file=sys.stderr)
    if signalled:
        print(f"launch: stopped by {signal.Signals(signalled[0]).name}", file=sys.stderr)
    return 1 if failed is not None or signalled else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
