"""tools/plot_run.py: runs read from metrics.jsonl (a step logged twice keeps its last value,
events kept), several runs overlaid in a PNG, text plots for a terminal, a clear error for a
directory that is not a run."""

from __future__ import annotations

import json

from tools import plot_run


def _run(path, losses, events=(), repeat=None):
    path.mkdir()
    lines = [{"step": s, "loss": v, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 1000.0 + s,
              "step_time_ms": 50.0} for s, v in enumerate(losses, 1)]
    if repeat is not None:  # the same step again after a resume, with the value that counts
        lines.append({**lines[repeat - 1], "loss": 0.5})
    lines += [{"step": s, "event": kind, "message": ""} for s, kind in events]
    lines.append({"step": len(losses), "val_loss": 2.0, "val_ppl": 7.4})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 9, "lo')
    return path


def test_runs_are_read_with_the_last_value_of_a_repeated_step(tmp_path):
    run = plot_run.load_run(_run(tmp_path / "a", [4.0, 3.0, 2.5], events=[(2, "spike")], repeat=2))
    assert plot_run.series(run, "loss") == ([1, 2, 3], [4.0, 0.5, 2.5])
    assert run["events"] == [(2, "spike")] and run["val"] == {3: 2.0}


def test_two_runs_make_one_png_and_a_terminal_plot(tmp_path, capsys):
    a, b = _run(tmp_path / "a", [4.0, 3.0, 2.5]), _run(tmp_path / "b", [4.1, 3.2], events=[(1, "slowdown")])
    assert plot_run.main([str(a), str(b), "--output", str(tmp_path / "cmp.png")]) == 0
    assert (tmp_path / "cmp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_run.main([str(a), str(b), "--terminal"]) == 0
    text = capsys.readouterr().out
    assert "loss" in text and "tokens/s" in text and " a" in text and " b" in text


def test_a_directory_without_metrics_is_refused(tmp_path, capsys):
    assert plot_run.main([str(tmp_path)]) == 2
    assert "metrics.jsonl is missing or empty" in capsys.readouterr().err


def test_step_times_and_interval_times_are_separate_panels(tmp_path):
    path = _run(tmp_path / "a", [4.0, 3.0])
    lines = [{"step": 1, "loss": 4.0, "step_time_ms": 50.0, "data_ms": 1.0, "forward_ms": 20.0,
              "eval_ms": 0.0, "checkpoint_ms": 40.0}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert plot_run.time_panels([plot_run.load_run(path)]) == [
        (["data_ms", "forward_ms", "step_time_ms"], "ms per step"),
        (["checkpoint_ms", "eval_ms"], "ms per log interval")]
