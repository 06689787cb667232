"""Training under Ray Train: a ``TorchTrainer`` whose workers run the same path as ``pretrain.py``
(``train_to_exit_status``), restarted by Ray when a worker process or node dies.

What this module decides, and why:

- **The rendezvous is ours.** Ray's own torch backend starts the process group at the address
  that ``ray.util.get_node_ip_address()`` gives the first worker: the interface that routes to
  the internet, which on a node with several interfaces (or a machine whose head runs on
  loopback) is not the one the job should use. Here the Ray backend starts nothing; the first
  worker picks the address (``MASTER_ADDR`` in the launcher's environment, else
  ``distributed.master_addr``, else the address its Ray node registered with the cluster) and a
  free port, hands both to the others with ``ray.train.collective.broadcast_from_rank_zero``,
  and the trainer starts its groups there as under any launcher.
- **Restarts resume from our checkpoints.** When a worker dies, Ray stops the group and starts
  the training function again on fresh workers (``FailureConfig.max_failures``); the trainer
  resumes from the newest committed checkpoint in ``checkpoint.dir`` as any restarted job does.
  Ray's own checkpoint registry is not used: the checkpoint directory is already the run's
  durable state, written once per shard group.
- **Metrics go to Ray too.** Every training record is reported with ``ray.train.report`` (a
  barrier across workers in Ray Train 2, so every rank reports, at the same steps).
"""

from __future__ import annotations

import os
import queue
import re
import socket
import sys
import threading
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from megatron_lite.logging.console import emit_line

RAY_VERSIONS = ">=2.60,<3"
"""Ray Train 2's API (``ray.train.collective``, ``UserCallback``, the controller that restarts
worker groups), as tested; setup.py's ``ray`` extra."""

DEVICE_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "hpu": "hccl"}
FORWARDED_ENV = ("TORCH_EXTENSIONS_DIR", "OMP_NUM_THREADS", "WANDB_MODE", "WANDB_API_KEY",
                 "WANDB_DIR", "HF_HOME", "HF_HUB_OFFLINE", "PYTHONPATH")
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
    """The rendezvous host, when the launcher or the recipe names one."""
    env: dict[str, str] = field(default_factory=dict)
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


def rendezvous(spec: WorkerSpec, rank: int) -> tuple[str, int]:
    """(host, port) agreed by every worker: the first worker's choice, broadcast through Ray."""
    from ray.train.collective import broadcast_from_rank_zero

    chosen = None
    if rank == 0:
        chosen = (spec.master_addr or _node_address(), free_port())
    return broadcast_from_rank_zero(chosen)


def worker_loop(spec_dict: dict[str, Any]) -> None:
    """The training function of every Ray worker: the trainer as ``pretrain.py`` runs it."""
    import ray.train

    from megatron_lite.config import load_config
    from megatron_lite.distributed.launcher_env import LaunchEnv
    from megatron_lite.training.entry import train_outcome

    spec = WorkerSpec(**spec_dict)
    os.environ.update(spec.env)
    if spec.cwd and os.path.isdir(spec.cwd):
        os.chdir(spec.cwd)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    host, port = rendezvous(spec, rank)
    if rank == 0:
        print(f"ray: {world} workers, rendezvous at {host}:{port}", flush=True)
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


def no_process_group_config(backend: str):
    """A ``TorchConfig`` that records the backend but leaves starting the process group to the
    trainer (see the module docstring: the rendezvous address is ours)."""
    from ray.train.backend import Backend
    from ray.train.torch import TorchConfig

    class _GroupStartedByTrainer(Backend):
        # Every worker sees all of its node's accelerators and picks its own by local rank,
        # as under torchrun.
        share_cuda_visible_devices = True

    class TrainerRendezvous(TorchConfig):
        @property
        def backend_cls(self):
            return _GroupStartedByTrainer

    return TrainerRendezvous(backend=backend)


def fit(spec: WorkerSpec, num_workers: int, checkpoint_dir: str | None, run_name: str,
        address: str | None = None, max_failures: int = 0, cpus_per_worker: float = 1.0) -> int:
    """Start (or join, with ``address``) a Ray cluster and train on ``num_workers`` workers;
    the exit status, with a one-line reason on stderr when it is not 0."""
    ray = import_ray()
    from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchTrainer

    resources = {"cpu": {"CPU": cpus_per_worker}, "cuda": {"CPU": cpus_per_worker, "GPU": 1},
                 "hpu": {"CPU": cpus_per_worker, "HPU": 1}}[spec.device]
    # Ray Train 2 copies every print of a worker into its log as well: each line would show twice.
    worker_env = {**spec.env, "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
    if address is None:
        # A cluster of this machine alone: the workers meet on loopback, which every machine
        # has and nothing outside reaches (Ray itself listens on the machine's own address).
        spec = replace(spec, master_addr=spec.master_addr or "127.0.0.1")
        ray.init(runtime_env={"env_vars": worker_env})
    else:
        ray.init(address=address, runtime_env={"env_vars": worker_env})
    storage = os.path.abspath(os.path.join(checkpoint_dir, "ray")) if checkpoint_dir else None
    trainer = TorchTrainer(
        worker_loop, train_loop_config=asdict(spec),
        torch_config=no_process_group_config(DEVICE_BACKENDS[spec.device]),
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=spec.device == "cuda",
                                     resources_per_worker=resources),
        run_config=RunConfig(name=run_name, storage_path=storage, callbacks=[report_log()],
                             failure_config=FailureConfig(max_failures=max_failures)))
    failed = None
    try:
        trainer.fit()
    except TrainingFailedError as e:
        failed = failure_reason(e)
    finally:
        ray.shutdown()  # first: Ray's buffered worker lines come out before the reason
    if failed is not None:
        print(f"error: training failed on Ray (--max-failures {max_failures}): {failed}", file=sys.stderr)
        return 1
    return 0


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
            return f"rank {m.group(1)}: {m.group(3).strip()}"
    for rank in sorted(failures):
        lines = [line.strip() for line in str(failures[rank]).splitlines() if line.strip()]
        if lines:
            return f"rank {rank}: {lines[-1]}"
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__
