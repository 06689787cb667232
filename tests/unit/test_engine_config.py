import dataclasses

import pytest

from megatron_lite.config import load_config
from megatron_lite.config.schema import ModelConfig
from megatron_lite.data.batch_plan import BatchPlan, planned_steps
from megatron_lite.distributed import ParallelDims
from megatron_lite.engine.config import deepspeed_config
from megatron_lite.model import build_model
from megatron_lite.optim.optimizer import param_groups
from tests.conftest import REPO

RECIPE = REPO / "recipes/shakespeare-char.yaml"


def test_generated_deepspeed_config_and_passthrough():
    cfg = load_config(RECIPE, ["training.micro_batch_size=2", "training.global_batch_size=16",
                               "parallel.zero_stage=2", "training.precision=bf16",
                               "deepspeed.zero_optimization.overlap_comm=true",
                               "deepspeed.zero_optimization.stage=2", "deepspeed.train_batch_size=16",
                               "deepspeed.fp16.initial_scale_power=12"])
    dims = ParallelDims.plan(cfg, world_size=4)
    ds = deepspeed_config(cfg, dims)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"],
            ds["gradient_accumulation_steps"]) == (16, 2, 2)
    # merged, not replaced; restating the recipe's own stage or batch is no contradiction
    assert ds["zero_optimization"] == {"stage": 2, "overlap_comm": True}
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["fp16"]["initial_scale_power"] == 12  # a key the recipe says nothing about passes


def test_a_deepspeed_block_that_contradicts_the_recipe_is_refused_with_every_key_named():
    cfg = load_config(RECIPE, ["training.micro_batch_size=2", "training.global_batch_size=16",
                               "parallel.zero_stage=1", "optimizer.grad_clip=1.0",
                               "deepspeed.zero_optimization.stage=3", "deepspeed.gradient_clipping=0.5",
                               "deepspeed.gradient_accumulation_steps=4", "deepspeed.bf16.enabled=true",
                               "deepspeed.optimizer.type=Adam"])
    try:
        deepspeed_config(cfg, ParallelDims.plan(cfg, world_size=4))
    except ValueError as e:
        text = str(e)
    else:
        raise AssertionError("a contradicting deepspeed: block was accepted")
    assert "\n" not in text
    for part in ("deepspeed.zero_optimization.stage=3 but parallel.zero_stage / parallel.hsdp gives 1",
                 "deepspeed.gradient_clipping=0.5 but optimizer.grad_clip gives 1.0",
                 "deepspeed.gradient_accumulation_steps=4 but training.global_batch_size",
                 "deepspeed.bf16.enabled=True but training.precision gives False",
                 "deepspeed.optimizer: the optimizer is built from the recipe's optimizer: section"):
        assert part in text, (part, text)


def test_zero3_over_sequence_ranks_keeps_the_reduce_scatter_its_loss_factor_is_for():
    from megatron_lite.engine.config import sequence_gradient_factor

    base = ["training.micro_batch_size=2", "training.global_batch_size=8", "parallel.zero_stage=3"]
    cfg = load_config(RECIPE, [*base, "parallel.context=2"])
    dims = ParallelDims.plan(cfg, world_size=4)
    assert deepspeed_config(cfg, dims)["zero_optimization"]["reduce_scatter"] is True
    assert sequence_gradient_factor(cfg, dims) == 2.0
    off = load_config(RECIPE, [*base, "parallel.context=2",
                               "deepspeed.zero_optimization.reduce_scatter=false"])
    with pytest.raises(ValueError, match="zero_optimization.reduce_scatter"):
        deepspeed_config(off, ParallelDims.plan(off, world_size=4))
    # ZeRO 1/2 divide by the data ranks alone; without sequence ranks nothing to sum.
    for overrides, world in ((["parallel.zero_stage=1", "parallel.context=2"], 4), ([], 2)):
        other = load_config(RECIPE, [*base, *overrides])
        assert sequence_gradient_factor(other, ParallelDims.plan(other, world_size=world)) == 1.0


def test_a_deepspeed_section_that_is_not_a_mapping_is_named_not_merged():
    """Config loading refuses it (tests/e2e/test_pretrain_cli.py); a Config built around the
    loader gets the same answer here instead of a ZeRO-3 recipe merged down to stage 0."""
    cfg = load_config(RECIPE, ["parallel.zero_stage=3"])
    bad = dataclasses.replace(cfg, deepspeed={"zero_optimization": False, "fp16": {"enabled": False}})
    with pytest.raises(ValueError, match=r"'deepspeed.zero_optimization' = False must be a mapping"):
        deepspeed_config(bad, ParallelDims.plan(bad, world_size=1))


def test_layout_problems_are_reported_together():
    cfg = load_config(RECIPE, ["training.global_batch_size=12", "parallel.tensor=2",
                               "model.vocab_size=65"])
    try:
        ParallelDims.plan(cfg, world_size=6)  # dp 3: 12 is not a multiple of 12 × 3
    except ValueError as e:
        text = str(e)
    else:
        raise AssertionError("expected a layout error")
    assert "global_batch_size=12 is not a multiple" in text and "vocab_size=65" in text


def test_no_weight_decay_on_norms_and_biases():
    model = build_model(ModelConfig(vocab_size=20, n_layers=1, n_heads=2, d_model=8, max_seq_len=4,
                                    bias=True, norm="layernorm", position="learned"))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(names[id(p)].endswith("weight") and p.dim() == 2 for p in decay["params"])
    assert {names[id(p)] for p in no_decay["params"]} >= {"norm.weight", "norm.bias",
                                                         "blocks.0.attn.qkv_proj.bias"}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_token_budget_becomes_steps():
    cfg = load_config(RECIPE, ["training.iters=null", "training.train_tokens=10000"])
    # 12 samples × 64 tokens = 768 tokens per step -> ceil(10000 / 768) = 14 steps
    assert planned_steps(cfg, BatchPlan(12)) == (14, 14)
    assert planned_steps(dataclasses.replace(cfg, training=dataclasses.replace(
        cfg.training, iters=5, train_tokens=None)), BatchPlan(12)) == (5, 5)


def test_gaudi_recipe_sets_zero3_as_intels_workflow_does():
    cfg = load_config(REPO / "recipes/llama2-7b-gaudi.yaml", [])
    ds = deepspeed_config(cfg, ParallelDims.plan(cfg, world_size=4))
    assert ds["zero_optimization"] == {"stage": 3, "overlap_comm": False, "contiguous_gradients": False,
                                       "reduce_scatter": False}
    assert ds["bf16"]["enabled"] and cfg.training.device == "hpu" and cfg.training.hpu_mode == "lazy"


def test_ulysses_head_counts_older_deepspeed_cannot_run_are_named(monkeypatch):
    from packaging.version import Version

    from megatron_lite.engine import versions as deepspeed_versions

    monkeypatch.setattr(deepspeed_versions, "deepspeed_version", lambda: Version("0.16.1+hpu"))
    (problem,) = deepspeed_versions.ulysses_head_problems(4, 2, 2)
    assert problem.startswith("model.n_kv_heads=2 leaves 1 head(s) per rank under parallel.tensor=1 × "
                              "parallel.ulysses=2; DeepSpeed 0.16.1+hpu needs a multiple of 2 there")
    assert deepspeed_versions.ulysses_head_problems(8, 4, 2) == []
    monkeypatch.setattr(deepspeed_versions, "deepspeed_version", lambda: Version("0.18.3"))
    assert deepspeed_versions.ulysses_head_problems(4, 2, 2) == []


@pytest.mark.parametrize("release, refused", [("0.16.1", False), ("0.18.2", False), ("0.18.3", True),
                                             ("0.18.5+hpu", True), ("0.19.5", True), ("0.19.6", False),
                                             ("0.19.8", False)])
def test_a_pipeline_is_refused_where_its_gradients_are_wrong(monkeypatch, release, refused):
    """The range measured (versions.PIPELINE_GRADIENTS_WRONG): pp2 against one process differed
    on 0.18.3 to 0.19.5 and matched on 0.18.2 and 0.19.6 to 0.19.8; a vendor's label is kept."""
    from packaging.version import Version

    from megatron_lite.engine import versions as deepspeed_versions

    monkeypatch.setattr(deepspeed_versions, "deepspeed_version", lambda: Version(release))
    assert deepspeed_versions.pipeline_problem(1) is None
    problem = deepspeed_versions.pipeline_problem(4)
    assert (problem is not None) == refused, problem
    if refused:
        assert problem.startswith(f"parallel.pipeline=4 does not train correctly on DeepSpeed {release}: ")


@pytest.mark.parametrize("overrides, device, noted", [
    (["training.precision=bf16", "parallel.zero_stage=0"], "cuda", True),
    (["training.precision=fp16", "parallel.zero_stage=0", "parallel.pipeline=2"], "cuda", True),
    (["training.precision=bf16", "parallel.zero_stage=0"], "cpu", False),
    (["training.precision=bf16", "parallel.zero_stage=1"], "cuda", False),
    (["training.precision=fp32", "parallel.zero_stage=0"], "hpu", False),
    (["training.precision=bf16", "parallel.zero_stage=0", "parallel.pipeline=2"], "cuda", False),
    (["training.precision=bf16", "parallel.zero_stage=0", "parallel.hsdp=true"], "cuda", False),
])
def test_the_unfused_mixed_precision_wrapper_is_noted_where_deepspeed_picks_it(overrides, device, noted):
    """DeepSpeed wraps the optimizer in FP16_UnfusedOptimizer (a host read per parameter per step)
    for fp16 without ZeRO, and for bf16 without ZeRO outside pipelining; the run says so on an
    accelerator and names the stage that avoids it."""
    from megatron_lite.training.build import unfused_wrapper_note

    cfg = load_config(REPO / "recipes/shakespeare-char.yaml", overrides)
    note = unfused_wrapper_note(cfg, device)
    assert (note is not None) == noted, note
    if noted:
        assert "parallel.zero_stage=1" in note and cfg.training.precision in note
