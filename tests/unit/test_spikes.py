"""Spike detector on synthetic series, tracker policies and state, sample provenance."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from megatron_lite.config.schema import SpikesConfig
from megatron_lite.data.blend import BlendedSamples
from megatron_lite.data.gpt_dataset import (
    DocumentSamples,
    GlobalBatchSampler,
    StreamDataset,
    past_skipped,
    token_splits,
)
from megatron_lite.data.indexed import IndexedDataset, IndexedDatasetWriter
from megatron_lite.spikes import SpikeDetector, SpikeTracker, StepContext

# ---------------------------------------------------------------- detector (acceptance 1)

LOSS_SPIKES = {400: 0.30, 401: 0.25, 900: 0.6, 1500: 0.20}  # step -> added loss
GRAD_SPIKES = {650: 4.0, 1200: 2.5}  # step -> factor on the gradient norm
NONFINITE = {1800}


def synthetic_series(n: int = 2000, seed: int = 0) -> tuple[list[float], list[float]]:
    """A pretraining-like loss (slow decay plus noise, sigma 0.02) and gradient norm (about 1.0,
    sigma 0.08), with the spikes above injected."""
    rng = np.random.default_rng(seed)
    steps = np.arange(n)
    loss = 2.4 + 0.6 * np.exp(-steps / 600) + rng.normal(0, 0.02, n)
    gnorm = 1.0 + 0.1 * np.sin(steps / 150) + rng.normal(0, 0.08, n)
    for s, add in LOSS_SPIKES.items():
        loss[s] += add
    for s, factor in GRAD_SPIKES.items():
        gnorm[s] *= factor
    for s in NONFINITE:
        loss[s] = math.nan
    return loss.tolist(), gnorm.tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_detector_fires_exactly_on_the_injected_spikes(seed):
    loss, gnorm = synthetic_series(seed=seed)
    det = SpikeDetector(SpikesConfig())  # the documented defaults
    fired = {}
    for step, (x, g) in enumerate(zip(loss, gnorm, strict=True)):
        v = det.observe(x, g)
        if v.is_event:
            fired[step] = v.reasons
    want = {s: ["loss"] for s in LOSS_SPIKES} | {s: ["grad_norm"] for s in GRAD_SPIKES}
    want |= {s: ["nonfinite"] for s in NONFINITE}
    assert fired == want


def test_no_detection_during_warmup_but_nonfinite_always():
    det = SpikeDetector(SpikesConfig(warmup_steps=10))
    for _ in range(9):
        assert not det.observe(2.0, 1.0).is_event
    assert not det.observe(50.0, 1.0).is_event  # the 10th value: still warming up
    assert det.observe(math.inf, 1.0).reasons == ["nonfinite"]
    assert det.observe(2.0, math.nan).reasons == ["nonfinite"]
    assert det.observe(60.0, 1.0).reasons == ["loss"]


def test_ratio_keeps_a_flat_window_quiet():
    det = SpikeDetector(SpikesConfig(warmup_steps=5))
    for _ in range(50):
        det.observe(2.0, 1.0)  # MAD 0: any rise has an infinite z-score
    assert not det.observe(2.05, 1.0).is_event  # below loss_ratio 1.05
    assert det.observe(2.2, 1.0).reasons == ["loss"]


def test_detector_state_round_trip_gives_the_same_verdicts():
    loss, gnorm = synthetic_series(seed=3)
    a = SpikeDetector(SpikesConfig())
    for x, g in zip(loss[:700], gnorm[:700], strict=True):
        a.observe(x, g)
    b = SpikeDetector(SpikesConfig())
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for x, g in zip(loss[700:], gnorm[700:], strict=True):
        assert a.observe(x, g) == b.observe(x, g)


# ---------------------------------------------------------------- tracker


def _tracker(tmp_path, **cfg) -> SpikeTracker:
    return SpikeTracker(SpikesConfig(warmup_steps=3, **cfg), tmp_path, True,
                        lambda i: {"dataset": "d", "pieces": [[0, i, i + 1]]}, lambda _: None)


def _steps(tracker, values, start=1, batch=4):
    actions = []
    for k, (loss, gnorm) in enumerate(values):
        step = start + k
        ctx = StepContext(step, (step - 1) * batch, 1e-3, batch, step * batch)
        verdict, action = tracker.track(ctx, lambda loss=loss, gnorm=gnorm: tracker.judge(loss, gnorm))
        assert verdict == (action in ("apply", "log"))  # the update is applied exactly then
        actions.append(action)
    return actions


@pytest.mark.parametrize("policy, action", [("log", "log"), ("skip_step", "skip"), ("rollback", "rollback")])
def test_policy_decides_the_action_and_the_event_names_the_batch(tmp_path, policy, action):
    t = _tracker(tmp_path, policy=policy)
    actions = _steps(t, [(2.0, 1.0)] * 10 + [(9.0, 1.0)])
    assert actions == ["apply"] * 10 + [action]
    (event,) = [json.loads(line) for line in (tmp_path / "spikes.jsonl").read_text().splitlines()]
    assert event["step"] == 11 and event["action"] == action and event["sample_range"] == [40, 44]
    assert [s["index"] for s in event["samples"]] == [40, 41, 42, 43]


def test_nonfinite_steps_are_skipped_then_stop_the_run(tmp_path):
    t = _tracker(tmp_path, policy="log", max_consecutive_nonfinite=3)
    assert t.judge(math.nan, 1.0) is False  # never applied, whatever the spike policy
    actions = _steps(t, [(2.0, 1.0), (math.nan, None), (2.0, math.inf), (2.0, 1.0),
                         (math.nan, 1.0), (math.nan, 1.0), (math.nan, 1.0)])
    assert actions == ["apply", "skip", "skip", "apply", "skip", "skip", "stop"]


def test_resume_cuts_the_event_log_but_keeps_later_rollbacks(tmp_path):
    t = _tracker(tmp_path, policy="rollback")
    _steps(t, [(2.0, 1.0)] * 10 + [(9.0, 1.0)])  # event 0 (a spike)
    saved = json.loads(json.dumps(t.state_dict()))  # a checkpoint knows 1 event
    _steps(t, [(2.0, 1.0)] * 3 + [(9.0, 1.0)], start=12)  # event 1: spike at step 15
    t.record_rollback(8, "ck/step_8", (32, 100))  # event 2
    _steps(t, [(2.0, 1.0)] * 2 + [(9.0, 1.0)], start=9)  # event 3: after the rollback
    lines = (tmp_path / "spikes.jsonl").read_text().splitlines()
    assert len(lines) == 4

    resumed = _tracker(tmp_path, policy="rollback")
    resumed.resume(saved, resumed.read_log())
    kept = (tmp_path / "spikes.jsonl").read_text().splitlines()
    assert kept == lines[:3]  # through the rollback; the later event is met again
    assert resumed.skip == [(32, 100)] and resumed.rollbacks == 1 and resumed.events == 3


def test_a_torn_last_line_is_dropped_and_a_corrupt_middle_line_is_named(tmp_path):
    """A write cut short (full disk, node crash) leaves half a record at the end: resuming
    ignores it and rewrites the file without it; garbage elsewhere stops with the line named."""
    t = _tracker(tmp_path, policy="rollback")
    _steps(t, [(2.0, 1.0)] * 10 + [(9.0, 1.0)])
    saved = json.loads(json.dumps(t.state_dict()))
    whole = (tmp_path / "spikes.jsonl").read_text()
    (tmp_path / "spikes.jsonl").write_text(whole + '{"event": "spike", "step": 1')
    resumed = _tracker(tmp_path, policy="rollback")
    resumed.resume(saved, resumed.read_log())
    assert (tmp_path / "spikes.jsonl").read_text() == whole
    (tmp_path / "spikes.jsonl").write_text("not json\n" + whole)
    with pytest.raises(ValueError, match="spikes.jsonl, line 1, is not a spike record"):
        _tracker(tmp_path).read_log()


def test_fresh_start_keeps_an_old_event_log(tmp_path):
    (tmp_path / "spikes.jsonl").write_text('{"event": "spike"}\n')
    t = _tracker(tmp_path)
    t.resume(None, t.read_log())
    assert (tmp_path / "spikes.1.jsonl").read_text() == '{"event": "spike"}\n'
    assert not (tmp_path / "spikes.jsonl").exists()


# ---------------------------------------------------------------- data position


def test_skipped_windows_are_never_served():
    skip = [(16, 40), (40, 48), (80, 88)]
    assert past_skipped(0, skip) == 0 and past_skipped(16, skip) == 48 and past_skipped(47, skip) == 48
    it = iter(GlobalBatchSampler(8, 8, 4, 0, 1, skip=skip))
    served = [i for _ in range(12) for i in next(it)]
    assert served == list(range(8, 16)) + list(range(48, 80)) + list(range(88, 96))


# ---------------------------------------------------------------- provenance


@pytest.fixture()
def prefix(tmp_path):
    rng = np.random.default_rng(0)
    w = IndexedDatasetWriter(tmp_path / "d", np.int32)
    start = 0
    for n in rng.integers(1, 40, 80):
        w.add_documents([np.arange(start, start + n)])  # token value = position in the file
        start += n
    w.finalize()
    return str(tmp_path / "d")


def _check_pieces(ds, i, data: IndexedDataset, prefix: str):
    where = ds.locate(i)
    assert where["dataset"] == prefix
    first = data.pointers // data.dtype.itemsize
    expected = []
    for doc, lo, hi in where["pieces"]:
        assert 0 <= lo < hi <= data.lengths[doc]
        expected += list(range(int(first[doc]) + lo, int(first[doc]) + hi))
    assert expected == ds[i].tolist()


def test_locate_names_the_documents_and_tokens_of_a_stream_sample(prefix):
    ds = StreamDataset(token_splits(prefix, 16, (0.9, 0.1, 0.0), 0)[0])
    data = IndexedDataset(prefix)
    for i in range(0, 3 * len(ds), 7):
        _check_pieces(ds, i, data, prefix)


def test_locate_names_the_documents_and_tokens_of_document_samples(prefix, tmp_path):
    ds = DocumentSamples(prefix, 0, 70, 16, 300, 5, tmp_path / "cache")
    data = IndexedDataset(prefix)
    for i in range(300):
        _check_pieces(ds, i, data, prefix)
    blend = BlendedSamples([ds, ds], np.array([1, 0, 1], np.int16), np.array([5, 9, 2]))
    assert blend.locate(2) == ds.locate(2) and blend.locate(1) == ds.locate(9)

