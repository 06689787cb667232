"""The checkpoint directory: commit order, integrity checks, crash leftovers, retention."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from megatron_lite.checkpoint import store
from megatron_lite.checkpoint.checkpointer import Checkpointer
from megatron_lite.checkpoint.manifest import read_manifest, verify
from megatron_lite.checkpoint.store import CheckpointError
from megatron_lite.config import load_config
from megatron_lite.distributed import ParallelDims
from tests.conftest import REPO

# The sections a resume reads, in a manifest written by hand.
RESUMABLE = {"consumed_samples": 0, "topology": {}, "model": {}, "data": {"seq_length": None}}


def _save(root, step, payload=b"x" * 1000):
    tmp = root / f".tmp-{store.step_name(step)}"
    tmp.mkdir(parents=True)
    files = [store.write_rank_file(tmp, r, {"rank": r, "payload": payload}) for r in range(2)]
    return store.commit(root, tmp, {"format": store.FORMAT_VERSION, "step": step, "files": files,
                                    **RESUMABLE})


def _chooser(root, *overrides):
    cfg = load_config(REPO / "recipes/shakespeare-char.yaml", [f"checkpoint.dir={root}", *overrides])
    messages = []
    return Checkpointer(cfg, ParallelDims.plan(cfg, world_size=1), None, None, None,
                        messages.append), messages


def _choose(chooser):
    """What ``Checkpointer.load`` chooses, on one process."""
    return chooser.reader.first_valid(chooser.reader._candidates(),
                                      strict=not chooser.ctx.cfg.checkpoint.load_fallback)


def test_commit_writes_manifest_and_latest(tmp_path):
    path = _save(tmp_path, 3)
    assert (tmp_path / "latest").read_text() == "step_00000003\n"
    manifest = read_manifest(path)
    assert [f["name"] for f in manifest["files"]] == ["rank_00000.pt", "rank_00001.pt"]
    verify(path, manifest)
    assert not list(tmp_path.glob(".tmp-*"))


def test_flipped_byte_truncation_and_missing_file_are_named(tmp_path):
    path = _save(tmp_path, 3)
    manifest = read_manifest(path)
    victim = path / "rank_00001.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rank_00001.pt does not match its SHA-256"):
        verify(path, manifest)
    victim.write_bytes(bytes(data[:100]))
    with pytest.raises(CheckpointError, match="rank_00001.pt is 100 bytes.*truncated"):
        verify(path, manifest)
    victim.unlink()
    with pytest.raises(CheckpointError, match="rank_00001.pt is missing"):
        verify(path, manifest)


def test_corrupt_latest_stops_unless_fallback_is_allowed(tmp_path):
    _save(tmp_path, 3)
    _save(tmp_path, 6)
    (tmp_path / "latest").write_bytes(b"\x00\xffgarbage")
    chooser, _ = _chooser(tmp_path)
    with pytest.raises(CheckpointError, match="latest does not name a checkpoint.*load_fallback=true"):
        _choose(chooser)
    chooser, messages = _chooser(tmp_path, "checkpoint.load_fallback=true")
    assert _choose(chooser)[0].name == "step_00000006"
    assert any("falling back" in m for m in messages)


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one_only_if_allowed(tmp_path):
    _save(tmp_path, 3)
    newest = _save(tmp_path, 6)
    (newest / "rank_00000.pt").write_bytes(b"garbage")
    chooser, _ = _chooser(tmp_path)
    with pytest.raises(CheckpointError, match="step_00000006/rank_00000.pt is 7 bytes"):
        _choose(chooser)
    chooser, messages = _chooser(tmp_path, "checkpoint.load_fallback=true")
    assert _choose(chooser)[0].name == "step_00000003"
    assert any("skipping" in m and "step_00000006" in m for m in messages)


def test_crash_while_writing_shards_leaves_the_previous_checkpoint(tmp_path):
    _save(tmp_path, 3)
    partial = tmp_path / ".tmp-step_00000006"
    partial.mkdir()
    store.write_rank_file(partial, 0, {"rank": 0})  # rank 1 died before writing
    (partial / "rank_00001.pt.partial").write_bytes(b"half")
    chooser, messages = _chooser(tmp_path)
    path, manifest = _choose(chooser)
    assert (path.name, manifest["step"]) == ("step_00000003", 3)
    assert not partial.exists() and any("incomplete save" in m for m in messages)


def test_crash_between_commit_and_latest_resumes_from_what_latest_names(tmp_path):
    _save(tmp_path, 3)
    _save(tmp_path, 6)
    store.write_bytes_durably(tmp_path / "latest", b"step_00000003\n")  # the pointer was not moved yet
    chooser, _ = _chooser(tmp_path)
    assert _choose(chooser)[0].name == "step_00000003"


def test_missing_latest_with_checkpoints_present_is_an_error(tmp_path):
    _save(tmp_path, 3)
    (tmp_path / "latest").unlink()
    chooser, _ = _chooser(tmp_path)
    with pytest.raises(CheckpointError, match="no 'latest' pointer"):
        _choose(chooser)


def test_retention_keeps_the_last_k_and_every_mth(tmp_path):
    chooser, _ = _chooser(tmp_path, "checkpoint.keep_last=3", "checkpoint.keep_every=4")
    for step in range(1, 11):
        _save(tmp_path, step, payload=b"")
        chooser.writer._apply_retention(step)
    assert sorted(p.name for p in store.committed_steps(tmp_path)) == [
        "step_00000004", "step_00000008", "step_00000009", "step_00000010"]
    assert store.retained([1, 2, 3], keep_last=1, keep_every=0, protect={2}) == {2, 3}


def test_a_replaced_copy_whose_replacement_never_arrived_is_put_back(tmp_path):
    path = _save(tmp_path, 3)
    path.rename(tmp_path / ".old-step_00000003")  # crashed between the two renames of a re-save
    assert store.remove_stale(tmp_path) == []
    verify(path, read_manifest(path))


HOLD_LOCK = """
import sys, time
import os
import re
from pathlib import Path
from megatron_lite.checkpoint import store
lock, _ = store.claim(Path(sys.argv[1]), fresh=False)
print("locked", flush=True)
time.sleep(600)
"""


def test_a_second_run_on_a_live_runs_directory_is_refused_and_deletes_nothing(tmp_path):
    import subprocess
    import sys

    from tests.conftest import cpu_env

    live = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path)], cwd=REPO, env=cpu_env(),
                            stdout=subprocess.PIPE, text=True)
    try:
        assert live.stdout.readline().strip() == "locked"
        in_flight = tmp_path / ".tmp-step_00000007"  # the live run's save in progress
        in_flight.mkdir()
        with pytest.raises(CheckpointError, match=f"in use by another run \\(host .*, pid {live.pid}, since"):
            store.claim(tmp_path, fresh=False)
        assert in_flight.is_dir()
    finally:
        live.kill()
        live.wait()
    # The kernel drops the lock with the process: no stale lock after a crash.
    lock, warning = store.claim(tmp_path, fresh=False)
    assert lock is not None and warning is None
    lock.close()


HOLD_LOCK_WITH_WORKERS = """
import sys, time
from pathlib import Path
import torch
from megatron_lite.checkpoint import store
lock, _ = store.claim(Path(sys.argv[1]), fresh=False)
class Slow(torch.utils.data.Dataset):
    def __len__(self): return 1000
    def __getitem__(self, i): time.sleep(600); return i
batches = iter(torch.utils.data.DataLoader(Slow(), num_workers=2, persistent_workers=True))
print(" ".join(str(w.pid) for w in batches._workers), flush=True)
time.sleep(600)
"""


def test_a_killed_runs_data_loader_workers_do_not_keep_its_directory(tmp_path):
    """Killed at once (SIGKILL), a run leaves its forked data-loader workers alive for a while;
    the run's restart must not find the directory in use by them."""
    import signal
    import subprocess
    import sys

    from tests.conftest import cpu_env

    run = subprocess.Popen([sys.executable, "-c", HOLD_LOCK_WITH_WORKERS, str(tmp_path)], cwd=REPO,
                           env=cpu_env(), stdout=subprocess.PIPE, text=True)
    workers = [int(p) for p in run.stdout.readline().split()]
    try:
        assert len(workers) == 2
        run.kill()
        run.wait()
        for pid in workers:
            os.kill(pid, 0)  # still alive: the case that matters
        lock, warning = store.claim(tmp_path, fresh=False)
        assert lock is not None and warning is None
        lock.close()
    finally:
        run.kill()
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_second_claim_in_the_same_process_is_refused_and_leaves_the_first_held(tmp_path):
    """Two trainers in one process (a notebook, Ray's local mode) must not share a directory;
    the refused claim must not release the first one's lock either."""
    import subprocess
    import sys

    from tests.conftest import cpu_env

    first, _ = store.claim(tmp_path, fresh=False)
    with pytest.raises(CheckpointError, match="in use by another run"):
        store.claim(tmp_path, fresh=False)
    other = subprocess.run([sys.executable, "-c", HOLD_LOCK, str(tmp_path)], cwd=REPO, env=cpu_env(),
                           capture_output=True, text=True, timeout=60)
    assert "in use by another run" in other.stderr, other.stdout + other.stderr  # still held
    first.close()
    again, _ = store.claim(tmp_path, fresh=False)
    again.close()


def test_a_fresh_run_refuses_a_directory_with_checkpoints(tmp_path):
    lock, _ = store.claim(tmp_path, fresh=True)  # empty: fine
    lock.close()
    (tmp_path / ".tmp-step_00000002").mkdir()  # an uncommitted save is not a checkpoint
    lock, _ = store.claim(tmp_path, fresh=True)
    lock.close()
    _save(tmp_path, 3)
    with pytest.raises(CheckpointError, match="holds another run's checkpoints \\(newest: step_00000003\\)"):
        store.claim(tmp_path, fresh=True)
    assert (tmp_path / "latest").read_text() == "step_00000003\n"
    lock, _ = store.claim(tmp_path, fresh=False)  # resuming it is fine
    lock.close()


def test_copies_beside_the_checkpoints_are_neither_loaded_nor_retained_away(tmp_path):
    for step in (2, 4, 6, 8):
        _save(tmp_path, step)
    (tmp_path / "step_00000004.bak").mkdir()  # a copy a person made
    (tmp_path / "step_00000009-old").mkdir()
    assert [p.name for p in store.committed_steps(tmp_path)] == [
        "step_00000008", "step_00000006", "step_00000004", "step_00000002"]
    keeper, messages = _chooser(tmp_path, "checkpoint.keep_last=2")
    keeper.writer._apply_retention(8)  # rank 0 between two collectives: must not raise
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == [
        "step_00000004.bak", "step_00000006", "step_00000008", "step_00000009-old"]
    (tmp_path / "latest").write_text("step_00000004.bak\n")
    with pytest.raises(CheckpointError, match="does not name a checkpoint directory"):
        store.read_latest(tmp_path)


@pytest.mark.parametrize("bad", ["shape", "unreadable"])
def test_a_bad_manifest_is_a_checkpoint_error_and_the_fallback_skips_it(tmp_path, bad):
    """Valid JSON of the wrong shape, or a manifest that cannot be read (an OS error: here a
    directory in its place): the error names the file, and load_fallback uses the one before."""
    _save(tmp_path, 3)
    newest = _save(tmp_path, 6)
    manifest = newest / store.MANIFEST
    manifest.unlink()
    if bad == "shape":
        manifest.write_text('{"format": 1, "step": 6, "files": "rank_00000.pt"}')
        match = "is not a checkpoint manifest"
    else:
        manifest.mkdir()
        match = "cannot read .*manifest.json"
    with pytest.raises(CheckpointError, match=match):
        read_manifest(newest)
    chooser, _ = _chooser(tmp_path)
    with pytest.raises(CheckpointError, match=match):
        _choose(chooser)
    chooser, messages = _chooser(tmp_path, "checkpoint.load_fallback=true")
    assert _choose(chooser)[0].name == "step_00000003"
    for text in ("[]", "null", '{"format": 1, "files": []}'):
        manifest.rmdir() if manifest.is_dir() else manifest.unlink()
        manifest.write_text(text)
        with pytest.raises(CheckpointError):
            read_manifest(newest)


class _RunsCode:
    """Unpickling this calls os.system: what a file planted in a shared directory could do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_rank_file_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "code-ran"
    path = _save(tmp_path / "ck", 3, payload=_RunsCode(marker))
    verify(path, read_manifest(path))  # its checksums are right: it was planted whole
    with pytest.raises(CheckpointError, match="rank_00000.pt holds objects other than tensors"):
        store.load_rank_file(path / "rank_00000.pt")
    assert not marker.exists()


def test_rank_files_of_earlier_versions_with_numpy_rng_state_still_load(tmp_path):
    import numpy as np
    import torch

    state = {"rng": {"numpy": np.random.get_state(), "torch": torch.get_rng_state()}, "fragments": []}
    path = _save(tmp_path, 3, payload=state)
    loaded = store.load_rank_file(path / "rank_00000.pt")["payload"]
    assert np.array_equal(loaded["rng"]["numpy"][1], state["rng"]["numpy"][1])


def test_abandon_repoints_latest_before_moving_so_a_crash_midway_leaves_it_valid(tmp_path, monkeypatch):
    for step in (2, 4, 6):
        _save(tmp_path, step)
    real_replace = store.os.replace

    def crash_on_step_4(src, dst):
        if Path(src).name == "step_00000004":
            raise OSError(5, "Input/output error (the node died here)")
        real_replace(src, dst)

    monkeypatch.setattr(store.os, "replace", crash_on_step_4)
    with pytest.raises(OSError):
        store.abandon_after(tmp_path, tmp_path / "step_00000002", "rollback1")
    monkeypatch.setattr(store.os, "replace", real_replace)
    assert store.read_latest(tmp_path) == tmp_path / "step_00000002"
    # The resume after the crash moves the leftover newer checkpoint aside (retention would
    # otherwise count it as the run's newest save) and resumes from `latest`.
    chooser, messages = _chooser(tmp_path)
    assert _choose(chooser)[0].name == "step_00000002"
    assert [p.name for p in store.committed_steps(tmp_path)] == ["step_00000002"]
    assert sorted(p.name for p in (tmp_path / "abandoned").iterdir()) == [
        "step_00000004-newer-than-latest", "step_00000006-rollback1"]
    assert any("newer than 'latest' was moved aside" in m for m in messages)


def test_architecture_check_names_differences_and_reads_older_manifests(tmp_path):
    from megatron_lite.checkpoint.checkpointer import architecture
    from megatron_lite.model import resolve_model

    chooser, _ = _chooser(tmp_path)
    model = resolve_model(chooser.ctx.cfg.model, 65, chooser.ctx.cfg.data.seq_length)
    chooser.ctx.model_cfg = model
    manifest = {"model": architecture(model), "data": {"seq_length": chooser.ctx.cfg.data.seq_length}}
    chooser.reader._check_architecture(manifest, tmp_path)  # the same model
    older = dict(manifest["model"])
    del older["rope_theta"]  # written before the field was recorded: it had its default
    assert model.rope_theta == type(model)().rope_theta
    chooser.reader._check_architecture({**manifest, "model": older}, tmp_path)
    older["n_layers"] = model.n_layers + 1
    with pytest.raises(CheckpointError, match=f"model.n_layers: checkpoint {model.n_layers + 1}, "
                                              f"recipe {model.n_layers}"):
        chooser.reader._check_architecture({**manifest, "model": older}, tmp_path)


def _with_files(root, step, names):
    """A committed-looking checkpoint whose manifest lists ``names`` (each with the size and
    SHA-256 of a file outside the checkpoint, as a planted manifest would)."""
    import hashlib
    import json

    outside = root / "outside.bin"
    outside.write_bytes(b"not part of any checkpoint")
    path = root / store.step_name(step)
    (path / "a").mkdir(parents=True)
    entry = {"bytes": outside.stat().st_size, "sha256": hashlib.sha256(outside.read_bytes()).hexdigest()}
    manifest = {"format": store.FORMAT_VERSION, "step": step, **RESUMABLE,
                "files": [{"name": name, **entry} for name in names]}
    (path / store.MANIFEST).write_text(json.dumps(manifest))
    (root / "latest").write_text(path.name + "\n")
    return path, manifest


@pytest.mark.parametrize("name", ["../outside.bin", "{root}/outside.bin", "a/../../outside.bin",
                                  "a/rank_00000.pt", "..", "", "a\\b"])
def test_a_manifest_entry_that_is_a_path_is_refused_on_verify_and_on_load(tmp_path, name):
    name = name.format(root=tmp_path)
    path, manifest = _with_files(tmp_path, 3, ["rank_00000.pt", name])
    problem = f"file entry {name!r} is not a plain file name"
    with pytest.raises(CheckpointError, match=re.escape(problem)) as verify_error:
        verify(path, manifest)
    with pytest.raises(CheckpointError, match=re.escape(problem)):
        read_manifest(path)
    chooser, _ = _chooser(tmp_path)
    with pytest.raises(CheckpointError, match=re.escape(problem)) as load_error:
        chooser.load()
    for error in (verify_error, load_error):
        assert "\n" not in str(error.value) and str(path / store.MANIFEST) in str(error.value)


def test_a_manifest_entry_that_is_a_path_is_skipped_by_the_fallback(tmp_path):
    _save(tmp_path, 2)
    _with_files(tmp_path, 3, ["../outside.bin"])
    chooser, messages = _chooser(tmp_path, "checkpoint.load_fallback=true")
    assert _choose(chooser)[0].name == "step_00000002"
    assert any("skipping" in m and "'../outside.bin' is not a plain file name" in m for m in messages)


def _fragment(name="w", slice_shape=(8,), start=0, cuts=(), values=8):
    import torch

    values = torch.arange(float(values)) if isinstance(values, int) else values
    return {"name": name, "slice_shape": list(slice_shape), "cuts": [list(c) for c in cuts],
            "start": start, "tensors": {k: values for k in ("param", "exp_avg", "exp_avg_sq")}}


def test_a_fragment_larger_than_its_file_is_refused_before_it_is_read(tmp_path):
    """A tensor recorded with stride 0 claims a million elements from 4 bytes of file: loading
    would take the recorded size as data. The load stops at the file, naming it."""
    import torch

    from megatron_lite.checkpoint.checkpointer import architecture
    from megatron_lite.model import resolve_model

    chooser, _ = _chooser(tmp_path)
    chooser.ctx.model_cfg = resolve_model(chooser.ctx.cfg.model, 65, chooser.ctx.cfg.data.seq_length)
    huge = torch.zeros(1).expand(1 << 20)
    state = {"rank": 0, "rng": None, "trainer": None,
             "fragments": [_fragment(slice_shape=(1 << 20,), values=huge)]}
    tmp = tmp_path / ".tmp-step_00000003"
    tmp.mkdir()
    files = [store.write_rank_file(tmp, 0, state)]
    store.commit(tmp_path, tmp, {"format": store.FORMAT_VERSION, "step": 3, "files": files, **RESUMABLE,
                                 "model": architecture(chooser.ctx.model_cfg),
                                 "data": {"seq_length": chooser.ctx.cfg.data.seq_length}})
    with pytest.raises(CheckpointError, match=r"step_00000003/rank_00000.pt: fragment of 'w' records "
                                              r"4194304 bytes, more than its file's \d+"):
        chooser.load()


@pytest.mark.parametrize("bad, problem", [
    (dict(start=-4, values=4), r"elements -4\.\.0 lie outside its piece of shape \[8\]"),
    (dict(start=4), r"elements 4\.\.12 lie outside its piece of shape \[8\]"),
    (dict(cuts=((1, 0, 2),)), r"cuts \[\(1, 0, 2\)\] do not fit its piece of shape \[8\]"),
    (dict(cuts=((0, 2, 2),)), r"cuts \[\(0, 2, 2\)\] do not fit"),
])
def test_a_fragment_outside_its_piece_is_refused(bad, problem):
    """Without the check a negative start silently overwrites the end of the piece."""
    from megatron_lite.checkpoint.shards import file_fragments

    with pytest.raises(ValueError, match=problem):
        file_fragments({"fragments": [_fragment(), _fragment(**bad)]}, file_bytes=1 << 20)


@pytest.mark.parametrize("bad", [dict(slice_shape=(1 << 40,)), dict(cuts=((0, 0, 1 << 40),))])
def test_a_recorded_shape_larger_than_the_fragments_is_refused_before_anything_is_allocated(
        bad, monkeypatch):
    """A piece (or the whole, through its cuts) recorded larger than its fragments hold: without
    the check the loader allocates it (4 TiB here) before finding the gaps."""
    import torch

    from megatron_lite.checkpoint.shards import Assembler, file_fragments

    fragments = file_fragments({"fragments": [_fragment(**bad)]}, file_bytes=1 << 20)
    allocated, real_full = [], torch.full

    def full(size, *args, **kwargs):
        allocated.append(size)
        return real_full(size, *args, **kwargs)

    monkeypatch.setattr(torch, "full", full)
    with pytest.raises(ValueError, match="fragments of 'w' do not cover it"):
        Assembler(fragments).full("w", "param")
    assert allocated == []
    assembled = Assembler(file_fragments({"fragments": [_fragment()]}, file_bytes=1 << 20)).full("w", "param")
    assert assembled.tolist() == list(range(8))


def test_two_abandons_of_a_same_named_checkpoint_keep_both(tmp_path):
    """Moved, never deleted: a second checkpoint newer than `latest` with the name of one moved
    aside before (two interrupted commits of the same step) gets a name of its own."""
    keep = _save(tmp_path, 2)
    _save(tmp_path, 4, payload=b"first")
    first = store.abandon_after(tmp_path, keep, "newer-than-latest")
    _save(tmp_path, 4, payload=b"second")
    second = store.abandon_after(tmp_path, keep, "newer-than-latest")
    _save(tmp_path, 4, payload=b"third")
    third = store.abandon_after(tmp_path, keep, "newer-than-latest")
    assert [p.name for p in first + second + third] == [
        "step_00000004-newer-than-latest", "step_00000004-newer-than-latest.2",
        "step_00000004-newer-than-latest.3"]
    payloads = [store.load_rank_file(p / "rank_00000.pt")["payload"] for p in first + second + third]
    assert payloads == [b"first", b"second", b"third"]
    assert store.read_latest(tmp_path) == keep


# ---------------------------------------------------------------- export and tampered manifests

CHAR_MODEL = dict(vocab_size=65, vocab_multiple=1, n_layers=1, n_heads=4, d_model=32, max_seq_len=16,
                  position="learned", norm="layernorm", activation="gelu_exact", bias=True,
                  tie_embeddings=True)


def _trained_checkpoint(root, tokenizer=("char", None)):
    """A checkpoint as a run of shakespeare-char's model writes it (one rank, no training): its
    fragments, and a manifest whose recipe names ``tokenizer`` (kind, path; a 65-character
    vocabulary by default)."""
    import json

    import yaml

    from megatron_lite.checkpoint.checkpointer import architecture
    from megatron_lite.checkpoint.shards import Fragment
    from megatron_lite.config.schema import ModelConfig
    from megatron_lite.model import build_model

    kind, model_path = tokenizer
    if model_path is None:
        model_path = root / "chars.json"
        model_path.parent.mkdir(parents=True, exist_ok=True)
        model_path.write_text(json.dumps([chr(c) for c in range(32, 32 + 65)]))
    cfg = ModelConfig(**CHAR_MODEL)
    fragments = []
    for name, p in build_model(cfg).named_parameters():
        flat = p.detach().reshape(-1).clone()
        fragments.append(Fragment(name, tuple(p.shape), (), 0, {"param": flat, "exp_avg": flat * 0,
                                                                "exp_avg_sq": flat * 0}).to_dict())
    tmp = root / ".tmp-step_00000001"
    tmp.mkdir(parents=True)
    files = [store.write_rank_file(tmp, 0, {"rank": 0, "fragments": fragments, "rng": None})]
    recipe = {"data": {"seq_length": 16, "tokenizer": {"type": kind, "model": str(model_path)}},
              "model": {"max_seq_len": 16}}
    return store.commit(root, tmp, {
        "format": store.FORMAT_VERSION, "step": 1, "consumed_samples": 4, "topology": {"world_size": 1},
        "model": architecture(cfg), "data": {"seq_length": 16, "tokenizer": kind}, "files": files,
        "config": yaml.safe_dump(recipe)})


def _tool(capsys, *args):
    """tools/convert_checkpoint.py in this process: (exit status, stdout, stderr lines)."""
    from tools.convert_checkpoint import main

    status = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return status, out, [line for line in err.splitlines() if line.strip()]


def _tamper(path, change):
    import json

    manifest = json.loads((path / store.MANIFEST).read_text())
    change(manifest)
    (path / store.MANIFEST).write_text(json.dumps(manifest))


def test_an_export_onto_a_file_is_refused_and_wrote_is_said_only_of_what_is_there(
        tmp_path, capsys, monkeypatch):
    path = _trained_checkpoint(tmp_path / "ck")
    target = tmp_path / "existing"
    target.write_text("keep me")
    status, out, err = _tool(capsys, "--to", "hf", path, target)
    assert status == 2 and not out and len(err) == 1, err
    assert err[0].startswith("error: ") and f"{target} exists and is not a directory" in err[0]
    assert target.read_text() == "keep me"
    # A write that transformers gives up on without raising (it logs, writes nothing).
    from transformers import PreTrainedModel

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", lambda self, *a, **k: None)
    status, out, err = _tool(capsys, "--to", "hf", path, tmp_path / "hf")
    assert status == 2 and "wrote" not in out and "did not write config.json, model.safetensors" in err[-1]


def test_a_listed_file_that_is_a_link_or_not_a_file_is_refused_everywhere(tmp_path, capsys):
    """A rank file swapped for a symbolic link to a file outside the checkpoint (the same bytes,
    so its size and SHA-256 match) is refused by name on verify, load and export."""
    path = _trained_checkpoint(tmp_path / "ck")
    rank = path / "rank_00000.pt"
    outside = tmp_path / "outside.pt"
    rank.rename(outside)
    rank.symlink_to(outside)
    problem = f"{rank} is a symbolic link (to {outside}), not a file of the checkpoint"
    with pytest.raises(CheckpointError, match=re.escape(problem)):
        verify(path, read_manifest(path))
    with pytest.raises(CheckpointError, match=re.escape(problem)):
        store.load_rank_file(rank)
    chooser, _ = _chooser(tmp_path / "ck")
    with pytest.raises(CheckpointError, match=re.escape(problem)) as error:
        chooser.load()
    assert "\n" not in str(error.value)
    status, out, err = _tool(capsys, "--to", "hf", path, tmp_path / "hf")
    assert status == 2 and not out and len(err) == 1 and problem in err[0], err
    rank.unlink()
    rank.mkdir()
    with pytest.raises(CheckpointError, match=re.escape(f"{rank} is not a regular file")):
        verify(path, read_manifest(path))


@pytest.mark.parametrize("change, named", [
    (lambda m: m.update(model=None), "'model' is None, not a mapping"),
    (lambda m: m.update(data=[1]), "'data' is [1], not a mapping"),
    (lambda m: m.update(topology="x"), "'topology' is 'x', not a mapping"),
    (lambda m: m.pop("model"), "it has no 'model' section"),
    (lambda m: m["model"].update(n_heads=0), "model.n_heads=0: is not a positive integer"),
    (lambda m: m["model"].update(norm="batchnorm"), "model.norm='batchnorm': is not one of"),
    (lambda m: m["data"].update(seq_length="64"), "data.seq_length='64' is not a positive integer"),
], ids=["model-null", "data-list", "topology", "no-model", "heads", "norm", "seq-length"])
def test_a_manifest_section_of_the_wrong_type_is_refused_on_resume_and_export(tmp_path, capsys, change,
                                                                               named):
    path = _trained_checkpoint(tmp_path / "ck")
    _tamper(path, change)
    chooser, _ = _chooser(tmp_path / "ck")
    with pytest.raises(CheckpointError, match=re.escape(named)) as error:
        chooser.load()
    assert "\n" not in str(error.value)
    status, out, err = _tool(capsys, "--to", "hf", path, tmp_path / "hf")
    assert status == 2 and len(err) == 1 and named in err[0] and "Traceback" not in err[0], err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("change, named", [
    (lambda m: m.update(files=[]), "its files hold no tok_emb.weight"),
    (lambda m: m["model"].update(vocab_size=1_000_000_000), "model.vocab_size=1000000000 does not match "
                                                            "the weights (tok_emb.weight has 65 rows)"),
    (lambda m: m["model"].update(vocab_size=100), "model.vocab_size=100 does not match"),
    (lambda m: m["model"].update(d_model=256), "model.d_model=256 does not match the weights "
                                               "(tok_emb.weight is 32 wide)"),
    (lambda m: m["model"].update(n_layers=1_000_000_000), "model.n_layers=1000000000 does not match"),
    (lambda m: m["model"].update(n_heads=5), "model.n_heads=5 with model.n_kv_heads=4 does not divide"),
    (lambda m: m["model"].update(ffn_hidden=64), "model.ffn_hidden=64 or model.activation='gelu_exact' "
                                                 "does not match the weights (blocks.0.mlp.up_proj"),
    (lambda m: m["model"].update(tie_embeddings=False), "model.tie_embeddings=False does not match the "
                                                        "weights (lm_head.weight is not in the checkpoint"),
    # (The first parameter in the way is a key bias: Qwen2's qkv_bias would put it there too.)
    (lambda m: m["model"].update(bias=False), "model.bias=False or model.qkv_bias=False does not match"),
], ids=["no-files", "vocab-huge", "vocab", "width", "layers-huge", "heads", "ffn", "tied", "bias"])
def test_model_fields_that_do_not_describe_the_weights_are_refused_before_anything_is_built(
        tmp_path, capsys, monkeypatch, change, named):
    """Compared with the shapes the fragments record: nothing is assembled, and no model (or
    vocabulary of a billion rows) is built, before the field is named."""
    from megatron_lite.checkpoint import convert

    path = _trained_checkpoint(tmp_path / "ck")
    _tamper(path, change)
    assembled = []
    monkeypatch.setattr(convert.Assembler, "full", lambda self, *a: assembled.append(a))
    status, out, err = _tool(capsys, "--to", "hf", path, tmp_path / "hf")
    assert status == 2 and len(err) == 1 and named in err[0] and "Traceback" not in err[0], err
    assert assembled == [] and not (tmp_path / "hf").exists()


def test_a_resume_into_a_model_its_weights_do_not_fit_names_the_parameter():
    import torch

    from megatron_lite.checkpoint.shards import Assembler, Fragment, shape_mismatches

    def fragment(name, shape):
        flat = torch.zeros(shape).reshape(-1)
        return Fragment(name, shape, (), 0, {"param": flat, "exp_avg": flat, "exp_avg_sq": flat})

    assembler = Assembler([fragment("tok_emb.weight", (128, 32)), fragment("norm.weight", (32,))])
    # More vocabulary rows than the model's: another layout's padding, cut off on load.
    assert shape_mismatches({"tok_emb.weight": (96, 32), "norm.weight": (32,)}, assembler, 65) == []
    assert shape_mismatches({"tok_emb.weight": (256, 32), "norm.weight": (64,), "w": (2,)}, assembler,
                            200) == ["tok_emb.weight is [128, 32] in the checkpoint, [256, 32] in this model",
                                     "norm.weight is [32] in the checkpoint, [64] in this model",
                                     "w is not in the checkpoint"]


def _hf_tokenizer(directory, bos, eos):
    """A word-level Hugging Face tokenizer of 65 tokens whose bos and eos are the given ids."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(65)}
    vocab["<s>"], vocab["</s>"] = bos, eos
    del vocab[f"w{bos}"], vocab[f"w{eos}"]
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="w0")),
                                  bos_token="<s>", eos_token="</s>")
    tok.save_pretrained(directory)
    return directory


IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def test_an_export_writes_the_recipe_tokenizers_ids_and_never_one_outside_the_vocabulary(tmp_path, capsys):
    import json

    # A character vocabulary has no special tokens: null, not GPT-2's 50256 (of another vocabulary).
    path = _trained_checkpoint(tmp_path / "char")
    status, _, _ = _tool(capsys, "--to", "hf", path, tmp_path / "hf-char")
    written = json.loads((tmp_path / "hf-char/config.json").read_text())
    assert status == 0 and [written.get(k) for k in IDS] == [None] * 3  # (transformers 4 omits nulls)
    generation = json.loads((tmp_path / "hf-char/generation_config.json").read_text())
    assert generation.get("bos_token_id") is None and generation.get("eos_token_id") is None

    tokenizer = _hf_tokenizer(tmp_path / "tok", bos=3, eos=4)
    path = _trained_checkpoint(tmp_path / "hf-tok", tokenizer=("huggingface", tokenizer))
    status, _, _ = _tool(capsys, "--to", "hf", path, tmp_path / "hf")
    for name in ("config.json", "generation_config.json"):
        written = json.loads((tmp_path / "hf" / name).read_text())
        assert (status, written["bos_token_id"], written["eos_token_id"]) == (0, 3, 4), name

    _tamper(path, lambda m: m.update(token_ids={"bos_token_id": 7, "eos_token_id": [8, 50256],
                                                "pad_token_id": 50256}))
    status, _, err = _tool(capsys, "--to", "hf", path, tmp_path / "hf-recorded")
    written = json.loads((tmp_path / "hf-recorded/config.json").read_text())
    assert status == 0 and [written.get(k) for k in IDS] == [7, [8], None]
    assert any("pad_token_id=50256 names ids outside the vocabulary of 65; written as null" in e for e in err)


def test_a_manifest_lists_each_files_fragments_and_a_bad_list_is_refused(tmp_path):
    """The index a resuming rank chooses its files by (the 8-rank resume test reads by it):
    which fragment serves which need, and checked on read like the rest of the manifest (a list
    that is not fragments is refused, not followed)."""
    from megatron_lite.checkpoint.shard_index import Need, fragment_index, serves

    path = _trained_checkpoint(tmp_path / "ck")
    entries = fragment_index(store.load_rank_file(path / "rank_00000.pt")["fragments"])
    listed = {e[0] for e in entries}
    assert "tok_emb.weight" in listed and all(len(e) == 5 for e in entries)
    emb = next(e for e in entries if e[0] == "tok_emb.weight")
    rows, cols = emb[2]
    # The same piece: served by its element range; another layout's slices: by overlap.
    assert serves(emb, Need("tok_emb.weight", (rows, cols), (), 0, rows * cols))
    assert not serves(emb, Need("tok_emb.weight", (rows, cols), (), emb[4] + emb[3], emb[4] + emb[3] + 1))
    assert serves(emb, Need("tok_emb.weight", (rows, cols), ((1, 1, 2),), 0, rows * cols // 2))
    # The top half of a (64, 32) weight: not the bottom half, but the left half's top.
    half = ["w", [[0, 0, 2]], [32, 32], 0, 32 * 32]
    assert not serves(half, Need("w", (64, 32), ((0, 1, 2),), 0, 32 * 32))
    assert serves(half, Need("w", (64, 32), ((1, 0, 2),), 0, 64 * 16))
    assert serves(half, Need("w", (66, 32), ((0, 1, 2),), 0, 33 * 32))  # other padding: read
    _tamper(path, lambda m: m["files"][0].update(fragments=[["tok_emb.weight", "everything"]]))
    with pytest.raises(CheckpointError, match="not a checkpoint manifest"):
        read_manifest(path)
