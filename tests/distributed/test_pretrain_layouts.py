"""pretrain.py end to end under parallel layouts: the trainer's losses, gradient norms and
validation losses equal the single-process run's (the layouts' weights are compared in
test_layouts.py). The 65 characters are padded to 65 rows by one process and to 66 under
tensor parallelism: the padding is masked, so the functions, and the samples, are the same."""

import re

import pytest
import torch

from tests.conftest import char_overrides, check, read_metrics, run_pretrain


def _args(tmp):
    return ["recipes/shakespeare-char.yaml", *char_overrides(tmp)[:3], "training.iters=4",
            "training.log_interval=1", "training.eval_interval=0", "training.eval_iters=2",
            "training.global_batch_size=8", "training.micro_batch_size=4", "training.sample_tokens=24",
            "training.sample_temperature=1.0"]


def _sample(stdout: str) -> str:
    return re.search(r"sample at step 4:\n(.*?)\n-{40}", stdout, re.S).group(1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layout-ref")
    proc = check(run_pretrain([*_args(tmp), f"logging.dir={tmp}/run"]))
    return read_metrics(tmp / "run"), _sample(proc.stdout)


@pytest.mark.parametrize("layout", [
    ["parallel.zero_stage=3"],
    ["parallel.tensor=2", "parallel.sequence_parallel=true"],
    ["parallel.pipeline=2", "parallel.zero_stage=1"],
    ["parallel.ulysses=2"],
    ["parallel.tensor=2"],
    ["parallel.context=2"],
], ids=["zero3", "tp2-sp", "pp2", "ulysses2", "tp2", "context2"])
def test_pretrain_layout_matches_single_process(tmp_path, reference, layout):
    reference, sample = reference
    proc = check(run_pretrain([*_args(tmp_path), *layout, f"logging.dir={tmp_path}/run"], nproc=2))
    if layout == ["parallel.tensor=2"]:  # samples over the gathered vocabulary-parallel logits
        assert "vocab 66" in proc.stdout or '"vocab_size": 66' in (tmp_path / "run/runtime.json").read_text()
        assert _sample(proc.stdout) == sample
    got = read_metrics(tmp_path / "run")
    for key in ("loss", "grad_norm", "val_loss"):
        ref = [r[key] for r in reference if key in r]
        new = [r[key] for r in got if key in r]
        assert len(new) == len(ref) > 0, key
        torch.testing.assert_close(torch.tensor(new), torch.tensor(ref), rtol=1e-5, atol=0, msg=key)


def test_layout_that_does_not_fit_the_world_fails_at_start_once(tmp_path):
    proc = run_pretrain([*_args(tmp_path), "parallel.tensor=4", f"logging.dir={tmp_path}/run"], nproc=2,
                        timeout=180)
    assert proc.returncode != 0
    message = ("world size 2 is not divisible by parallel.tensor × parallel.pipeline × parallel.ulysses × "
               "parallel.context")
    assert proc.stderr.count(message) == 1, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()  # nothing was built or written
