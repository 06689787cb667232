"""ParallelDims: the run's process layout, built once and passed explicitly (no globals)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from megatron_lite.config.schema import Config


class TopologyError(ValueError):
    """The recipe's parallel layout does not fit the world size or the model."""


# Rank order, innermost first (Megatron's): tensor ranks are neighbours (one node, fastest links),
# then Ulysses sequence ranks (their all-to-all stays in the node), then context-parallel ranks
# (the ring's point-to-point crosses nodes), then data-parallel replicas, then pipeline stages.
AXES = ("tensor", "ulysses", "context", "data", "pipeline")
# The accelerator groups: name -> the axes along which its ranks differ ("sequence": the ranks
# that split one sequence, Ulysses × context; DeepSpeed also asks for data × sequence, the ranks
# that average gradients; the step's report reduces over every rank on the device,
# training/step_report.py: never over the default group, see collectives.py).
GROUP_AXES = {"tensor": ("tensor",), "ulysses": ("ulysses",), "context": ("context",),
              "data": ("data",), "pipeline": ("pipeline",), "sequence": ("ulysses", "context"),
              "sequence_data": ("ulysses", "context", "data"), "world": AXES}
HOST_GROUPS = ("control", "checkpoint", "setup", "watch")
"""The gloo groups of host control, each of every rank (``create_control_groups``)."""


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the parallel dimensions and this rank's place in them.

    ``world_size = tensor × ulysses × context × data × pipeline``. Process groups are created once by
    ``create_groups`` (a collective) and kept here; ``mpu()`` gives DeepSpeed its view of them.
    """

    world_size: int
    rank: int
    local_rank: int
    tensor: int
    pipeline: int
    data: int
    ulysses: int = 1
    sequence_parallel: bool = False
    hsdp_shard_size: int = 0
    """0: no HSDP; otherwise ZeRO-3 shards within groups of this many data-parallel ranks
    (``shard`` groups), whose replicas average gradient shards over ``replica`` groups."""
    context: int = 1
    groups: dict = field(default_factory=dict, compare=False, repr=False)

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def coordinate(self, axis: str, rank: int | None = None) -> int:
        rank = self.rank if rank is None else rank
        for a in AXES:
            if a == axis:
                return rank % self.size(a)
            rank //= self.size(a)
        raise KeyError(axis)

    @property
    def tp_rank(self) -> int:
        return self.coordinate("tensor")

    @property
    def ulysses_rank(self) -> int:
        return self.coordinate("ulysses")

    @property
    def context_rank(self) -> int:
        return self.coordinate("context")

    @property
    def sequence(self) -> int:
        """How many ranks split one sequence: Ulysses × context."""
        return self.ulysses * self.context

    @property
    def sequence_rank(self) -> int:
        """This rank's place among them (its rank in the ``sequence`` group)."""
        return self.ulysses_rank + self.ulysses * self.context_rank

    @property
    def dp_rank(self) -> int:
        return self.coordinate("data")

    @property
    def pp_rank(self) -> int:
        return self.coordinate("pipeline")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def hsdp_replicas(self) -> int:
        """How many copies of each shard group there are (1 without HSDP)."""
        return self.data // self.hsdp_shard_size if self.hsdp_shard_size else 1

    @property
    def deepspeed_data(self) -> int:
        """The data-parallel size DeepSpeed sees: one shard group under HSDP; under pipeline
        parallelism the sequence ranks too (the pipeline engine's topology has no sequence axis:
        ``engine/pipeline.py``)."""
        if self.pipeline > 1:
            return self.data * self.sequence
        return self.hsdp_shard_size or self.data

    @property
    def shard_rank(self) -> int:
        """This rank's place in its HSDP shard group (its ZeRO partition)."""
        return self.dp_rank % self.hsdp_shard_size if self.hsdp_shard_size else self.dp_rank

    @property
    def replica_rank(self) -> int:
        """Which copy of the shard group this rank belongs to (0 without HSDP)."""
        return self.dp_rank // self.hsdp_shard_size if self.hsdp_shard_size else 0

    def hsdp_group_ranks(self) -> tuple[list[list[int]], list[list[int]]]:
        """(shard groups, replica groups): each data-parallel group cut into consecutive runs of
        ``hsdp_shard_size`` ranks (neighbours: one node by default), and the ranks at the same
        place in each run."""
        shards, replicas = [], []
        for ranks in self.group_ranks(("data",)):
            runs = [ranks[i:i + self.hsdp_shard_size] for i in range(0, len(ranks), self.hsdp_shard_size)]
            shards += runs
            replicas += [list(column) for column in zip(*runs, strict=True)]
        return shards, replicas

    def hsdp_sequence_shard_ranks(self) -> list[list[int]]:
        """HSDP with sequence ranks (context, Ulysses): the ranks ZeRO-3 partitions over, one
        shard group's data ranks with every sequence rank of each (DeepSpeed's sequence-data
        group under HSDP). Without sequence ranks these are the shard groups."""
        groups = []
        for ranks in self.group_ranks(("ulysses", "context", "data")):
            by_replica: dict[int, list[int]] = {}
            for r in ranks:
                by_replica.setdefault(self.coordinate("data", r) // self.hsdp_shard_size, []).append(r)
            groups += by_replica.values()
        return groups

    def group_ranks(self, axes: tuple[str, ...]) -> list[list[int]]:
        """All groups of ranks that differ only along ``axes`` (each sorted)."""
        by_key: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size):
            key = tuple(self.coordinate(a, r) for a in AXES if a not in axes)
            by_key.setdefault(key, []).append(r)
        return list(by_key.values())

    def create_groups(self, timeout: timedelta, setup_timeout: timedelta | None = None) -> None:
        """Collective: one accelerator group per dimension (and the combinations DeepSpeed asks
        for), created on every rank in the same order as ``dist.new_group`` requires, and the two
        gloo groups of host control (``distributed/collectives.py``). Created for one rank too,
        so that a one-device run takes the same paths as a multi-device one."""
        import torch.distributed as dist  # here: a launcher's layout check needs no torch

        from megatron_lite.distributed import hang

        self.create_control_groups(timeout, setup_timeout)
        for name, axes in GROUP_AXES.items():
            for ranks in self.group_ranks(axes):
                # No backend: the default group's, i.e. the accelerator's (NCCL, HCCL; gloo on CPU).
                group = dist.new_group(ranks, timeout=timeout)
                if self.rank in ranks:
                    self.groups[name] = group
        if self.hsdp_shard_size:
            shards, replicas = self.hsdp_group_ranks()
            for name, all_ranks in (("shard", shards), ("replica", replicas),
                                    ("sequence_shard", self.hsdp_sequence_shard_ranks())):
                for ranks in all_ranks:
                    group = dist.new_group(ranks, timeout=timeout)
                    if self.rank in ranks:
                        self.groups[name] = group
        if self.pipeline > 1:
            # The first and last stage of each pipeline (Megatron's embedding group): the two
            # copies of a tied embedding sum their gradients over it.
            for ranks in self.group_ranks(("pipeline",)):
                ends = [ranks[0], ranks[-1]]
                group = dist.new_group(ends, timeout=timeout)
                if self.rank in ends:
                    self.groups["embedding"] = group
        for name, group in self.groups.items():  # hang.py's record names each group's ranks
            limit = setup_timeout if name == "setup" and setup_timeout else timeout
            if name == "watch":
                limit = min(timeout, timedelta(minutes=1))
            hang.register_group(group, name, limit.total_seconds())

    def create_control_groups(self, timeout: timedelta, setup_timeout: timedelta | None = None) -> None:
        """Collective: the gloo groups of host control, first (once), so that ranks can agree
        on the rest of the layout before its groups exist."""
        import torch.distributed as dist

        if "control" in self.groups:
            return
        # Host-side agreement (errors, stop flags, votes, objects) over gloo: it never waits for
        # the accelerator, and NCCL/HCCL groups would refuse host tensors.
        self.groups["control"] = dist.new_group(timeout=timeout, backend="gloo")
        # A background checkpoint writer's collectives, apart from the training step's.
        self.groups["checkpoint"] = dist.new_group(timeout=timeout, backend="gloo")
        # Where ranks wait while one builds the dataset: a gloo collective waits for its group's
        # timeout whatever it is given (torch before 2.10 has no barrier(timeout=), and gloo
        # ignores a per-call timeout), so the long wait needs a group of its own.
        self.groups["setup"] = dist.new_group(timeout=setup_timeout or timeout, backend="gloo")
        # The hang watchers' exchange (distributed/hang.py), from a thread of their own.
        # Its timeout is short: a rank whose watcher stops answering (a frozen process) is
        # reported well before the collectives' own timeout.
        self.groups["watch"] = dist.new_group(timeout=min(timeout, timedelta(minutes=1)), backend="gloo")

    def group(self, name: str):
        """The process group of this rank along ``name``; None only where torch.distributed was
        never started (one process in unit tests and tools)."""
        if name in self.groups:
            return self.groups[name]
        if self.world_size == 1:
            return None
        raise KeyError(f"process group '{name}' does not exist: ParallelDims.create_groups was not called")

    @staticmethod
    def plan(cfg: Config, world_size: int, rank: int = 0, local_rank: int = 0,
             local_world_size: int = 1) -> ParallelDims:
        """Validate the layout for ``world_size`` ranks; every problem is reported together."""
        p, m, t = cfg.parallel, cfg.model, cfg.training
        problems = []
        model_ranks = p.tensor * p.pipeline * p.ulysses * p.context
        if world_size % model_ranks:
            problems.append(f"world size {world_size} is not divisible by parallel.tensor × "
                            f"parallel.pipeline × parallel.ulysses × parallel.context = {p.tensor} × "
                            f"{p.pipeline} × {p.ulysses} × {p.context}; change one of them or the "
                            "number of ranks")
        dp = max(world_size // model_ranks, 1)
        if t.global_batch_size is not None and t.global_batch_size % (t.micro_batch_size * dp):
            problems.append(f"training.global_batch_size={t.global_batch_size} is not a multiple of "
                            f"training.micro_batch_size × data-parallel size = "
                            f"{t.micro_batch_size} × {dp}")
        ramp = t.rampup_batch_size
        if ramp is not None and len(ramp) == 3 and (ramp[0] % (t.micro_batch_size * dp)
                                                    or ramp[1] % (t.micro_batch_size * dp)):
            problems.append(f"training.rampup_batch_size={list(ramp)}: its start and increment must be "
                            f"multiples of training.micro_batch_size × data-parallel size = "
                            f"{t.micro_batch_size} × {dp}, so that every batch splits into micro-batches")
        if m.vocab_size is not None and m.vocab_size % p.tensor:
            problems.append(f"model.vocab_size={m.vocab_size} must be divisible by parallel.tensor="
                            f"{p.tensor} (or leave it null: the tokenizer's vocabulary is padded "
                            "to model.vocab_multiple × parallel.tensor)")
        shard = 0
        if p.hsdp:
            # Default: the data-parallel ranks of one node (its other ranks are tensor peers).
            shard = p.hsdp_shard_size or max(1, local_world_size // (p.tensor * p.ulysses * p.context))
            if shard < 1 or dp % shard:
                problems.append(f"parallel.hsdp_shard_size={shard} must divide the {dp} "
                                "data-parallel ranks (default: the ranks of one node)")
        if problems:
            raise TopologyError("parallel layout problem(s):\n" + "\n".join(f"  - {x}" for x in problems))
        return ParallelDims(world_size, rank, local_rank, p.tensor, p.pipeline, dp, p.ulysses,
                            p.sequence_parallel and p.tensor > 1, shard, context=p.context)

    def global_batch(self, cfg: Config) -> int:
        return cfg.training.global_batch_size or cfg.training.micro_batch_size * self.data

    def grad_accumulation(self, cfg: Config) -> int:
        return self.global_batch(cfg) // (cfg.training.micro_batch_size * self.data)
