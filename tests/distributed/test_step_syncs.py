"""No host wait and no host collective inside a training step (training/step_report.py).

Each step's report (loss, gradient norm, run-control flags) is reduced on the device and read
one step late, a non-finite update is skipped by the device itself, and only the steps followed
by a log line, an evaluation or a save read anything. Counted by the tests' recorder
(``RECORD_STEP_SYNCS``, tests/faults.py): every read of a tensor's value by the training thread
and every host-control collective, per step.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import char_overrides, check, run_pretrain

ITERS, LOG = 10, 5


def _args(tmp, run: str, *extra: str) -> list[str]:
    return ["recipes/shakespeare-char.yaml", *char_overrides(tmp)[:3], f"logging.dir={tmp}/{run}",
            f"training.iters={ITERS}", f"training.log_interval={LOG}", "training.eval_interval=0",
            "training.eval_iters=1", "training.sample_tokens=0", "training.global_batch_size=12",
            "training.micro_batch_size=6", f"checkpoint.dir={tmp}/{run}-ck", "checkpoint.save_interval=0",
            *extra]


def _steps(tmp, run: str, *extra: str, env: dict | None = None) -> list[list[dict]]:
    out = tmp / f"{run}-syncs"
    check(run_pretrain(_args(tmp, run, *extra), nproc=2, env={"RECORD_STEP_SYNCS": str(out), **(env or {})}))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _ours(reads: list[str]) -> list[str]:
    return [r for r in reads if "/megatron_lite/" in r]


# The checkpoint directory makes the run control active: its flags (signal, time limit, save
# timer) travel in the report instead of a collective of their own.
@pytest.mark.parametrize("layout, none_at_all", [
    ([], True),                                              # data parallel, ZeRO-0, fp32
    (["parallel.tensor=2"], True),
    (["parallel.zero_stage=1", "training.precision=bf16"], False),  # DeepSpeed reads its norm
])
def test_steps_between_log_lines_neither_wait_for_the_device_nor_agree_on_the_host(tmp_path, layout,
                                                                                   none_at_all):
    for rank_steps in _steps(tmp_path, "run", *layout):
        assert [s["step"] for s in rank_steps] == list(range(1, ITERS + 1))
        for s in rank_steps:
            boundary = s["step"] % LOG == 0
            if boundary:  # the log line reads the interval's loss and averages it over the ranks
                assert "the logged loss" in s["host_collectives"], s
                continue
            assert s["host_collectives"] == [], s
            assert _ours(s["reads"]) == [], s
            if none_at_all:
                assert s["reads"] == [], s


def test_a_policy_that_decides_before_the_update_agrees_once_per_step(tmp_path):
    """spikes.policy=skip_step must decline a finite update: the report is read in the step,
    loss and run-control flags in one host collective (not one each)."""
    for rank_steps in _steps(tmp_path, "strict", "spikes.policy=skip_step"):
        for s in rank_steps:
            step_agreements = [c for c in s["host_collectives"] if c != "the logged loss"
                               and "checkpoint" not in c and c != "the validation loss"]
            assert step_agreements == ["the step's loss and run-control flags"], s
            assert _ours(s["reads"]), s


def _tensors(step_dir) -> dict:
    out = {}
    for file in sorted(step_dir.glob("rank_*.pt")):
        state = torch.load(file, weights_only=False)
        for frag in state["fragments"]:
            for key, value in frag["tensors"].items():
                out[(file.name, frag["name"], frag["start"], key)] = value
        if "trainer" in state:  # rank 0's file
            out[(file.name, "adam_step")] = state["trainer"]["adam_step"]
            out[(file.name, "lr_step")] = state["trainer"]["scheduler"]["last_epoch"]
    return out


def test_a_nonfinite_step_skipped_by_the_device_equals_one_declined_by_the_host(tmp_path):
    """Rank 1's loss is NaN at step 3, a step no log line follows: judged at step 4, after the
    device skipped its update. Every weight, Adam moment, step count and the LR schedule at the
    end equal those of the run that declines the update on the host (spikes.policy=skip_step),
    and both name the step in spikes.jsonl."""
    nan = {"FAULT_NAN_LOSS": "3:1"}
    late = _steps(tmp_path, "late", env=nan)
    strict = _steps(tmp_path, "strict", "spikes.policy=skip_step", env=nan)
    assert all(s["host_collectives"] == [] for s in late[0] if s["step"] in (3, 4))
    assert strict[0][2]["host_collectives"] == ["the step's loss and run-control flags"]
    events = {run: [json.loads(x) for x in (tmp_path / run / "spikes.jsonl").read_text().splitlines()]
              for run in ("late", "strict")}
    assert events["late"] == events["strict"]
    (event,) = events["late"]
    assert event["event"] == "nonfinite" and event["step"] == 3 and event["action"] == "skip"
    a = _tensors(tmp_path / f"late-ck/step_{ITERS:08d}")
    b = _tensors(tmp_path / f"strict-ck/step_{ITERS:08d}")
    assert a.keys() == b.keys() and len(a) > 4
    for key in a:
        assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), key
    assert a[("rank_00000.pt", "adam_step")] == ITERS - 1 and a[("rank_00000.pt", "lr_step")] == ITERS
    logged = [json.loads(x) for x in (tmp_path / "late/metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in logged if "skipped_steps" in r] == [1, 0]
