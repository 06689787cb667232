"""The ``mpu`` DeepSpeed's engine queries: Megatron's names for our process groups."""

from __future__ import annotations

from megatron_lite.distributed.parallel_dims import ParallelDims


class ModelParallelUnit:
    """The ``mpu`` interface DeepSpeed's engine queries (Megatron's names). Used without
    pipeline parallelism; the pipeline engine builds its own from the same rank order.

    Under HSDP, DeepSpeed's data-parallel world is the shard group, and its sequence-data world
    the shard group's ranks with their sequence ranks (``sequence_shard``): ZeRO-3 shards,
    gathers and reduces gradients there and knows nothing of the replicas, whose gradient
    average ``StepRunner`` adds (one all-reduce of each rank's gradient shard over its replica
    group).
    """

    def __init__(self, dims: ParallelDims):
        self.dims = dims
        self._hsdp = bool(dims.hsdp_shard_size)

    def _size(self, name: str) -> int:
        d = self.dims
        if self._hsdp and name == "data":
            return d.hsdp_shard_size
        if self._hsdp and name == "sequence_data":
            return d.hsdp_shard_size * d.sequence
        return {"sequence_data": d.data * d.sequence}.get(name) or d.size(name)

    def _rank(self, name: str) -> int:
        d = self.dims
        if self._hsdp and name == "data":
            return d.shard_rank
        if self._hsdp and name == "sequence_data":
            return d.shard_rank * d.sequence + d.sequence_rank
        if name == "sequence_data":
            return d.dp_rank * d.sequence + d.sequence_rank
        if name == "sequence":
            return d.sequence_rank
        return d.coordinate(name)

    def _group(self, name: str):
        if self._hsdp:
            name = {"data": "shard", "sequence_data": "sequence_shard"}.get(name, name)
        return self.dims.group(name)

    # tensor (= model) parallel
    def get_model_parallel_group(self):
        return self._group("tensor")

    def get_model_parallel_rank(self) -> int:
        return self._rank("tensor")

    def get_model_parallel_world_size(self) -> int:
        return self._size("tensor")

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.dims.rank - self.dims.tp_rank

    # data parallel
    def get_data_parallel_group(self):
        return self._group("data")

    def get_data_parallel_rank(self) -> int:
        return self._rank("data")

    def get_data_parallel_world_size(self) -> int:
        return self._size("data")

    # The ranks that split a sequence (Ulysses × context: DeepSpeed sums their gradients, as
    # it does Ulysses ranks'), and the ranks that average gradients (data × sequence)
    def get_sequence_parallel_group(self):
        return self._group("sequence")

    def get_sequence_parallel_rank(self) -> int:
        return self._rank("sequence")

    def get_sequence_parallel_world_size(self) -> int:
        return self.dims.sequence

    def get_sequence_data_parallel_group(self):
        return self._group("sequence_data")

    def get_sequence_data_parallel_rank(self) -> int:
        return self._rank("sequence_data")

    def get_sequence_data_parallel_world_size(self) -> int:
        return self._size("sequence_data")

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0
