"""training.compile: compiled blocks train exactly like eager ones (CPU, inductor)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import char_overrides, check, read_metrics, run_pretrain


def _losses(tmp_path, name, nproc, *extra):
    # 66: the 65 characters padded to a multiple of 2, so TP=2 and one process share a model.
    args = ["recipes/shakespeare-char.yaml", *char_overrides(tmp_path)[:3], "training.iters=4",
            "training.log_interval=1", "training.eval_interval=0", "training.eval_iters=1",
            "training.global_batch_size=8", "training.micro_batch_size=4", "training.sample_tokens=0",
            "model.vocab_size=66", "model.dropout=0.0", f"logging.dir={tmp_path}/{name}", *extra]
    out = check(run_pretrain(args, nproc=nproc)).stdout
    assert ("torch.compile: " in out) == ("training.compile=true" in extra)
    records = [r for r in read_metrics(tmp_path / name) if "loss" in r]
    return torch.tensor([[r["loss"], r["grad_norm"]] for r in records], dtype=torch.float64)


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    return _losses(tmp_path_factory.mktemp("eager"), "eager", 1)


@pytest.mark.parametrize("nproc, layout", [
    (1, ["model.activation_checkpointing=true"]),
    (2, ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
], ids=["recompute", "tp2-sp"])
def test_compiled_blocks_match_eager(tmp_path, eager, nproc, layout):
    compiled = _losses(tmp_path, "compiled", nproc, "training.compile=true", *layout)
    assert compiled.shape == (4, 2)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
