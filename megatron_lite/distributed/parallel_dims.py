"""ParallelDims: the run's process layout, built once and passed explicitly (no globals)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from megatron_lite.config.schema import Config
from megatron_lite.distributed import device as devmod
from megatron_lite.distributed.launcher_env import LaunchEnv

T = TypeVar("T")


class TopologyError(ValueError):
    """The recipe's parallel layout does not fit the world size or the model."""


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    rank: int
    local_rank: int
    tensor: int
    pipeline: int
    data: int

    @property
    def dp_rank(self) -> int:
        # Megatron order: tensor ranks innermost, then data, then pipeline.
        return (self.rank // self.tensor) % self.data

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @staticmethod
    def plan(cfg: Config, world_size: int, rank: int = 0, local_rank: int = 0) -> ParallelDims:
        """Validate the layout for ``world_size`` ranks; every problem is reported together."""
        p, m, t = cfg.parallel, cfg.model, cfg.training
        problems = []
        if world_size % (p.tensor * p.pipeline):
            problems.append(f"world size {world_size} is not divisible by parallel.tensor × "
                            f"parallel.pipeline = {p.tensor} × {p.pipeline}")
        if p.tensor > 1 or p.pipeline > 1:
            problems.append(f"parallel.tensor={p.tensor}, parallel.pipeline={p.pipeline}: tensor and "
                            "pipeline parallelism are not available in this version; use 1")
        dp = max(world_size // (p.tensor * p.pipeline), 1)
        if t.global_batch_size is not None and t.global_batch_size % (t.micro_batch_size * dp):
            problems.append(f"training.global_batch_size={t.global_batch_size} is not a multiple of "
                            f"training.micro_batch_size × data-parallel size = "
                            f"{t.micro_batch_size} × {dp}")
        kv = m.n_kv_heads or m.n_heads
        if m.n_heads % p.tensor or kv % p.tensor:
            problems.append(f"model.n_heads={m.n_heads} and n_kv_heads={kv} must be divisible by "
                            f"parallel.tensor={p.tensor}")
        if m.n_layers % p.pipeline:
            problems.append(f"model.n_layers={m.n_layers} must be divisible by "
                            f"parallel.pipeline={p.pipeline}")
        if problems:
            raise TopologyError("parallel layout problem(s):\n" + "\n".join(f"  - {x}" for x in problems))
        return ParallelDims(world_size, rank, local_rank, p.tensor, p.pipeline, dp)

    def global_batch(self, cfg: Config) -> int:
        return cfg.training.global_batch_size or cfg.training.micro_batch_size * self.data

    def grad_accumulation(self, cfg: Config) -> int:
        return self.global_batch(cfg) // (cfg.training.micro_batch_size * self.data)


def init_distributed(cfg: Config, env: LaunchEnv):
    """Start the process group and pick this rank's device. Returns (ParallelDims, accelerator)."""
    dims = ParallelDims.plan(cfg, env.world_size, env.rank, env.local_rank)
    acc = devmod.select_accelerator(cfg.training.device)
    for key, value in {"RANK": env.rank, "LOCAL_RANK": env.local_rank, "WORLD_SIZE": env.world_size,
                       "MASTER_ADDR": env.master_addr, "MASTER_PORT": env.master_port}.items():
        os.environ[key] = str(value)
    if acc.device_name() != "cpu":
        acc.set_device(env.local_rank)
    if not dist.is_initialized():
        import deepspeed

        deepspeed.init_distributed(dist_backend=devmod.communication_backend(acc),
                                   auto_mpi_discovery=False, verbose=False)
    return dims, acc


def raise_together(error: BaseException | None) -> None:
    """Collective: every rank raises if any rank has an ``error`` (its own, or a pointer to the
    other rank's), instead of the healthy ranks waiting forever in a later collective."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        failed = torch.tensor([int(error is not None)])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item() and error is None:
            raise RuntimeError("another rank failed (its error is printed above)")
    if error is not None:
        raise error


def on_one_rank_then_all(fn: Callable[[], None], dims: ParallelDims, per_node: bool = False) -> None:
    """Run ``fn`` on rank 0 (or, with ``per_node``, on local rank 0 of every node: node-local
    disks) while the others wait; if it fails, every rank raises."""
    error: BaseException | None = None
    if (dims.local_rank if per_node else dims.rank) == 0:
        try:
            fn()
        except Exception as e:  # re-raised by raise_together, on every rank
            error = e
    raise_together(error)


def on_every_rank(fn: Callable[[], T]) -> T:
    """``fn()`` on every rank; if it fails on any, every rank raises."""
    try:
        result, error = fn(), None
    except Exception as e:
        result, error = None, e
    raise_together(error)
    return result  # type: ignore[return-value]


def all_reduce_mean(values: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over all ranks (in place on a copy)."""
    out = values.clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out)
        out /= dist.get_world_size()
    return out
