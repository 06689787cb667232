"""One W&B run across a stop and a resume: the same run id, every step once, the resolved recipe
as the run's config (and as TensorBoard hyperparameters)."""

from __future__ import annotations

import signal
import struct
import subprocess

from tests.conftest import REPO, char_overrides, check, cpu_env, pretrain_command, run_pretrain

BLOCK = 32768  # W&B's transaction log is LevelDB's log format: 32 KiB blocks of framed records


def wandb_records(path):
    """The protobuf records of one offline run file (``run-ID.wandb``)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, buf, records = 7, b"", []
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            break
        buf += data[pos:pos + length]
        pos += length
        if kind in (1, 4):  # a whole record, or the last fragment of one
            record = pb.Record()
            record.ParseFromString(buf)
            records.append(record)
            buf = b""
    return records


def test_a_stopped_and_resumed_run_is_one_wandb_run_without_duplicated_steps(tmp_path):
    args = ["recipes/shakespeare-char.yaml", *char_overrides(tmp_path)[:3], f"logging.dir={tmp_path}/run",
            "training.iters=16", "training.log_interval=1", "training.eval_interval=1000",
            "training.eval_iters=2", "training.sample_tokens=0", "logging.wandb_mode=offline",
            "logging.wandb_tags=[char,test]", "logging.wandb_group=continuity",
            f"checkpoint.dir={tmp_path}/ck", "checkpoint.save_interval=5",
            "checkpoint.save_on_signal=false", "logging.tensorboard=true"]
    # Stopped by SIGTERM after step 7 without a save there (checkpoint.save_on_signal=false):
    # W&B has steps 1-7, the resume starts from the step-5 checkpoint and recomputes 6 and 7.
    proc = subprocess.Popen(pretrain_command(args), cwd=REPO, env={**cpu_env(), "WANDB_SILENT": "true"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step      7/16"):
            proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    check(run_pretrain(args, env={"WANDB_SILENT": "true"}))

    runs = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2, runs
    ids = [p.name.rsplit("-", 1)[1] for p in runs]
    assert len(set(ids)) == 1  # one run id for both starts
    steps, configs = [], []
    for run in runs:
        for record in wandb_records(run / f"run-{ids[0]}.wandb"):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                steps.append(record.history.step.num)
            elif kind == "run":
                configs.append({item.key for item in record.run.config.update})
                assert list(record.run.tags) == ["char", "test"] and record.run.run_group == "continuity"
    assert steps == sorted(set(steps)), steps  # increasing: no step twice
    assert set(range(1, 17)) <= set(steps), steps
    assert configs and all({"model", "data", "training", "parallel", "runtime"} <= keys for keys in configs)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    tags = events.PluginTagToContent("hparams")
    assert "_hparams_/experiment" in tags and b"training.iters" in tags["_hparams_/session_start_info"]
