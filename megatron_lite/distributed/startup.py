"""Starting and ending the process groups: the backend, this rank's device, the parallel groups
(``init_distributed``); their teardown after a run (``shutdown_distributed``) or a failure
(``abandon_distributed``)."""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

# (Module imports by full name: the package's __init__ imports this module.)
import megatron_lite.distributed.collectives as collectives
import megatron_lite.distributed.cpu_extensions as cpu_extensions
import megatron_lite.distributed.device as devmod
import megatron_lite.distributed.hang as hang
from megatron_lite.config.schema import Config
from megatron_lite.distributed.hang_report import ranks_text
from megatron_lite.distributed.launcher_env import LaunchEnv
from megatron_lite.distributed.parallel_dims import ParallelDims, TopologyError


def init_distributed(cfg: Config, env: LaunchEnv):
    """Start the process group, create the parallel groups and pick this rank's device.
    Returns (ParallelDims, accelerator)."""
    # HSDP's default shard group is one node's ranks, a count each rank has from its own
    # launcher: planned once the ranks agree on it (a rank refusing alone, or building other
    # groups, would leave the others waiting). Until then the whole data axis stands in.
    node_sized = cfg.parallel.hsdp and cfg.parallel.hsdp_shard_size is None and env.world_size > 1
    dims = ParallelDims.plan(cfg, env.world_size, env.rank, env.local_rank,
                             env.world_size if node_sized else env.local_world_size)
    acc = devmod.select_accelerator(cfg.training.device, cfg.training.hpu_mode)
    devmod.set_matmul_precision(acc, cfg.training.tf32)
    if acc.device_name() == "cpu" and cfg.training.cpu_retain_freed_memory:
        devmod.retain_freed_host_memory()
    env.export()
    if acc.device_name() != "cpu":
        acc.set_device(env.local_rank)
    if acc.device_name() == "cuda" and cfg.distributed.hang_dump_after > 0:
        # Before NCCL's groups exist (they read it when made); torch writes into the folder
        # without making it.
        folder = Path(cfg.logging.dir) / "hang"
        os.environ.update(hang.nccl_recorder_environment(folder))
        folder.mkdir(parents=True, exist_ok=True)
    timeout = timedelta(minutes=cfg.distributed.timeout_minutes)
    # DeepSpeed's own groups (pipeline, ZeRO) are made without a timeout: make ours the default.
    collectives.set_default_timeout(timeout)
    # Before DeepSpeed builds any op: the communication op on CPU (below), CPU Adam and async I/O
    # with offload, its GPU ops; none may wait silently on a lock a stopped build left.
    if acc.device_name() == "cpu":
        cpu_extensions.use_environment_extensions_dir()
    cpu_extensions.guard_op_builds(print if env.local_rank == 0 else (lambda _: None))
    if not dist.is_initialized():
        import deepspeed

        deepspeed.init_distributed(dist_backend=devmod.communication_backend(acc),
                                   auto_mpi_discovery=False, verbose=False, timeout=timeout)
    setup = timedelta(minutes=cfg.distributed.setup_timeout_minutes)
    if node_sized:
        dims.create_control_groups(timeout, setup)
        groups = dims.groups
        dims = ParallelDims.plan(cfg, env.world_size, env.rank, env.local_rank, agreed_node_size(dims, env))
        dims.groups.update(groups)
    dims.create_groups(timeout, setup)
    return dims, acc


def agreed_node_size(dims: ParallelDims, env: LaunchEnv) -> int:
    """Collective (control group): the ranks per node every rank's launcher reports, when they
    all report the same; else every rank raises the same ``TopologyError``."""
    sizes = collectives.all_gather_object(env.local_world_size, dims,
                                          "the ranks per node (HSDP's shard group)")
    if len(set(sizes)) == 1:
        return sizes[0]
    by_size: dict[int, list[int]] = {}
    for rank, size in enumerate(sizes):
        by_size.setdefault(size, []).append(rank)
    seen = "; ".join(f"{ranks_text(ranks)}: {size} per node" for size, ranks in by_size.items())
    raise TopologyError(
        f"parallel.hsdp: the default shard group is the ranks of one node, but the launcher places "
        f"different numbers of ranks on the nodes ({seen}); run the same number of ranks on every "
        "node, or set parallel.hsdp_shard_size")


def shutdown_distributed(dims: ParallelDims) -> None:
    """After a successful run: wait for every rank, then tear the process groups down in order
    (left to interpreter exit, gloo's threads can abort the process)."""
    if dist.is_initialized():
        try:
            collectives.barrier(dims, "the end of the run")
        except BaseException:
            abandon_distributed()
            raise
        dist.destroy_process_group()


def abandon_distributed(wait_seconds: float = 30.0) -> None:
    """After a failure on this rank: tear the process groups down locally, without waiting for
    the other ranks (they may be the ones that failed). Left to interpreter exit, gloo's and the
    store's C++ threads can abort the process ("terminate called without an active exception"),
    turning a clean one-line error into a crash. A backend whose teardown blocks on a peer cannot
    keep the rank from exiting: the teardown gets `wait_seconds`, then the rank goes on."""
    if not dist.is_initialized():
        return

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - already failing; the first error is the one reported
            pass

    teardown = threading.Thread(target=destroy, name="abandon-process-groups", daemon=True)
    teardown.start()
    teardown.join(wait_seconds)
