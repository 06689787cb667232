"""tools/hang_report.py on dumps written by hand: the waiting ranks, the missing one, a rank that
wrote nothing, files that cannot be read."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


def _dump(rank: int, waiting: list[dict], begun: int, function: str) -> dict:
    frames = [{"file": "/x/megatron_lite/training/trainer.py", "line": 10 + rank, "function": "_train"},
              {"file": "/x/megatron_lite/training/trainer.py", "line": 99, "function": function}]
    return {"rank": rank, "world_size": 3, "host": "n0", "pid": 100 + rank, "time": 1.0, "reason": "r",
            "waiting": waiting, "begun": [{"group_name": "control", "count": begun}],
            "threads": [{"thread": "MainThread", "main": True, "frames": frames}]}


@pytest.mark.parametrize("run_dir, given", [("run", "run"), ("run", "run/hang"), ("hang", "hang")],
                         ids=["run-dir", "its-hang-folder", "run-dir-named-hang"])
def test_the_verdict_names_the_missing_rank_and_the_silent_one(tmp_path, run_dir, given):
    hang = tmp_path / run_dir / "hang"
    hang.mkdir(parents=True)
    w = {"name": "all_reduce", "what": "stop flags", "group_name": "control", "group": [0, 1, 2],
         "backend": "gloo", "seq": 7, "waited_s": 42.0}
    (hang / "rank0.json").write_text(json.dumps(_dump(0, [w], 7, "_train_record")))
    (hang / "rank1.json").write_text(json.dumps(_dump(1, [], 6, "compute_something")))
    (hang / "rank2.json").write_text('{"rank": 2, "wai')  # torn by a kill mid-write
    (hang / "rank3.json").write_text("[1, 2]")  # not a dump at all
    out = subprocess.run([sys.executable, "tools/hang_report.py", str(tmp_path / given)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    verdict, *ranks = out.stdout.splitlines()
    assert verdict.startswith("hang: rank 0 waits in all_reduce 'stop flags' (#7 on the control group, gloo, "
                              "ranks 0-2) for 42 s; missing: rank 1 (has begun 6 of that group's "
                              "collectives, not #7; at megatron_lite/training/trainer.py:99 in "
                              "compute_something (called from _train))"), verdict
    assert verdict.endswith("; no word from rank 2 (exited, frozen, or its logging.dir is not shared)")
    assert ranks[2] == "  rank 2: wrote nothing (exited, frozen, or its logging.dir is not shared)"


def test_nothing_to_read_is_exit_status_1(tmp_path):
    out = subprocess.run([sys.executable, "tools/hang_report.py", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "no rank*.json under" in out.stderr
