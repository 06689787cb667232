"""Spike tracking in real training runs: injected bad batches and NaN losses, skip_step,
rollback, and resume.

Bad data comes from the tests' fault injection (tests/faults.py): ``FAULT_BAD_SAMPLES=A:B`` serves
random tokens for training samples A..B-1, ``FAULT_NAN_LOSS=STEP:RANK`` makes one
rank's loss NaN at one step. Step ``s`` (1-based) reads samples ``[(s-1)·8, s·8)`` until a
rollback moves the data position.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megatron_lite.engine.versions import BF16_NONFINITE_SKIPPED, deepspeed_version
from tests.conftest import (
    REPO,
    TINY_SHAKESPEARE,
    char_overrides,
    check,
    cpu_env,
    read_metrics,
    run_pretrain,
    run_pretrain_and_kill,
)

GB = 8


def _args(tmp, *extra):
    # The loss settles by step ~30 (LR warm-up 10 steps); detection starts after 30 steps and
    # compares with the last 20.
    return ["recipes/shakespeare-char.yaml", *char_overrides(tmp)[:3], "training.log_interval=1",
            "training.eval_interval=0", "training.eval_iters=1", f"training.global_batch_size={GB}",
            "training.micro_batch_size=4", "training.sample_tokens=0", "schedule.warmup_iters=10",
            "spikes.warmup_steps=30", "spikes.window=20", *extra]


def _bad(step: int, steps: int = 1) -> dict[str, str]:
    return {"FAULT_BAD_SAMPLES": f"{(step - 1) * GB}:{(step - 1 + steps) * GB}"}


def _events(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "spikes.jsonl").read_text().splitlines()]


def _fragments(step_dir) -> dict:
    """Every tensor a checkpoint holds (weights and Adam moments of every rank's fragments)."""
    out = {}
    for file in sorted(step_dir.glob("rank_*.pt")):
        for frag in torch.load(file, weights_only=False)["fragments"]:
            for key, value in frag["tensors"].items():
                out[(file.name, frag["name"], frag["start"], key)] = value
    return out


def _trainer_state(step_dir) -> dict:
    return torch.load(step_dir / "rank_00000.pt", weights_only=False)["trainer"]


def _manifest(step_dir) -> dict:
    return json.loads((step_dir / "manifest.json").read_text())


def _assert_update_skipped(ck, step: int):
    before, after = ck / f"step_{step - 1:08d}", ck / f"step_{step:08d}"
    a, b = _fragments(before), _fragments(after)
    assert a.keys() == b.keys() and len(a) > 0
    for key in a:
        assert torch.equal(a[key], b[key]), key  # bitwise: weights and Adam moments untouched
    ta, tb = _trainer_state(before), _trainer_state(after)
    assert ta["adam_step"] == tb["adam_step"]
    assert tb["scheduler"]["last_epoch"] == ta["scheduler"]["last_epoch"] + 1  # the LR advanced
    assert _manifest(after)["consumed_samples"] == _manifest(before)["consumed_samples"] + GB
    # ... and the step after was applied again.
    c = _fragments(ck / f"step_{step + 1:08d}")
    assert any(not torch.equal(b[k], c[k]) for k in b)


@pytest.mark.parametrize("nproc, layout", [(1, []), (2, ["parallel.pipeline=2"])], ids=["one", "pp2"])
def test_bad_batch_is_named_and_skipped(tmp_path, nproc, layout):
    # Under pipelining the loss exists only on the last stage when the update is decided.
    ck = tmp_path / "ck"
    args = _args(tmp_path, "training.iters=42", "spikes.policy=skip_step", f"checkpoint.dir={ck}",
                 "checkpoint.save_interval=1", "checkpoint.keep_last=3", f"logging.dir={tmp_path}/run",
                 *layout)
    check(run_pretrain(args, nproc=nproc, env=_bad(41)))
    (event,) = _events(tmp_path / "run")
    assert event["event"] == "spike" and event["step"] == 41 and event["action"] == "skip"
    assert "loss" in event["reasons"] and event["loss_z"] >= 6
    assert event["sample_range"] == [320, 328]
    assert [s["index"] for s in event["samples"]] == list(range(320, 328))
    # Provenance: the tinyshakespeare text is one document; each sample is one window of it.
    for s in event["samples"]:
        assert s["dataset"] == f"{tmp_path}/data/tiny_text_document"
        ((doc, lo, hi),) = s["pieces"]
        assert doc == 0 and hi - lo == 65
    _assert_update_skipped(ck, 41)
    logged = {r["step"]: r for r in read_metrics(tmp_path / "run") if "loss" in r}
    assert logged[41]["skipped_steps"] == 1 and logged[42]["skipped_steps"] == 0
    if nproc == 1:
        _check_report(tmp_path / "run", event)


def _check_report(run_dir, event):
    """tools/spike_report.py: the table, the samples' text (from the data files: the bad tokens
    were injected when served) and the plot."""
    out = subprocess.run([sys.executable, str(REPO / "tools/spike_report.py"), str(run_dir), "--text",
                          "--samples", "8", "--chars", "1000", "--plot", str(run_dir / "loss.png")],
                         env=cpu_env(), capture_output=True, text=True, check=True, timeout=600).stdout
    (row,) = [line for line in out.splitlines() if line.split()[:3] == ["0", "41", "spike"]]
    assert "skip" in row and "320..327" in row
    corpus = TINY_SHAKESPEARE.read_text()  # one document, one character per token
    for s in event["samples"]:
        ((_, lo, hi),) = s["pieces"]
        assert f"-- sample {s['index']} " in out and corpus[lo:hi] in out
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# (ZeRO-0 in fp32, torch's own AdamW, is test_step_syncs.py's NaN-on-rank-1 case, by the device and
# by the host.)
@pytest.mark.parametrize("zero, precision", [(1, "fp32"), (0, "bf16"), (1, "bf16")])
def test_nan_on_one_rank_is_skipped_by_both(tmp_path, zero, precision):
    # Under bf16 DeepSpeed's own overflow check is off (engine/config.py): the gate alone skips.
    ck = tmp_path / "ck"
    args = _args(tmp_path, "training.iters=4", f"parallel.zero_stage={zero}", f"checkpoint.dir={ck}",
                 "checkpoint.save_interval=1", f"logging.dir={tmp_path}/run",
                 f"training.precision={precision}")
    if (zero, precision) == (0, "bf16") and deepspeed_version() < BF16_NONFINITE_SKIPPED:
        # This DeepSpeed's bf16 optimizer asserts on the NaN norm: said at start, the run stops.
        proc = run_pretrain(args, nproc=2, env={"FAULT_NAN_LOSS": "3:1"})
        assert proc.returncode != 0 and "set parallel.zero_stage=1 to have such steps skipped" in proc.stdout
        assert (ck / "latest").read_text().strip() == "step_00000002"
        return
    check(run_pretrain(args, nproc=2, env={"FAULT_NAN_LOSS": "3:1"}))
    (event,) = _events(tmp_path / "run")
    assert event["event"] == "nonfinite" and event["step"] == 3 and event["action"] == "skip"
    _assert_update_skipped(ck, 3)  # both ranks' files: both ranks skipped
    assert {r["step"] for r in read_metrics(tmp_path / "run") if r.get("event") == "nonfinite"} == {3}


def _rollback_args(tmp_path, ck, run, iters=60, *extra):
    return _args(tmp_path, f"training.iters={iters}", "spikes.policy=rollback", f"checkpoint.dir={ck}",
                 "checkpoint.save_interval=10", "checkpoint.keep_last=0", "spikes.rollback.min_steps_back=10",
                 "spikes.rollback.skip_batches=3", f"logging.dir={run}", *extra)


def _positions(run_dir) -> list[tuple[int, int]]:
    return [(r["step"], r["consumed_samples"]) for r in read_metrics(run_dir) if "loss" in r]


def test_rollback_reloads_skips_the_window_and_a_resume_skips_it_too(tmp_path):
    # Steps 45 and 46 read bad samples; 46's lie inside the window the rollback skips, so a
    # second spike would mean the window was not skipped.
    ck, run = tmp_path / "ck", tmp_path / "run"
    check(run_pretrain(_rollback_args(tmp_path, ck, run), env=_bad(45, steps=2)))
    events = _events(run)
    assert [e["event"] for e in events] == ["spike", "rollback"]
    spike, rollback = events
    assert spike["step"] == 45 and spike["sample_range"] == [352, 360]
    # The newest checkpoint at least 10 steps before 45 is step 30 (40 is too close).
    assert rollback["to_step"] == 30 and rollback["checkpoint"] == str(ck / "step_00000030")
    window = [30 * GB, 45 * GB + 3 * GB]  # from step 30's position through the spike + 3 batches
    assert rollback["skip_samples"] == window
    assert (ck / "abandoned/step_00000040-rollback1").is_dir()
    # Samples seen: before the spike step s reads up to s·8; after the rollback, step 31 reads
    # from the window's end on.
    positions = _positions(run)
    cut = positions.index((44, 352)) + 1
    assert positions[:cut] == [(s, s * GB) for s in range(1, 45)]
    assert positions[cut:] == [(s, window[1] + (s - 30) * GB) for s in range(31, 61)]
    assert _trainer_state(ck / "step_00000060")["extra"]["spikes"]["skip"] == [window]

    # Killed right after the rollback (before any new save): `latest` is step 30, whose state
    # predates the rollback. Resumed with another logging.dir (no spikes.jsonl to read), the
    # run still skips the window, counts the rollback and ends the same: the history is kept
    # with the checkpoints.
    ck2, killed, elsewhere = tmp_path / "ck2", tmp_path / "killed", tmp_path / "elsewhere"
    run_pretrain_and_kill(_rollback_args(tmp_path, ck2, killed), 1, "rolled back from step 45",
                          env=_bad(45, steps=2))
    assert (ck2 / "latest").read_text().strip() == "step_00000030"
    assert json.loads((ck2 / "rollbacks.json").read_text()) == [
        {"rollbacks": 1, "step": 45, "to_step": 30, "skip_samples": window}]
    check(run_pretrain(_rollback_args(tmp_path, ck2, elsewhere), env=_bad(45, steps=2)))
    assert [p for p in _positions(elsewhere) if p[0] > 30] == positions[cut:]
    state = _trainer_state(ck2 / "step_00000060")["extra"]["spikes"]
    assert state["skip"] == [window] and state["rollbacks"] == 1


def test_a_rollback_that_would_outrun_the_planned_data_skips_the_step_instead(tmp_path):
    """The saves of steps 20-40 fail (continue): the only checkpoint is step 10, and rolling back
    there from 45 would need more samples than the run planned (room for a rollback of
    save_interval + skip_batches steps). The step is skipped instead, on every rank alike."""
    from megatron_lite.data.tokenizers import CharTokenizer

    # Megatron's document sampling plans exactly the samples asked for (a token stream's
    # windows would cover the whole corpus): the corpus' paragraphs as documents.
    text = TINY_SHAKESPEARE.read_text(encoding="utf-8")
    data = tmp_path / "docs"
    data.mkdir()
    CharTokenizer.build(text, data / "chars.json")
    with open(data / "paragraphs.jsonl", "w") as f:
        for paragraph in text.split("\n\n"):
            f.write(json.dumps({"text": paragraph + "\n\n"}) + "\n")
    documents = [f"data.prefix={data}/paragraphs_text_document", f"data.build_from={data}/paragraphs.jsonl",
                 f"data.tokenizer.model={data}/chars.json", "data.split_by=documents"]
    ck, run = tmp_path / "ck", tmp_path / "run"
    proc = check(run_pretrain(_rollback_args(tmp_path, ck, run, 60, "spikes.rollback.max_rollbacks=1",
                                             "checkpoint.on_save_failure=continue", *documents),
                              nproc=2, env={**_bad(45), "FAULT_SAVE_ENOSPC": "20,30,40"}))
    events = _events(run)
    assert [e["event"] for e in events] == ["spike", "rollback_unavailable"]
    assert "beyond the" in events[1]["message"] and "planned" in events[1]["message"]
    assert [p[0] for p in _positions(run)][-1] == 60
    assert not (ck / "rollbacks.json").exists() and "saved checkpoint" in proc.stdout


def test_rollbacks_exhausted_stop_the_run(tmp_path):
    ck, run = tmp_path / "ck", tmp_path / "run"
    proc = run_pretrain(_rollback_args(tmp_path, ck, run, 60, "spikes.rollback.max_rollbacks=0"),
                        env=_bad(45))
    assert proc.returncode == 1
    assert "spikes.rollback.max_rollbacks=0" in proc.stderr and "step 45" in proc.stderr
    assert [e["event"] for e in _events(run)] == ["spike", "stop"]


def test_resumed_run_writes_the_same_spike_log(tmp_path):
    # Spikes at steps 21 and 28; the checkpoint at 25; killed once the spike at 28 is logged.
    # (A detector warmed up over 15 steps, with a window of 10.)
    bad = [20, 27]
    env = {"FAULT_BAD_SAMPLES": ",".join(f"{s * GB}:{(s + 1) * GB}" for s in bad)}
    common = ["training.iters=30", "checkpoint.save_interval=25", "spikes.warmup_steps=15",
              "spikes.window=10"]
    full = _args(tmp_path, *common, f"checkpoint.dir={tmp_path}/ck-full", f"logging.dir={tmp_path}/full")
    check(run_pretrain(full, env=env))
    assert [e["step"] for e in _events(tmp_path / "full")] == [21, 28]
    part = _args(tmp_path, *common, f"checkpoint.dir={tmp_path}/ck", f"logging.dir={tmp_path}/part")
    run_pretrain_and_kill(part, 1, "spike at step 28", env=env)
    assert [e["step"] for e in _events(tmp_path / "part")] == [21, 28]
    check(run_pretrain(part, env=env))
    assert (tmp_path / "part/spikes.jsonl").read_text() == (tmp_path / "full/spikes.jsonl").read_text()


def test_a_full_disk_under_the_logs_does_not_stop_the_run(tmp_path):
    """Rank 0 alone writes metrics.jsonl and spikes.jsonl; when those writes fail (ENOSPC) the
    run warns and trains on instead of rank 0 crashing while rank 1 waits."""
    ck = tmp_path / "ck"
    args = _args(tmp_path, "training.iters=4", "parallel.zero_stage=1", f"checkpoint.dir={ck}",
                 "checkpoint.save_interval=2", f"logging.dir={tmp_path}/run")
    proc = check(run_pretrain(args, nproc=2, env={"FAULT_LOG_ENOSPC": "1", "FAULT_NAN_LOSS": "3:1"}))
    assert "metrics.jsonl failed (OSError: [Errno 28] No space left on device)" in proc.stderr
    assert "spikes.jsonl failed (OSError: [Errno 28] No space left on device)" in proc.stdout
    assert "non-finite loss/gradient at step 3" in proc.stdout
    assert (ck / "latest").read_text().strip() == "step_00000004"
