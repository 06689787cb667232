"""Stops and saves that reach the Ray workers without a signal on their main thread: the
launcher's stop (SIGTERM to it), its save when Ray drains a node (a preemption), and signals to a
worker process. All end in ``training.control``'s ``request_stop`` / ``request_save``."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from megatron_lite.logging.console import emit_line


class StopRequest:
    """The launcher's requests, for every worker: a stop (SIGTERM to the launcher) and saves
    (a node about to be preempted). Each worker waits on ``wait`` in a thread of its own (one
    pending call per worker, nothing polled); an async actor, so that the waits do not hold its
    one thread. Each worker registers the Ray node it runs on, for the launcher's drain watch."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.saves: list[str] = []
        self.changed = asyncio.Event()
        self.placed: dict[int, str] = {}

    def _wake(self) -> None:
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

    async def request(self, reason: str) -> None:
        self.reason = reason
        self._wake()

    async def ask_save(self, reason: str) -> None:
        self.saves.append(reason)
        self._wake()

    async def register(self, rank: int, node_id: str) -> int:
        """Where ``rank`` runs now (a restarted worker group replaces the placement of the one
        before); the number of saves asked so far, which a new worker does not repeat."""
        self.placed[rank] = node_id
        return len(self.saves)

    async def wait(self, seen: int) -> tuple[str | None, list[str]]:
        """(the stop's reason or None, the saves asked after the first ``seen``), once there
        is either."""
        while self.reason is None and len(self.saves) <= seen:
            await self.changed.wait()
        return self.reason, self.saves[seen:]

    async def nodes(self) -> dict[str, list[int]]:
        """Node id -> the ranks on it."""
        out: dict[str, list[int]] = {}
        for rank, node in sorted(self.placed.items()):
            out.setdefault(node, []).append(rank)
        return out


def follow_launcher(stop: Any, rank: int) -> None:
    """On a worker: take the launcher's requests at this rank's next step boundary, a stop (the
    loop saves and ends) or, on rank 0, a save (every rank saves and goes on). Until the loop
    runs (the workers are still starting) a request is repeated, so a run stopped while
    starting saves at its first step."""
    import ray

    from megatron_lite.training.control import request_save, request_stop

    def take(request: Any, reason: str) -> None:
        while not request(reason):
            time.sleep(0.5)

    def follow() -> None:
        try:
            seen = ray.get(stop.register.remote(rank, ray.get_runtime_context().get_node_id()))
            while True:
                reason, saves = ray.get(stop.wait.remote(seen))
                if reason is not None:
                    take(request_stop, reason)
                    return
                seen += len(saves)
                # Rank 0 alone asks: the step report ORs its flag into every rank's, so all save
                # at one step. Were each rank to ask, a request reaching two ranks on either side
                # of a step boundary would make two saves.
                for why in saves if rank == 0 else []:
                    take(request_save, why)
        except Exception:  # the launcher is gone: Ray ends this worker itself
            return

    threading.Thread(target=follow, name="ray-stop", daemon=True).start()


DRAIN_POLL_S = 2.0
"""How often the launcher asks Ray which nodes drain: well inside the notice a preemption gives
(30 s on the clouds' spot nodes and for ``ray start``'s own SIGTERM drain), and one request to
Ray's control store per poll whatever the number of workers."""


def draining_nodes() -> dict[str, int] | None:
    """Node id -> drain deadline (ms since the epoch, 0 for none) of the nodes Ray drains now;
    None when this Ray cannot say. Ray has no public call for it; this is the one Ray Train's
    own preemption watcher and Ray Serve use. A Ray without it loses the watch, not the run."""
    import ray

    state = getattr(getattr(getattr(ray, "_private", None), "state", None), "state", None)
    get = getattr(state, "get_draining_nodes", None)
    return None if get is None else dict(get())


def drain_reason(node: str, ranks: list[int], deadline_ms: int, now: float) -> str:
    """Why a save is asked for: which node drains, its ranks and the time left."""
    where = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    left = (f"its deadline is in {max(0.0, deadline_ms / 1000 - now):.0f} s" if deadline_ms
            else "no deadline")
    return f"Ray drains node {node[:12]} ({where}; {left})"


def watch_drains(stop: Any, on_drain: Any, done: threading.Event,
                 interval: float = DRAIN_POLL_S) -> threading.Thread:
    """In the launcher: when Ray starts draining a node that runs a worker (a preemption notice
    from the cloud or KubeRay, a scale-down, ``ray start`` given SIGTERM), call ``on_drain``
    with the reason, once per node and deadline. Ray ends the workers there at the deadline
    without a signal of their own, and restarts the group on other nodes."""
    import ray

    def watch() -> None:
        told: set[tuple[str, int]] = set()
        while not done.wait(interval):
            try:
                draining = draining_nodes()
                if draining is None:
                    emit_line("warning: this Ray does not say which nodes it drains: a preempted "
                              "node loses the steps since the last save", sys.stderr)
                    return
                if not set(draining.items()) - told:
                    continue
                placed = ray.get(stop.nodes.remote(), timeout=30)
            except Exception as e:  # Ray itself is going away: fit() reports that
                if not done.is_set():
                    emit_line(f"warning: the drain watch stopped ({type(e).__name__}: {e})",
                              sys.stderr)
                return
            for node, deadline in sorted(draining.items()):
                if node in placed and (node, deadline) not in told:
                    told.add((node, deadline))
                    on_drain(drain_reason(node, placed[node], deadline, time.time()))

    thread = threading.Thread(target=watch, name="ray-drain-watch", daemon=True)
    thread.start()
    return thread


def save_on_worker_signals() -> None:
    """Run on each worker's main thread (where Ray runs the calls its worker group makes):
    SIGTERM/SIGUSR1 to the worker process stops the training loop at a step boundary with a
    save, as the signal handlers of a run on the main thread do. Before the loop runs, Ray's own
    handling stays: the process ends (a signal during start-up stops any launcher's run)."""
    from megatron_lite.training.control import SIGNALS, request_stop

    for sig in SIGNALS:
        previous = signal.getsignal(sig)

        def on_signal(signum: int, frame: Any, previous: Any = previous) -> None:
            if request_stop(signal.Signals(signum).name):
                return
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, on_signal)


def no_process_group_config(save_on_signal: bool = False):
    """A ``TorchConfig`` that leaves starting the process group to the trainer, which picks the
    backend for its device and meets at our rendezvous (``ray_rendezvous``); with
    ``save_on_signal`` each worker's signals stop its training loop with a save
    (``save_on_worker_signals``)."""
    from ray.train.backend import Backend
    from ray.train.torch import TorchConfig

    class _GroupStartedByTrainer(Backend):
        # Every worker sees all of its node's accelerators and picks its own by local rank,
        # as under torchrun.
        share_cuda_visible_devices = True

        def on_start(self, worker_group, backend_config) -> None:
            if backend_config.save_on_signal:
                worker_group.execute(save_on_worker_signals)

    @dataclass
    class TrainerRendezvous(TorchConfig):
        save_on_signal: bool = False

        @property
        def backend_cls(self):
            return _GroupStartedByTrainer

    return TrainerRendezvous(save_on_signal=save_on_signal)
