"""``data.on_resume``: a resume on other data is refused, naming the difference, unless a new data
phase is asked for; a new phase reads the new data from its first sample, and is recorded."""

import json

import pytest

from megatron_lite.checkpoint import store
from megatron_lite.data.phases import DataPhaseError, PhaseDataset
from tests.conftest import char_overrides, check, read_metrics, run_pretrain

SHORT = ["training.micro_batch_size=4", "training.global_batch_size=8", "training.eval_iters=1",
         "training.sample_tokens=0", "training.log_interval=1", "schedule.warmup_iters=0",
         "schedule.decay_style=constant", "model.n_layers=2", "model.d_model=64", "model.n_heads=4"]


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def test_a_new_phase_reads_the_new_data_from_its_first_sample(tmp_path):
    ck = tmp_path / "ck"
    base = ["recipes/shakespeare-char.yaml", *char_overrides(tmp_path), *SHORT, f"checkpoint.dir={ck}"]
    check(run_pretrain([*base, "training.iters=2"]))

    # Another sample order of the same corpus is other data: refused by default, naming it.
    proc = run_pretrain([*base, "training.iters=4", "data.seed=99"])
    assert proc.returncode == 1
    assert "data.seed: 1234 -> 99" in proc.stderr and "data.on_resume=new_phase" in proc.stderr
    assert store.read_latest(ck).name == "step_00000002"  # nothing written

    proc = check(run_pretrain([*base, "training.iters=4", "data.seed=99", "data.on_resume=new_phase",
                               f"logging.dir={tmp_path}/phase"]))
    assert "data phase 1 from step 2 (sample 16): data.seed: 1234 -> 99" in proc.stdout
    # The same weights on the new data's first samples, through a run that starts from the
    # checkpoint's weights alone: the first step's loss (taken before its update) is the same.
    check(run_pretrain([*base, "training.iters=1", "data.seed=99", f"checkpoint.dir={tmp_path}/fresh",
                        f"checkpoint.init_from={ck}/step_00000002", f"logging.dir={tmp_path}/fresh"]))
    assert _losses(tmp_path / "phase")[3] == _losses(tmp_path / "fresh")[1]
    assert _losses(tmp_path / "phase")[3] != _losses(tmp_path / "run")[1]

    # The phase is the checkpoint's data from then on: resuming on it needs no new phase.
    phases = json.loads((store.read_latest(ck) / store.MANIFEST).read_text())["data"]["phases"]
    assert [(p["phase"], p["step"], p["start"], p["data"]["seed"]) for p in phases] == \
        [(0, 0, 0, 1234), (1, 2, 16, 99)]
    check(run_pretrain([*base, "training.iters=5", "data.seed=99", "schedule.on_resume=recipe",
                        f"logging.dir={tmp_path}/phase"]))


def test_a_phase_dataset_maps_the_runs_samples_and_names_its_phase():
    class Numbers:
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return i

        def locate(self, i):
            return {"dataset": "numbers", "index": i}

    phase = PhaseDataset(Numbers(), phase=2, start=100)
    assert len(phase) == 110 and phase[100] == 0 and phase[105] == 5
    assert phase.locate(103) == {"phase": 2, "phase_sample": 3, "dataset": "numbers", "index": 3}
    with pytest.raises(DataPhaseError, match="before data phase 2"):
        phase[99]


def test_a_rollback_never_goes_back_across_a_phase_start(tmp_path):
    """A spike early in a new phase whose only older checkpoint is from the previous phase: the
    step is skipped, and nothing of the run is touched (no checkpoint set aside, ``latest`` and
    the new phase's data position as they were)."""
    ck = tmp_path / "ck"
    spikes = ["spikes.policy=rollback", "spikes.warmup_steps=2", "spikes.loss_z=3", "spikes.loss_ratio=1.02",
              "spikes.grad_norm_z=0", "checkpoint.save_interval=2", "checkpoint.keep_last=0"]
    base = ["recipes/shakespeare-char.yaml", *char_overrides(tmp_path), *SHORT, *spikes,
            f"checkpoint.dir={ck}"]
    check(run_pretrain([*base, "training.iters=4"]))
    # A rate that makes step 6 spike; the newest checkpoint 3 steps before it is phase 0's step 2.
    proc = check(run_pretrain([*base, "training.iters=6", "data.seed=99", "data.on_resume=new_phase",
                               "optimizer.lr=3", "schedule.on_resume=recipe",
                               "spikes.rollback.min_steps_back=3"]))
    events = [json.loads(line) for line in (tmp_path / "run" / "spikes.jsonl").read_text().splitlines()]
    unavailable = [e for e in events if e["event"] == "rollback_unavailable"]
    assert unavailable and "from before data phase 1" in unavailable[0]["message"], events
    assert "rolled back" not in proc.stdout
    assert not (ck / "abandoned").exists() and store.read_latest(ck).name == "step_00000006"
    manifest = json.loads((store.read_latest(ck) / store.MANIFEST).read_text())
    assert manifest["data"]["phases"][-1]["start"] == 32 and manifest["consumed_samples"] == 48
