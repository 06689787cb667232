"""ZeRO stages 1-3 on two gloo processes train exactly like one plain process."""

import pytest
import torch

from tests.conftest import char_overrides, check, read_metrics, run_pretrain


def _args(tmp):
    return ["recipes/shakespeare-char.yaml", *char_overrides(tmp)[:3], "training.iters=4",
            "training.log_interval=1", "training.eval_interval=0", "training.eval_iters=2",
            "training.global_batch_size=8", "training.micro_batch_size=4", "training.sample_tokens=4"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero-ref")
    check(run_pretrain([*_args(tmp), f"logging.dir={tmp}/run"]))
    return read_metrics(tmp / "run")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_matches_single_process(tmp_path, reference, stage):
    check(run_pretrain([*_args(tmp_path), f"parallel.zero_stage={stage}", f"logging.dir={tmp_path}/run"],
                       nproc=2))
    got = read_metrics(tmp_path / "run")
    for key in ("loss", "grad_norm", "val_loss"):
        ref = [r[key] for r in reference if key in r]
        new = [r[key] for r in got if key in r]
        assert len(new) == len(ref) > 0, key
        torch.testing.assert_close(torch.tensor(new), torch.tensor(ref), rtol=0, atol=1e-5, msg=key)
