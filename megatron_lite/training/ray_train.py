"""Training under Ray Train: a ``TorchTrainer`` whose workers run the same path as ``pretrain.py``
(``train_to_exit_status``), restarted by Ray when a worker process or node dies.

What this module decides, and why:

- **The rendezvous is ours, on rank 0's node.** Ray's own torch backend starts the process group
  at the address that ``ray.util.get_node_ip_address()`` gives the first worker: the interface
  that routes to the internet, which on a node with several interfaces (or a machine whose head
  runs on loopback) is not the one the job should use. Here the Ray backend starts nothing; the
  first worker picks the host and a free port on its own node and hands both to the others with
  ``ray.train.collective.broadcast_from_rank_zero``. Ray, not the user, places that worker, so a
  configured host (``MASTER_ADDR``, ``distributed.master_addr``) is used only when it is an
  address of that node; otherwise it is ignored with a warning (refusing would make the same
  command pass or fail with Ray's placement, and kill a restarted run).
- **Restarts resume from our checkpoints.** When a worker dies, Ray stops the group and starts
  the training function again on fresh workers (``FailureConfig.max_failures``); the trainer
  resumes from the newest committed checkpoint in ``checkpoint.dir`` as any restarted job does.
  Ray's own checkpoint registry is not used: the checkpoint directory is already the run's
  durable state, written once per shard group.
- **A stop saves, as under mpiexec.** The training function runs in a thread, where no signal
  handler can be installed. With ``checkpoint.save_on_signal``, SIGTERM/SIGUSR1 to the launcher
  (``ray job stop``, a scheduler) reaches every worker through a small actor, and SIGTERM/SIGUSR1
  to a worker process is caught on its main thread; both end in ``control.request_stop``: every
  rank saves at the same step and the run ends with status 0.
- **A preemption saves, and the run goes on.** A preempted node reaches no worker as a signal:
  Ray drains it, ends its workers at the drain's deadline and starts the group again elsewhere
  (``FailureConfig.max_preemption_failures``, apart from ``max_failures``). The launcher watches
  Ray's draining nodes; when one holds a worker, every rank saves at its next step
  (``control.request_save``) and trains on, and the restarted group resumes from that save.
- **Secrets stay out of Ray's records.** Ray writes a job's ``runtime_env`` to its logs and
  dashboard: secret-looking variables (API keys, tokens) go to the workers through a private
  file whose path is passed instead, unless their own environment has them.
- **Metrics go to Ray too.** Every training record is reported with ``ray.train.report`` (a
  barrier across workers in Ray Train 2, so every rank reports, at the same steps).
"""

from __future__ import annotations

import asyncio
import atexit
import ipaddress
import json
import os
import queue
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import MutableMapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from megatron_lite.logging.console import emit_line

RAY_VERSIONS = ">=2.60,<3"
"""Ray Train 2's API (``ray.train.collective``, ``UserCallback``, the controller that restarts
worker groups), as tested; setup.py's ``ray`` extra."""

DEVICE_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "hpu": "hccl"}
FORWARDED_ENV = ("TORCH_EXTENSIONS_DIR", "OMP_NUM_THREADS", "WANDB_MODE", "WANDB_API_KEY",
                 "WANDB_DIR", "HF_HOME", "HF_HUB_OFFLINE", "HF_TOKEN", "PYTHONPATH")
FORWARDED_PREFIXES = ("PT_HPU_", "HABANA_", "HCCL_", "NCCL_", "TORCH_NCCL_", "FI_", "MPICH_")
"""The launcher's environment that the workers see: Ray starts them from its own processes, on
every node of the cluster, with the environment Ray was started with."""


def worker_environment(device: str, hpu_mode: str, environ: dict[str, str]) -> dict[str, str]:
    """The variables every worker gets: the forwarded ones of ``environ`` (the launcher's), and
    what ``launch/gaudi.sh`` sets for an HPU run (DeepSpeed's accelerator; the execution mode,
    ``PT_HPU_LAZY_MODE=1`` for lazy, 0 for eager and compile). The devices themselves come from
    Ray (``HABANA_VISIBLE_MODULES``, ``CUDA_VISIBLE_DEVICES`` per worker)."""
    env = {k: v for k, v in environ.items()
           if k in FORWARDED_ENV or (k.startswith(FORWARDED_PREFIXES) and k != "HABANA_VISIBLE_MODULES")}
    env["DS_ACCELERATOR"] = environ.get("DS_ACCELERATOR") or device
    if device == "hpu":
        env.setdefault("PT_HPU_LAZY_MODE", "1" if hpu_mode == "lazy" else "0")
    return env


def is_secret(name: str) -> bool:
    """A variable whose value must not reach Ray's records (API keys, tokens, passwords)."""
    return name.endswith(("_API_KEY", "_TOKEN", "_PASSWORD")) or "SECRET" in name


class PrivateFile:
    """Secret values for the workers in a file only this user can read (0600, in a 0700
    directory of the launcher's temporary directory, ``TMPDIR``), removed when the launcher
    ends. Only its path goes through Ray; a worker reads it where its node sees the file (the
    launcher's machine, or every node when ``TMPDIR`` is on a shared file system)."""

    def __init__(self, values: dict[str, str]):
        self.dir = tempfile.mkdtemp(prefix="megatron_lite-ray-")  # 0700
        self.path = os.path.join(self.dir, "secrets.json")
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(values, f)
        # Also on exits that skip the launcher's finally (sys.exit from a signal handler).
        atexit.register(self.remove)

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def take_secrets(names: list[str], path: str | None,
                 environ: MutableMapping[str, str] = os.environ) -> tuple[list[str], list[str], list[str]]:
    """Put into ``environ`` the secrets this worker lacks, from the launcher's private file;
    (names this node's environment has, names taken from the file, names missing here). A
    node's own value wins: a cluster that sets its secrets (``ray start``, a pod's env) keeps
    them."""
    own = [n for n in names if environ.get(n)]
    wanted = [n for n in names if n not in own]
    values: dict[str, str] = {}
    if wanted and path:
        try:
            with open(path) as f:
                values = json.load(f)
        except (OSError, ValueError):
            values = {}
    taken = [n for n in wanted if values.get(n)]
    for n in taken:
        environ[n] = values[n]
    return own, taken, [n for n in wanted if n not in taken]


class RayNotInstalled(RuntimeError):
    """Ray (or Ray Train) is missing from this environment."""


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker needs to run the trainer: sent by value to each of them."""

    recipe: str
    overrides: list[str]
    device: str
    """cpu, cuda or hpu: the device each worker trains on (``training.device``)."""
    master_addr: str | None = None
    """The rendezvous host, when the launcher or the recipe names one: used when it is an
    address of rank 0's node."""
    master_addr_source: str = "MASTER_ADDR"
    """Where ``master_addr`` came from, for the warning when it cannot be used."""
    env: dict[str, str] = field(default_factory=dict)
    secret_names: list[str] = field(default_factory=list)
    """Secret variables of the launcher the workers need, their values not in ``env``."""
    secrets_file: str | None = None
    """The launcher's private file holding their values (``PrivateFile``)."""
    report_interval: int | None = None
    """Report to Ray the training records whose step is a multiple of this (default: every
    record, ``training.log_interval``)."""
    cwd: str | None = None
    """The launcher's working directory, which the recipe's relative paths start from (entered
    on every node that has it: a shared file system)."""


def import_ray():
    """Ray and Ray Train, or a one-line reason with the fix."""
    # Ray Train 2, which ray.train picks when it is imported (the default since Ray 2.5x).
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    try:
        import ray
        import ray.train  # noqa: F401
        import ray.train.torch  # noqa: F401
    except ImportError as e:
        raise RayNotInstalled(f"Ray Train is not installed ({e}): pip install -e .[ray] "
                              f"(Ray {RAY_VERSIONS})") from None
    return ray


def free_port() -> int:
    """A port free on every interface of this machine (the first rank's store listens on all)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _node_address() -> str:
    """The address this worker's Ray node registered with the cluster (loopback for a local
    cluster started on it; the node's cluster interface on a real one)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return node["NodeManagerAddress"]
    raise RuntimeError(f"this worker's Ray node {node_id} is not in the cluster's node list")


def _resolved(host: str) -> list[tuple[int, str]]:
    """(family, address) of every address ``host`` names; none when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return [(family, sockaddr[0]) for family, _, _, _, sockaddr in infos]


def on_this_machine(host: str) -> bool:
    """Whether ``host`` is an address of this machine: a socket binds to an address only where
    an interface has it, the check that the first rank's store can listen there."""
    for family, address in _resolved(host):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((address, 0))
                return True
            except OSError:
                continue
    return False


def rendezvous_host(configured: str | None, source: str, node_address: str,
                    whole_job_here: bool) -> tuple[str, str | None]:
    """The host every rank meets at, chosen on rank 0's machine, and a warning when the
    configured one cannot be it. Default: loopback when every worker runs on this node (it
    reaches nothing outside), else the address this node registered with Ray. A configured host
    is kept when it is an address of this machine (an interface of rank 0's node, picked by
    the user) and, for loopback, when no worker runs on another node."""
    own = "127.0.0.1" if whole_job_here else node_address
    if not configured:
        return own, None
    addresses = _resolved(configured)
    loopback = bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback
                                       for _, a in addresses)
    if on_this_machine(configured) and (whole_job_here or not loopback):
        return configured, None
    if loopback:
        why = "is loopback but the workers run on several nodes"
    elif not addresses:
        why = "does not resolve on the node Ray placed rank 0 on"
    else:
        why = f"is not an address of the node Ray placed rank 0 on ({node_address})"
    return own, (f"warning: {source}={configured} {why}; the ranks meet at {own} instead (Ray "
                 f"chooses rank 0's node: leave {source} unset, or name an interface of that node)")


def rendezvous(spec: WorkerSpec, rank: int, whole_job_here: bool) -> tuple[str, int]:
    """(host, port) agreed by every worker: the first worker's choice on its own node, broadcast
    through Ray."""
    from ray.train.collective import broadcast_from_rank_zero

    chosen = None
    if rank == 0:
        host, warning = rendezvous_host(spec.master_addr, spec.master_addr_source, _node_address(),
                                        whole_job_here)
        if warning:
            emit_line(warning, sys.stderr)
        chosen = (host, free_port())
    return broadcast_from_rank_zero(chosen)


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
    loop saves and ends) or a save (it saves and goes on). Until the loop runs (the workers are
    still starting) a request is repeated, so a run stopped while starting saves at its first
    step."""
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
                for why in saves:
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
                if not draining.keys() - {node for node, _ in told}:
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


def worker_loop(config: dict[str, Any]) -> None:
    """The training function of every Ray worker: the trainer as ``pretrain.py`` runs it."""
    import ray.train

    from megatron_lite.config import load_config
    from megatron_lite.distributed.launcher_env import LaunchEnv
    from megatron_lite.training.entry import train_outcome

    config = dict(config)
    stop = config.pop("stop", None)
    spec = WorkerSpec(**config)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if stop is not None:
        follow_launcher(stop, rank)
    os.environ.update(spec.env)
    own, taken, missing = take_secrets(spec.secret_names, spec.secrets_file)
    if spec.cwd and os.path.isdir(spec.cwd):
        os.chdir(spec.cwd)
    if missing:
        emit_line(f"warning: rank {rank}: {', '.join(missing)} of the launcher reach no worker on "
                  f"this node: its private copy {spec.secrets_file} is not readable here; set them "
                  "in the Ray nodes' environment (ray start, the pod spec) or point the launcher's "
                  "TMPDIR at a file system every node shares", sys.stderr)
    host, port = rendezvous(spec, rank, ctx.get_local_world_size() == world)
    if rank == 0:
        print(f"ray: {world} workers, rendezvous at {host}:{port}", flush=True)
        if own or taken:
            sources = [f"{n} from the launcher's private file" for n in taken]
            sources += [f"{n} from this node's environment" for n in own]
            print(f"ray: secrets (kept out of Ray's records): {', '.join(sources)}", flush=True)
    env = LaunchEnv(rank=rank, local_rank=ctx.get_local_rank(), world_size=world, master_addr=host,
                    master_port=port, launcher="ray", local_world_size=ctx.get_local_world_size())
    for key, value in {"RANK": rank, "LOCAL_RANK": env.local_rank, "WORLD_SIZE": world,
                       "LOCAL_WORLD_SIZE": env.local_world_size}.items():
        os.environ[key] = str(value)
    cfg = load_config(spec.recipe, [*spec.overrides, f"training.device={spec.device}"])

    reporter = RayReporter(spec.report_interval or cfg.training.log_interval)
    status, reason = 1, "stopped"
    try:
        status, reason, _ = train_outcome(cfg, env, reporter)
    finally:
        reporter.close(timeout=60.0 if status == 0 else 0.0)
    if status != 0:
        emit_line(f"error: {reason}", sys.stderr)
        # Ray hands the exception to the launcher, which prints the first rank's reason.
        raise WorkerFailed(f"rank {rank}: exit status {status}: error: {reason}")


class RayReporter:
    """Hands training records to ``ray.train.report`` from a thread of its own. A report waits
    for Ray's controller to take the previous one (it polls every couple of seconds) and for
    every worker to report too: on the training path that wait would stall steps that are
    faster than the poll. Every rank reports the same records (those whose step is a multiple
    of ``every``), in order, as Ray requires."""

    def __init__(self, every: int):
        self.every = every
        self.pending: queue.Queue = queue.Queue()
        self.failed: str | None = None
        self.thread = threading.Thread(target=self._run, name="ray-report", daemon=True)
        self.thread.start()

    def __call__(self, record: dict[str, Any]) -> None:
        if record["step"] % self.every == 0 and self.failed is None:
            self.pending.put({k: v for k, v in record.items() if isinstance(v, (int, float))})

    def _run(self) -> None:
        import ray.train

        while (metrics := self.pending.get()) is not None:
            try:
                ray.train.report(metrics)
            except Exception as e:  # Ray's side (a worker lost meanwhile): training goes on
                self.failed = f"{type(e).__name__}: {e}"
                emit_line(f"warning: reporting metrics to Ray failed ({self.failed}); metrics.jsonl "
                          "keeps every record", sys.stderr)
                return

    def close(self, timeout: float = 60.0) -> None:
        """Let the reports in flight reach Ray (every rank has made the same ones)."""
        self.pending.put(None)
        self.thread.join(timeout)


class WorkerFailed(RuntimeError):
    """The trainer on one worker ended with a non-zero status."""


def no_process_group_config(backend: str, save_on_signal: bool = False):
    """A ``TorchConfig`` that records the backend but leaves starting the process group to the
    trainer (see the module docstring: the rendezvous address is ours); with ``save_on_signal``
    each worker's signals stop its training loop with a save (``save_on_worker_signals``)."""
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

    return TrainerRendezvous(backend=backend, save_on_signal=save_on_signal)


@dataclass
class RaySetup:
    """What the launcher hands Ray: nothing in it holds a secret value."""

    spec: WorkerSpec
    """Each worker's ``train_loop_config``."""
    runtime_env: dict[str, Any]
    """The job's ``runtime_env`` (recorded by Ray: its logs, the dashboard, the job's metadata)."""
    secrets: PrivateFile | None
    """The secret values, for the workers that lack them; ``close`` removes it."""

    def close(self) -> None:
        if self.secrets is not None:
            self.secrets.remove()


def ray_setup(spec: WorkerSpec) -> RaySetup:
    """Split ``spec.env`` into what Ray may record and the secrets, which go to a private file."""
    public = {k: v for k, v in spec.env.items() if not is_secret(k)}
    secret = {k: v for k, v in spec.env.items() if is_secret(k)}
    private = PrivateFile(secret) if secret else None
    spec = replace(spec, env=public, secret_names=sorted(secret),
                   secrets_file=private.path if private else None)
    # Ray Train 2 copies every print of a worker into its log as well: each line would show twice.
    return RaySetup(spec, {"env_vars": {**public, "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}}, private)


def fit(spec: WorkerSpec, num_workers: int, checkpoint_dir: str | None, run_name: str,
        address: str | None = None, max_failures: int = 0, cpus_per_worker: float = 1.0,
        save_on_signal: bool = False) -> int:
    """Start (or join, with ``address``) a Ray cluster and train on ``num_workers`` workers;
    the exit status, with a one-line reason on stderr when it is not 0. With ``save_on_signal``
    (``checkpoint.dir`` and ``checkpoint.save_on_signal``), SIGTERM or SIGUSR1 to this process
    or to a worker makes every rank save at the same step and the run end with status 0."""
    ray = import_ray()
    from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchTrainer

    from megatron_lite.training.control import SIGNALS

    resources = {"cpu": {"CPU": cpus_per_worker}, "cuda": {"CPU": cpus_per_worker, "GPU": 1},
                 "hpu": {"CPU": cpus_per_worker, "HPU": 1}}[spec.device]
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    for sig in SIGNALS:
        # Until Ray's handler or the stop below takes over: a signal still ends the launcher
        # through the finally below, which removes the private file.
        signal.signal(sig, _exit_on_signal)
    setup = ray_setup(spec)
    failed = None
    stopped: list[str] = []
    watching = threading.Event()  # set: the drain watch ends
    try:
        # Without an address: a cluster of this machine alone, whose workers meet on loopback.
        ray.init(address=address, runtime_env=setup.runtime_env)
        config: dict[str, Any] = asdict(setup.spec)
        if save_on_signal:
            stop = ray.remote(num_cpus=0)(StopRequest).options(
                max_concurrency=max(1000, 2 * num_workers)).remote()
            config["stop"] = stop

            def on_signal(signum: int, _frame: Any) -> None:
                name = signal.Signals(signum).name
                if not stopped:
                    emit_line(f"ray: {name}: every rank saves a checkpoint at its next step and the "
                              "run ends", sys.stderr)
                    stop.request.remote(f"{name} (to the launcher)")
                stopped.append(name)

            for sig in SIGNALS:  # after ray.init, whose SIGTERM handler exits at once
                signal.signal(sig, on_signal)
            def on_drain(reason: str) -> None:
                emit_line(f"ray: {reason}: every rank saves a checkpoint at its next step; when "
                          "the node goes, Ray restarts the workers elsewhere and they resume "
                          "from it", sys.stderr)
                stop.ask_save.remote(reason)

            watch_drains(stop, on_drain, watching)
        storage = os.path.abspath(os.path.join(checkpoint_dir, "ray")) if checkpoint_dir else None
        trainer = TorchTrainer(
            worker_loop, train_loop_config=config,
            torch_config=no_process_group_config(DEVICE_BACKENDS[spec.device], save_on_signal),
            scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=spec.device == "cuda",
                                         resources_per_worker=resources),
            run_config=RunConfig(name=run_name, storage_path=storage, callbacks=[report_log()],
                                 failure_config=FailureConfig(max_failures=max_failures)))
        try:
            trainer.fit()
        except TrainingFailedError as e:
            failed = failure_reason(e)
    finally:
        watching.set()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        ray.shutdown()  # first: Ray's buffered worker lines come out before the reason
        setup.close()
    if failed is not None:
        print(f"error: training failed on Ray (--max-failures {max_failures}): {failed}", file=sys.stderr)
        return 1
    if stopped:
        print(f"ray: stopped by {stopped[0]}; the checkpoint of the last step is in {checkpoint_dir} "
              "(run the same command again to resume)", file=sys.stderr)
    return 0


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def report_log():
    """A Ray Train callback (on Ray's controller) that prints each report Ray received: the
    run's progress as Ray sees it, next to the workers' own lines."""
    from ray.train import UserCallback

    class ReportLog(UserCallback):
        def after_report(self, run_context, metrics, checkpoint) -> None:
            first = metrics[0] if metrics else {}
            print(f"ray: received the report of step {first.get('step')}: loss {first.get('loss')!r}",
                  flush=True)

    return ReportLog()


WORKER_REASON = re.compile(r"rank (\d+): exit status (\d+): error: (.*)", re.DOTALL)


def failure_reason(e: BaseException) -> str:
    """One line for a failed Ray Train run: the first rank's own reason (``WorkerFailed``),
    else what Ray says about the worker that failed (a process or node lost), else Ray's first
    line."""
    failures = getattr(e, "worker_failures", None) or {}
    texts = [str(failures[rank]) for rank in sorted(failures)] + [str(e)]
    for text in texts:
        if m := WORKER_REASON.search(text):
            reason = m.group(3).strip()
            # Reasons from a collective already name their rank.
            return reason if reason.startswith("rank ") else f"rank {m.group(1)}: {reason}"
    for rank in sorted(failures):
        lines = [line.strip() for line in str(failures[rank]).splitlines() if line.strip()]
        if lines:
            return f"rank {rank}: {lines[-1]}"
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__
