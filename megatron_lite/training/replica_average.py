"""HSDP's exchange between shard groups, overlapped with the backward pass.

Under HSDP each rank's gradient shard is averaged over its replica group (the ranks holding the
same shard in the other shard groups). ZeRO-3 reduce-scatters the gradients within the shard
group bucket by bucket while the backward pass runs; each bucket's shard is all-reduced over
the replica group as soon as ZeRO-3 has written it (``after_each_zero3_bucket``), so the
transfer runs beside the backward of the layers before it, and only what the last buckets still
have in flight when the backward ends is waited for (FSDP2's HSDP orders its all-reduce after
each reduce-scatter the same way). Only the backward that ends a step sends: the shard is the
sum over its micro-batches by then.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import megatron_lite.distributed.collectives as collectives
from megatron_lite.engine import internals as ds


class ReplicaAverage:
    def __init__(self, engine, group, replicas: int):
        """``group``: this rank's replica group (device), of ``replicas`` ranks."""
        self.group, self.replicas = group, replicas
        self.armed = False
        """Set by the step for the backward pass that ends it: only that one's buckets are sent."""
        self._shard = ds.zero3_gradient_shard(engine)
        self._pending: list[Callable[[], torch.Tensor]] = []  # each piece's wait
        ds.after_each_zero3_bucket(engine, self._reduced)

    def _reduced(self, pieces: list[torch.Tensor] | None) -> None:
        if self.armed:
            self._pending += [collectives.all_reduce_start(p, self.group) for p in pieces or ()]

    def finish(self) -> None:
        """After the backward pass that ends a step: every piece of the shard is the mean over
        the replicas once this returns."""
        pending, self._pending, self.armed = self._pending, [], False
        if not pending and self._shard.numel():
            # Without this the replicas would step on gradients of their own shard group only.
            raise RuntimeError("HSDP: ZeRO-3 handed over no reduced gradient bucket during the backward "
                               "pass; this DeepSpeed release is not one the replica average supports")
        for wait in pending:
            wait().div_(self.replicas)
