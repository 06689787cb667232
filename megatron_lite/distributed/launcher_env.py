"""Rank, world size and rendezvous address from whatever launched this process.

The only place that reads launcher environment variables. Recognised, in order: torchrun /
the DeepSpeed launcher (``RANK``), Open MPI (``OMPI_COMM_WORLD_*``), MPICH / Cray PALS
(``PMI_*``, ``PALS_*``, Hydra's ``MPI_LOCALRANKID``), Slurm (``SLURM_*``); none of them means a
single process. The rendezvous host is ``MASTER_ADDR``, else the first host of the PBS node file,
else the first of Slurm's node list.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    launcher: str
    local_world_size: int = 1
    """Ranks on this node (the default HSDP shard group)."""

    def export(self, environ: MutableMapping[str, str] = os.environ) -> None:
        """Write this rank's place as torchrun would (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
        ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): what torch.distributed and
        DeepSpeed read, whichever launcher started the process."""
        for key, value in {"RANK": self.rank, "LOCAL_RANK": self.local_rank, "WORLD_SIZE": self.world_size,
                           "LOCAL_WORLD_SIZE": self.local_world_size, "MASTER_ADDR": self.master_addr,
                           "MASTER_PORT": self.master_port}.items():
            environ[key] = str(value)


def _first_host(env: Mapping[str, str]) -> str | None:
    nodefile = env.get("PBS_NODEFILE")
    if nodefile and os.path.isfile(nodefile):
        with open(nodefile) as f:
            for line in f:
                if line.strip():
                    return line.strip()
    return None


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``nid[0012-0015,0020],gpu7`` -> ``nid0012``."""
    m = re.match(r"([^,\[]+)(?:\[([^\],-]+))?", nodelist)
    if m is None:
        return nodelist
    return m.group(1) + (m.group(2) or "")


def detect(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """The launch environment described by ``env`` (default: ``os.environ``)."""
    env = os.environ if env is None else env

    def get(*names: str, default: str | None = None) -> str | None:
        for n in names:
            if env.get(n, "") != "":
                return env[n]
        return default

    if "RANK" in env and "WORLD_SIZE" in env:
        launcher, rank, world = "torchrun", get("RANK"), get("WORLD_SIZE")
        local = get("LOCAL_RANK", default="0")
        local_size = get("LOCAL_WORLD_SIZE")
    elif "OMPI_COMM_WORLD_RANK" in env:
        launcher, rank, world = "openmpi", get("OMPI_COMM_WORLD_RANK"), get("OMPI_COMM_WORLD_SIZE")
        local = get("OMPI_COMM_WORLD_LOCAL_RANK", default="0")
        local_size = get("OMPI_COMM_WORLD_LOCAL_SIZE")
    elif "PMI_RANK" in env:
        launcher, rank, world = "mpich", get("PMI_RANK"), get("PMI_SIZE")
        local = get("PMI_LOCAL_RANK", "PALS_LOCAL_RANKID", "MPI_LOCALRANKID", default="0")
        local_size = get("PMI_LOCAL_SIZE", "PALS_LOCAL_SIZE", "MPI_LOCALNRANKS")
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        launcher, rank, world = "slurm", get("SLURM_PROCID"), get("SLURM_NTASKS")
        local = get("SLURM_LOCALID", default="0")
        local_size = (get("SLURM_NTASKS_PER_NODE") or "").split("(")[0] or None
    else:
        launcher, rank, world, local, local_size = "none", "0", "1", "0", "1"
    if world is None:
        raise RuntimeError(f"launched by {launcher} but the world size is not set in the environment")
    addr = get("MASTER_ADDR") or _first_host(env)
    if addr is None and launcher == "slurm" and get("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        addr = first_slurm_host(get("SLURM_JOB_NODELIST", "SLURM_NODELIST") or "")
    addr = addr or "127.0.0.1"
    port = get("MASTER_PORT")
    if port is None:
        # A lone process lets its store's server bind any free port (port 0), so that several
        # can run side by side: choosing a free port first and binding it later leaves a window
        # in which another process can take it (EADDRINUSE). Launched jobs need one agreed port.
        port = "0" if launcher == "none" else "29500"
    # Without a count from the launcher, assume the whole job is on one node.
    return LaunchEnv(int(rank), int(local), int(world), addr, int(port), launcher,
                     int(local_size or world))
