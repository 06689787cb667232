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

import os
import queue
import re
import signal
import socket
import sys
import threading
from dataclasses import asdict
from typing import Any

from megatron_lite.launch.ray_control import (
    StopRequest,
    follow_launcher,
    no_process_group_config,
    watch_drains,
)
from megatron_lite.launch.ray_rendezvous import rendezvous
from megatron_lite.launch.ray_spec import WorkerSpec, ray_setup, take_secrets
from megatron_lite.logging.console import emit_line

RAY_VERSIONS = ">=2.60,<3"
"""Ray Train 2's API (``ray.train.collective``, ``UserCallback``, the controller that restarts
worker groups), as tested; setup.py's ``ray`` extra."""


class RayNotInstalled(RuntimeError):
    """Ray (or Ray Train) is missing from this environment."""


class RayNotReached(RuntimeError):
    """``--address`` names no Ray cluster this machine reaches."""


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
    env.export()
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
        if address and (problem := unreachable(address)):
            raise RayNotReached(f"--address {address}: no Ray cluster reached ({problem}); start "
                                "one with `ray start --head`, or leave out --address to start one "
                                "of this machine alone")
        try:
            ray.init(address=address, runtime_env=setup.runtime_env)
        except ConnectionError as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise RayNotReached(f"--address {address}: no Ray cluster reached ({first}); start one "
                                "with `ray start --head`, or leave out --address to start one of "
                                "this machine alone") from None
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
            torch_config=no_process_group_config(save_on_signal),
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


def unreachable(address: str, timeout: float = 10.0) -> str | None:
    """Why a ``HOST:PORT`` address takes no connection, or None (also for addresses that are
    not of that form: ``auto``, ``ray://...``). Ray itself retries an address nobody listens
    on for minutes before it gives up."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in address:
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    return None


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
