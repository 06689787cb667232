"""The parallel layout: rank order, groups, seeds, and layouts refused before launch."""

import pytest
import torch

from megatron_lite.config import load_config
from megatron_lite.config.load import ConfigError
from megatron_lite.distributed import ParallelDims, TopologyError
from megatron_lite.engine.mpu import ModelParallelUnit
from megatron_lite.parallel.random import TensorParallelRNG, rank_seed
from tests.conftest import REPO

RECIPE = REPO / "recipes/shakespeare-char.yaml"


def _dims(world, overrides=()):
    cfg = load_config(RECIPE, ["training.micro_batch_size=2", "training.global_batch_size=16", *overrides])
    return [ParallelDims.plan(cfg, world, rank=r, local_world_size=4) for r in range(world)]


def test_groups_follow_megatron_and_deepspeed_rank_order():
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    dims = _dims(8, ["parallel.tensor=2", "parallel.pipeline=2"])[0]
    assert dims.data == 2
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    for ours, theirs in [("tensor", "model"), ("data", "data"), ("pipeline", "pipe")]:
        assert sorted(dims.group_ranks((ours,))) == sorted(topo.get_axis_comm_lists(theirs))
    # Tensor-parallel ranks are neighbours, so they share a node.
    assert dims.group_ranks(("tensor",))[0] == [0, 1]


def test_pipeline_topology_counts_ulysses_ranks_as_data_ranks():
    """4D: DeepSpeed's pipeline topology has no sequence axis; given data × ulysses as its data
    axis, its groups are ours (its data groups our sequence_data groups) and the batch it
    expects counts the Ulysses ranks."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    dims = _dims(16, ["parallel.tensor=2", "parallel.pipeline=2", "parallel.ulysses=2"])
    d = dims[0]
    assert (d.tensor, d.pipeline, d.ulysses, d.data) == (2, 2, 2, 2)
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=4)
    for ours, theirs in [(("tensor",), "model"), (("ulysses", "data"), "data"), (("pipeline",), "pipe")]:
        assert sorted(d.group_ranks(ours)) == sorted(topo.get_axis_comm_lists(theirs))
    assert d.deepspeed_data == 4 and _dims(4, ["parallel.ulysses=2"])[0].deepspeed_data == 2


def test_coordinates_and_ulysses_groups():
    dims = _dims(8, ["parallel.ulysses=2"])
    assert [d.ulysses_rank for d in dims] == [0, 1] * 4
    assert [d.dp_rank for d in dims] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert dims[0].group_ranks(("ulysses", "data")) == [list(range(8))]
    mpu = ModelParallelUnit(dims[3])
    assert (mpu.get_sequence_parallel_rank(), mpu.get_sequence_data_parallel_rank(),
            mpu.get_data_parallel_world_size(), mpu.get_sequence_data_parallel_world_size()) == (1, 3, 4, 8)


def test_context_ranks_sit_outside_ulysses_ranks_and_deepspeed_sees_both_as_sequence_ranks():
    """USP: Ulysses ranks are neighbours (their all-to-all stays in a node), context ranks
    next; DeepSpeed's sequence group is both, and each rank's place in it and in data ×
    sequence is its index in those groups' rank lists (what torch.distributed numbers it)."""
    dims = _dims(16, ["parallel.ulysses=2", "parallel.context=2"])
    assert [d.ulysses_rank for d in dims[:8]] == [0, 1] * 4
    assert [d.context_rank for d in dims[:8]] == [0, 0, 1, 1] * 2
    assert [d.dp_rank for d in dims[:8]] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert dims[0].group_ranks(("context",))[:2] == [[0, 2], [1, 3]]
    for d in dims:
        mpu = ModelParallelUnit(d)
        sequence = next(g for g in d.group_ranks(("ulysses", "context")) if d.rank in g)
        sequence_data = next(g for g in d.group_ranks(("ulysses", "context", "data")) if d.rank in g)
        assert mpu.get_sequence_parallel_rank() == sequence.index(d.rank)
        assert mpu.get_sequence_parallel_world_size() == len(sequence) == 4
        assert mpu.get_sequence_data_parallel_rank() == sequence_data.index(d.rank)
        assert mpu.get_sequence_data_parallel_world_size() == len(sequence_data) == 16
    # Seeds: every sequence slice of every replica draws its own dropout.
    assert len({rank_seed(0, d) for d in dims}) == 16


def test_the_pipeline_topology_counts_context_ranks_as_data_ranks():
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    d = _dims(8, ["parallel.tensor=2", "parallel.pipeline=2", "parallel.context=2"])[0]
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert sorted(d.group_ranks(("ulysses", "context", "data"))) == sorted(topo.get_axis_comm_lists("data"))
    assert d.deepspeed_data == 2


def test_hsdp_shard_size_defaults_to_the_node():
    dims = _dims(8, ["parallel.hsdp=true"])[0]
    assert dims.hsdp_shard_size == 4
    # With tensor parallelism a node of 4 holds 2 data-parallel ranks.
    assert _dims(8, ["parallel.hsdp=true", "parallel.tensor=2"])[0].hsdp_shard_size == 2


def test_hsdp_groups_and_what_deepspeed_sees():
    # 8 ranks, tensor 2: data groups [0, 2, 4, 6] and [1, 3, 5, 7], shard groups of 2.
    dims = _dims(8, ["parallel.hsdp=true", "parallel.hsdp_shard_size=2", "parallel.tensor=2"])
    shards, replicas = dims[0].hsdp_group_ranks()
    assert sorted(shards) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert sorted(replicas) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    d = dims[6]  # data rank 3: the second place of the second shard group
    assert (d.dp_rank, d.shard_rank, d.replica_rank, d.hsdp_replicas) == (3, 1, 1, 2)
    mpu = ModelParallelUnit(d)
    assert (mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(),
            mpu.get_sequence_data_parallel_world_size()) == (1, 2, 2)


def test_dropout_streams():
    tp = _dims(4, ["parallel.tensor=2"])
    # Outside the parallel regions tensor ranks hold the same activations: same stream.
    assert rank_seed(1, tp[0]) == rank_seed(1, tp[1]) != rank_seed(1, tp[2])
    sp = _dims(4, ["parallel.tensor=2", "parallel.sequence_parallel=true"])
    # With sequence parallelism each tensor rank holds its own tokens: different streams.
    assert len({rank_seed(1, d) for d in sp}) == 4


def test_attention_dropout_differs_per_tensor_rank_and_replays():
    drop = torch.nn.Dropout(0.5)
    x = torch.ones(64)

    def mask(tp_rank):
        torch.manual_seed(0)  # the default stream, identical on tensor ranks
        return TensorParallelRNG(drop, tp_rank)(x)

    assert torch.equal(mask(0), mask(0))  # replayable (activation recomputation)
    assert not torch.equal(mask(0), mask(1))


@pytest.mark.parametrize("overrides, expected", [
    (["parallel.tensor=3"], "divisible by 'parallel.tensor' = 3"),
    (["parallel.pipeline=2", "parallel.zero_stage=2"], "set parallel.zero_stage=1"),
    (["parallel.pipeline=2", "parallel.zero_stage=3"], "ZeRO stages 0 and 1 only"),
    (["parallel.sequence_parallel=true"], "needs 'parallel.tensor' > 1"),
    (["parallel.ulysses=2", "parallel.tensor=4"],
     "divisible by 'parallel.tensor' × 'parallel.ulysses' = 8 (each rank takes whole heads)"),
    (["parallel.ulysses=2", "parallel.tensor=2", "parallel.sequence_parallel=true", "data.seq_length=62"],
     "'data.seq_length' = 62 must be divisible by 'parallel.tensor' × 'parallel.ulysses' = 4"),
    (["parallel.ulysses=3"], "'data.seq_length' = 64 must be divisible by 'parallel.ulysses' = 3"),
    (["parallel.pipeline=8"], "need at least as many layers"),
    (["parallel.hsdp=true", "parallel.zero_stage=1"], "set parallel.zero_stage=3"),
    (["parallel.hsdp_shard_size=0"], "must be at least 1"),
    (["parallel.hsdp=true", "parallel.ulysses=2"], "'parallel.hsdp' = true with 'parallel.ulysses' = 2"),
    (["parallel.context=3"], "'data.seq_length' = 64 must be divisible by 2 × 'parallel.context' = 6"),
    (["parallel.context=2", "parallel.ulysses=2", "parallel.tensor=2", "parallel.sequence_parallel=true",
      "data.seq_length=40", "model.n_heads=8"],
     "'data.seq_length' = 40 must be divisible by 2 × 'parallel.context' × 'parallel.ulysses' × "
     "'parallel.tensor' = 16"),
    (["parallel.context=2", "model.dropout=0.1"], "ring attention has no attention dropout"),
    (["parallel.context=0"], "'parallel.context' = 0 must be at least 1"),
    (["model.rope_scaling=llama3"], "'model.rope_scaling' = llama3 needs 'model.position' = rope"),
    (["model.rope_scaling=llama3", "model.position=rope", "model.rope_high_freq_factor=0.5"],
     "0 < rope_low_freq_factor (1.0) < rope_high_freq_factor (0.5)"),
    (["model.eod_id=-100"], "'model.eod_id' = -100 must be a token id (0 or more)"),
    (["schedule.decay_fraction=0"], "'schedule.decay_fraction' = 0.0 must be in (0, 1]"),
    (["parallel.offload_optimizer=cpu"], "needs 'parallel.zero_stage' 1, 2 or 3"),
    (["parallel.offload_params=cpu", "parallel.zero_stage=2"], "offload_params' = cpu needs ZeRO-3"),
    (["parallel.offload_optimizer=nvme", "parallel.zero_stage=3"], "needs 'parallel.nvme_path'"),
    (["parallel.offload_optimizer=nvme", "parallel.zero_stage=1", "parallel.nvme_path=/x"],
     "NVMe offload needs ZeRO-3"),
    (["parallel.offload_optimizer=cpu", "parallel.hsdp=true"], "averages the gradient shards on the device"),
])
def test_impossible_layouts_fail_at_load_naming_the_fix(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(RECIPE, overrides)
    assert expected in str(err.value)


def test_layouts_that_do_not_fit_the_world_fail_together():
    cfg = load_config(RECIPE, ["parallel.tensor=2", "parallel.hsdp=true", "parallel.hsdp_shard_size=4",
                               "training.global_batch_size=12"])
    with pytest.raises(TopologyError) as err:
        ParallelDims.plan(cfg, world_size=6)
    text = str(err.value)
    assert "global_batch_size=12 is not a multiple" in text
    assert "hsdp_shard_size=4 must divide the 3" in text
    with pytest.raises(TopologyError, match="world size 6 is not divisible"):
        ParallelDims.plan(load_config(RECIPE, ["parallel.tensor=4"]), world_size=6)
