"""Checkpoints: exact resume after a killed process, resharding, integrity and crash safety."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from tests.conftest import char_overrides, check, read_metrics, run_pretrain, run_pretrain_and_kill


def _args(tmp, *extra):
    # The 65 characters: 65 rows in one process, 66 under TP=2 (the padding row is masked and
    # moves between the layouts as zeros).
    return ["recipes/shakespeare-char.yaml", *char_overrides(tmp)[:3], "training.log_interval=1",
            "training.eval_interval=0", "training.eval_iters=1", "training.global_batch_size=8",
            "training.micro_batch_size=2", "training.sample_tokens=0", *extra]


def _records(run_dir, first_step):
    return [r for r in read_metrics(run_dir) if "loss" in r and r["step"] >= first_step]


# (Synchronous saves with one process and with tensor parallelism; data parallelism with ZeRO-1
# is resumed from a background save in test_checkpoint_faults.py's SIGTERM test.) Dropout draws
# from the random state every step (under TP=2 the attention's tensor-rank streams too): a
# resume that did not restore it would differ.
# One process is killed after its step-3 save and also evaluates and samples text every 2 steps
# (the samples after the resume are the uninterrupted run's), in bf16: without ZeRO DeepSpeed
# steps fp32 copies of the weights, which hold the Adam state and must be what is saved and
# restored. Under TP=2 the uninterrupted run itself saves at step 3 (saving must not disturb a
# run) and its later checkpoint is removed, as if the run had died after step 3: what the resume
# restores is what the kill case shows, at one run less.
@pytest.mark.parametrize("nproc, layout", [
    (1, ["training.eval_interval=2", "training.sample_tokens=16", "training.precision=bf16"]),
    (2, ["parallel.tensor=2"]),
], ids=["one-process", "tp2"])
def test_resume_after_kill_is_bitwise_exact(tmp_path, nproc, layout):
    full = _args(tmp_path, "training.iters=6", "model.dropout=0.1", *layout)
    ck = [f"checkpoint.dir={tmp_path}/ck", "checkpoint.save_interval=3"]
    if nproc == 1:
        uninterrupted = check(run_pretrain([*full, f"logging.dir={tmp_path}/full"], nproc=nproc))
        # (A background save announces itself when committed: the kill comes after the commit.)
        # Steps 5 and 6 (samples 32-47) read slowly in the killed run, so the kill lands before
        # it can finish and save step 6, however late a loaded machine lets the test see the line.
        run_pretrain_and_kill([*full, *ck, f"logging.dir={tmp_path}/killed"], nproc,
                              f"saved checkpoint {tmp_path}/ck/step_00000003",
                              env={"FAULT_SLOW_DATA": "32:48:5"})
    else:
        uninterrupted = check(run_pretrain([*full, *ck, f"logging.dir={tmp_path}/full"], nproc=nproc))
        shutil.rmtree(tmp_path / "ck/step_00000006")
        (tmp_path / "ck/latest").write_text("step_00000003\n")
    resumed = check(run_pretrain([*full, *ck, f"logging.dir={tmp_path}/resumed"], nproc=nproc))
    want, got = _records(tmp_path / "full", 4), _records(tmp_path / "resumed", 1)
    assert [r["step"] for r in got] == [4, 5, 6]
    for key in ("loss", "grad_norm", "lr", "consumed_samples"):
        assert [r[key] for r in got] == [r[key] for r in want], key
    if "training.sample_tokens=16" in layout:
        evals = [[(r["step"], r["val_loss"]) for r in read_metrics(tmp_path / run) if "val_loss" in r]
                 for run in ("full", "resumed")]
        assert evals[1] == [e for e in evals[0] if e[0] > 3] and len(evals[1]) == 2, evals
        samples = [re.findall(r"sample at step ([46]):\n(.*?)\n-{40}", p.stdout, re.S)
                   for p in (uninterrupted, resumed)]
        assert len(samples[1]) == 2 and samples[0] == samples[1], samples


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One process, 6 steps, its checkpoint at the end: the reference every resharded run is
    held against (one run for all of them)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    check(run_pretrain([*_args(tmp, "training.iters=6"), f"checkpoint.dir={tmp}/ck-full",
                        f"logging.dir={tmp}/full"]))
    return tmp


@pytest.mark.parametrize("save, resume", [
    # Tiles (each block linear 2 x 2 parameters) load into the plain layers, ZeRO-3 into none.
    ((2, ["parallel.zero_stage=3", "parallel.tile_factor=2"]), (1, [])),
    ((4, ["parallel.hsdp=true", "parallel.hsdp_shard_size=2"]), (2, ["parallel.zero_stage=2"])),
    # Into ring attention, whose ZeRO-1 partitions span the context ranks (saved at step 6).
    ((4, ["parallel.tensor=2", "parallel.pipeline=2"]), (2, ["parallel.context=2", "parallel.zero_stage=1"])),
], ids=["dp2-zero3-tiled-to-1", "hsdp2x2-to-dp2-zero2", "tp2xpp2-to-context2-zero1"])
def test_checkpoint_loads_into_another_layout(tmp_path, uninterrupted, save, resume):
    ck = [f"checkpoint.dir={tmp_path}/ck", "checkpoint.save_interval=3"]
    check(run_pretrain([*_args(tmp_path, "training.iters=3", *save[1]), *ck, f"logging.dir={tmp_path}/a"],
                       nproc=save[0]))
    proc = check(run_pretrain([*_args(tmp_path, "training.iters=6", *resume[1]), *ck,
                               f"logging.dir={tmp_path}/b"], nproc=resume[0]))
    assert "saved with layout" in proc.stdout
    if "parallel.hsdp=true" in save[1]:
        # The second copy of the shard group (ranks 2 and 3) holds the same partitions as the
        # first: it writes none.
        written = [torch.load(tmp_path / f"ck/step_00000003/rank_{r:05d}.pt", weights_only=False)["fragments"]
                   for r in range(4)]
        assert written[0] and written[1] and not written[2] and not written[3]
    want, got = _records(uninterrupted / "full", 4), _records(tmp_path / "b", 1)
    assert [r["step"] for r in got] == [4, 5, 6]
    for key in ("loss", "grad_norm", "lr"):
        torch.testing.assert_close(torch.tensor([r[key] for r in got]), torch.tensor([r[key] for r in want]),
                                   rtol=1e-5, atol=0, msg=key)
    # The gathered weights and Adam moments written at the end match the uninterrupted run's.
    ours = _gathered_state(tmp_path / "ck/step_00000006")
    theirs = _gathered_state(uninterrupted / "ck-full/step_00000006")
    assert ours.keys() == theirs.keys()
    # Each kind of state at its own scale: Adam's second moments are ~1e-9 here, where the
    # weights' absolute tolerance would accept anything. (Per kind, not per tensor: a key
    # projection's bias gets no gradient, so its values are rounding noise of any size.)
    scale = {key: max(v.abs().max().item() for (_, k), v in theirs.items() if k == key)
             for key in {k for _, k in theirs}}
    for (name, key), value in theirs.items():
        atol = 1e-6 if key == "param" else 1e-6 * scale[key]
        torch.testing.assert_close(ours[name, key], value, rtol=1e-4, atol=atol, msg=f"{name} {key}")


def _gathered_state(path):
    from megatron_lite.checkpoint.manifest import read_manifest
    from megatron_lite.checkpoint.shards import STATE_KEYS, Assembler, Fragment

    manifest = read_manifest(path)
    fragments = [Fragment.from_dict(d) for f in manifest["files"]
                 for d in torch.load(path / f["name"], weights_only=False)["fragments"]]
    assembler = Assembler(fragments)
    return {(name, key): assembler.full(name, key)
            for name in assembler.names() for key in ("param", *STATE_KEYS)}


def test_corrupt_checkpoint_stops_the_run_naming_the_file_and_a_fresh_run_is_refused(tmp_path):
    """Two ranks: each verifies its own file (the corrupt rank-1 file is found by rank 1)."""
    ck = [f"checkpoint.dir={tmp_path}/ck", "checkpoint.save_interval=2"]
    dp2 = ["parallel.zero_stage=1"]
    check(run_pretrain([*_args(tmp_path, "training.iters=4", *dp2), *ck, f"logging.dir={tmp_path}/a"],
                       nproc=2))
    # A new run (resume=false) on this directory is refused before it touches anything.
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "ck").rglob("*")}
    proc = run_pretrain([*_args(tmp_path, "training.iters=2"), *ck, "checkpoint.resume=false",
                         f"logging.dir={tmp_path}/fresh"])
    assert proc.returncode == 1
    assert "holds another run's checkpoints (newest: step_00000004) and checkpoint.resume is false" \
        in proc.stderr
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "ck").rglob("*")} == before
    shard = tmp_path / "ck/step_00000004/rank_00001.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x01
    shard.write_bytes(bytes(data))
    proc = run_pretrain([*_args(tmp_path, "training.iters=6", *dp2), *ck, f"logging.dir={tmp_path}/b"],
                        nproc=2)
    assert proc.returncode == 1
    assert f"{shard} does not match its SHA-256 in the manifest (corrupt) (checked by rank 1)" in proc.stderr
    assert "load_fallback=true" in proc.stderr
    # With the fallback the run resumes from the previous checkpoint (step 2).
    proc = check(run_pretrain([*_args(tmp_path, "training.iters=6", *dp2), *ck,
                               "checkpoint.load_fallback=true", f"logging.dir={tmp_path}/c"], nproc=2))
    assert "resumed from" in proc.stdout and "step_00000002 at step 2" in proc.stdout


class _Planted:
    """Unpickled, it creates ``marker``: what a file planted in a shared checkpoint directory
    could do with any code instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_planted_file_that_would_run_code_is_refused_on_resume_and_on_conversion(tmp_path):
    """The rank file is replaced by a pickle that runs code when loaded, and the manifest is
    updated to match (whoever can write the file can write the manifest): resuming and
    converting both refuse it through the command line, naming it, and the code never runs."""
    import hashlib
    import json
    import subprocess
    import sys

    from tests.conftest import REPO, cpu_env

    ck = [f"checkpoint.dir={tmp_path}/ck", "checkpoint.save_interval=2"]
    check(run_pretrain([*_args(tmp_path, "training.iters=2"), *ck, f"logging.dir={tmp_path}/a"]))
    step = tmp_path / "ck/step_00000002"
    planted, marker = step / "rank_00000.pt", tmp_path / "code-ran"
    torch.save({"fragments": [], "trainer": _Planted(marker)}, planted)
    manifest = json.loads((step / "manifest.json").read_text())
    (entry,) = [e for e in manifest["files"] if e["name"] == planted.name]
    entry["bytes"], entry["sha256"] = planted.stat().st_size, hashlib.sha256(planted.read_bytes()).hexdigest()
    (step / "manifest.json").write_text(json.dumps(manifest))

    proc = run_pretrain([*_args(tmp_path, "training.iters=4"), *ck, f"logging.dir={tmp_path}/b"])
    assert proc.returncode == 1 and not marker.exists()
    assert f"{planted} holds objects other than tensors and plain values" in proc.stderr, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, str(REPO / "tools/convert_checkpoint.py"), "--to", "hf",
                           str(tmp_path / "ck"), str(tmp_path / "hf")], cwd=REPO, env=cpu_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and not marker.exists()
    assert f"{planted} holds objects other than tensors and plain values" in proc.stderr + proc.stdout


def test_retention_after_ten_saves(tmp_path):
    """With background saves (they commit and prune through the same code as synchronous ones,
    in the writer thread, while training goes on)."""
    ck = [f"checkpoint.dir={tmp_path}/ck", "checkpoint.save_interval=1", "checkpoint.keep_last=3",
          "checkpoint.keep_every=4", "checkpoint.async_save=true"]
    check(run_pretrain([*_args(tmp_path, "training.iters=10"), *ck, f"logging.dir={tmp_path}/run"]))
    kept = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert kept == [".lock", "latest", "step_00000004", "step_00000008", "step_00000009", "step_00000010"]
    assert (tmp_path / "ck/latest").read_text().strip() == "step_00000010"


def test_a_changed_schedule_on_resume_is_refused_or_followed_as_asked(tmp_path):
    """Resumed at step 6 with training.iters raised from 6 to 8 (the cosine decay now ends at 8):
    refused by default; schedule.on_resume=recipe gives the 8-step run's rates, =checkpoint the
    6-step schedule's end (min_lr) — never the checkpoint's rate for one step and the recipe's
    for the next."""
    import shutil

    lr = ["optimizer.lr=1e-3", "optimizer.min_lr=1e-4", "schedule.warmup_iters=2"]
    check(run_pretrain([*_args(tmp_path, "training.iters=6", *lr), f"checkpoint.dir={tmp_path}/ck",
                        "checkpoint.save_interval=3", f"logging.dir={tmp_path}/six"]))
    check(run_pretrain([*_args(tmp_path, "training.iters=8", *lr), f"logging.dir={tmp_path}/eight"]))
    for name in ("refused", "recipe", "checkpoint"):
        shutil.copytree(tmp_path / "ck", tmp_path / f"ck-{name}")
    longer = [*_args(tmp_path, "training.iters=8", *lr)]
    proc = run_pretrain([*longer, f"checkpoint.dir={tmp_path}/ck-refused", f"logging.dir={tmp_path}/r"])
    assert proc.returncode == 1
    reason = proc.stderr.strip().splitlines()[-1]
    assert "learning-rate schedule differs" in reason and "decay_end 6 -> 8" in reason
    assert "schedule.on_resume=checkpoint" in reason and "schedule.on_resume=recipe" in reason
    for mode, want in (("recipe", [r["lr"] for r in _records(tmp_path / "eight", 7)]),
                       ("checkpoint", [1e-4, 1e-4])):
        proc = check(run_pretrain([*longer, f"schedule.on_resume={mode}",
                                   f"checkpoint.dir={tmp_path}/ck-{mode}", f"logging.dir={tmp_path}/{mode}"]))
        assert f"learning-rate schedule: the {mode}'s from step 6" in proc.stdout
        got = _records(tmp_path / mode, 7)
        assert [r["step"] for r in got] == [7, 8]
        torch.testing.assert_close([r["lr"] for r in got], want, rtol=1e-6, atol=0)


def test_an_eight_rank_resume_reads_only_the_files_each_rank_needs(tmp_path):
    """Tensor 2 × data 2 × pipeline 2 under ZeRO-1 (ranks: tensor fastest, then data, then
    stage). A rank needs its stage's fragments of its tensor slice, split by ZeRO-1 between its
    file and its data-parallel peer's; the replicated parameters (norms), written by tensor
    rank 0 of its stage and split the same way; and rank 0's file for the trainer's state.
    Every rank read all 8 files before (on a parallel filesystem, N² opens and reads)."""
    layout = ["parallel.tensor=2", "parallel.pipeline=2", "parallel.zero_stage=1", "model.n_layers=2",
              "model.tie_embeddings=false"]
    ck = [f"checkpoint.dir={tmp_path}/ck", "checkpoint.save_interval=2"]
    check(run_pretrain([*_args(tmp_path, "training.iters=2", *layout), *ck, f"logging.dir={tmp_path}/a"],
                       nproc=8))
    reads = tmp_path / "reads"
    resume = [*_args(tmp_path, "training.iters=3", *layout), *ck, f"logging.dir={tmp_path}/b"]
    proc = check(run_pretrain(resume, nproc=8, env={"RECORD_RANK_FILE_READS": str(reads)}))
    assert "resumed from" in proc.stdout
    for rank in range(8):
        stage, tp = rank // 4, rank % 2
        want = {0} | {r for r in range(4 * stage, 4 * stage + 4) if r % 2 in (0, tp)}
        got = (reads / f"rank{rank}.txt").read_text().split()
        assert sorted(got) == [f"rank_{r:05d}.pt" for r in sorted(want)], (rank, got)
