"""A pipeline trains in bf16 as one process does, through ZeRO-1 and without ZeRO. (Without
ZeRO, DeepSpeed's bf16 optimizer from 0.18.3 cleared the last stage's output-layer gradient before
the step: the layer never trained, and the run went on, worse: engine/pipeline.py,
keep_output_layer_gradient.)"""

import pytest

from tests.conftest import char_overrides, check, read_metrics, run_pretrain

RUN = ["model.n_layers=2", "model.n_heads=2", "model.d_model=32", "data.seq_length=32",
       "training.micro_batch_size=2", "training.global_batch_size=4", "training.eval_iters=1",
       "training.sample_tokens=0", "training.log_interval=1", "schedule.warmup_iters=0",
       "model.position=rope", "model.norm=rmsnorm", "model.activation=swiglu", "model.bias=false",
       "model.tie_embeddings=false", "model.ffn_hidden=64", "model.vocab_multiple=1",
       "optimizer.lr=1e-3", "training.iters=4", "training.precision=bf16"]


def _records(run_dir):
    return [r for r in read_metrics(run_dir) if "loss" in r]


def test_a_bf16_pipeline_trains_as_one_process(tmp_path):
    base = ["recipes/shakespeare-char.yaml", *char_overrides(tmp_path), *RUN]
    # The reference: one process through ZeRO-1's bf16 optimizer (one process at ZeRO-0 goes
    # through DeepSpeed's FP16_UnfusedOptimizer, which drifts further from fp32 than either).
    check(run_pretrain([*base, "parallel.zero_stage=1", f"logging.dir={tmp_path}/one"]))
    for zero in (1, 0):
        check(run_pretrain([*base, "parallel.pipeline=2", f"parallel.zero_stage={zero}",
                            f"logging.dir={tmp_path}/pp2-zero{zero}"], nproc=2))
    one, zero1, zero0 = (_records(tmp_path / d) for d in ("one", "pp2-zero1", "pp2-zero0"))
    # bf16 rounds differently in each layout: close, not equal. The bug was a norm 20% low from
    # the first step (the output layer's gradient missing) and losses 0.3 apart by step 8.
    for a, b in [*zip(one, zero1, strict=True), *zip(one, zero0, strict=True)]:
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=0.03), a["step"]
        assert b["loss"] == pytest.approx(a["loss"], rel=0.01), a["step"]
    # Both pipelines hold fp32 masters of the same bf16 weights: all but equal.
    for a, b in zip(zero1, zero0, strict=True):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-3), a["step"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3), a["step"]
