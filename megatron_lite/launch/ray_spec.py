"""What the Ray launcher hands every worker: the spec of its run, the launcher's environment
it needs, and the secrets, kept out of what Ray records (its logs, dashboard and job metadata)."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import MutableMapping
from dataclasses import dataclass, field, replace
from typing import Any

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
