#!/usr/bin/env python
"""Plot one or more runs from their run directories (``metrics.jsonl``).

    python tools/plot_run.py runs/a [runs/b ...] [--output plot.png] [--terminal]

Panels over steps: training and validation loss, learning rate, gradient norm, tokens/s, MFU
(where the device has a peak), and step / phase times (every ``*_ms`` key of the training
records). Several runs are overlaid, one colour each. Spikes (``spikes.jsonl``) and the events
of ``metrics.jsonl`` (slowdown, straggler, stop, ...) are marked as vertical lines. A step logged
twice (before a crash and again after the resume) keeps its last value. ``--terminal`` draws
loss and tokens/s as text (plotext 5) for a login node without a display; the PNG needs
matplotlib (both: ``pip install -e '.[report]'``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools._cli_args import figure_path, plotting_library  # noqa: E402

PANELS = [("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "gradient norm"),
          ("tokens_per_sec", "tokens/s"), ("mfu", "MFU")]
EVENT_COLOURS = {"spike": "red", "nonfinite": "black", "rollback": "purple", "slowdown": "orange",
                 "straggler": "brown"}


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a crash: the rest is still worth plotting
            continue
    return out


def load_run(run_dir: Path) -> dict:
    """{"name", "train": {step: record}, "val": {step: val_loss}, "events": [(step, kind)]}."""
    records = read_jsonl(run_dir / "metrics.jsonl")
    if not records:
        raise FileNotFoundError(f"{run_dir / 'metrics.jsonl'} is missing or empty: is {run_dir} a run "
                                "directory (logging.dir)?")
    train, val, events = {}, {}, []
    for r in records:
        if "event" in r:
            events.append((r["step"], r["event"]))
        elif "val_loss" in r:
            val[r["step"]] = r["val_loss"]
        elif "loss" in r:
            train[r["step"]] = r
    return {"name": run_dir.name, "train": train, "val": val, "events": events}


def series(run: dict, key: str) -> tuple[list[int], list[float]]:
    steps = sorted(s for s, r in run["train"].items() if isinstance(r.get(key), (int, float)))
    return steps, [run["train"][s][key] for s in steps]


INTERVAL_TIMES = ("eval_ms", "checkpoint_ms")
"""Times per log interval (evaluation, blocking saves); every other ``*_ms`` is per step."""


def time_keys(runs: list[dict]) -> list[str]:
    keys = {k for run in runs for r in run["train"].values() for k in r if k.endswith("_ms")}
    return sorted(keys)


def time_panels(runs: list[dict]) -> list[tuple[list[str], str]]:
    """(keys, y label) of the time panels present: per step (step time and its phases), and
    per log interval (evaluation and checkpoint time)."""
    keys = time_keys(runs)
    panels = [([k for k in keys if k not in INTERVAL_TIMES], "ms per step"),
              ([k for k in keys if k in INTERVAL_TIMES], "ms per log interval")]
    return [(ks, label) for ks, label in panels if ks]


def plot_png(runs: list[dict], output: Path) -> None:
    matplotlib = plotting_library("matplotlib", "the figure (or --terminal)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(k, t) for k, t in PANELS if any(series(run, k)[0] for run in runs)]
    times = time_panels(runs)
    rows = len(panels) + len(times)
    fig, axes = plt.subplots(rows, 1, figsize=(10, 2.6 * rows), sharex=True, squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (key, title) in enumerate(panels):
        ax = axes[i][0]
        for j, run in enumerate(runs):
            steps, values = series(run, key)
            ax.plot(steps, values, color=colours[j % len(colours)], label=run["name"], linewidth=1)
            if key == "loss" and run["val"]:
                vs = sorted(run["val"])
                ax.plot(vs, [run["val"][s] for s in vs], "o--", color=colours[j % len(colours)],
                        label=f"{run['name']} (validation)", markersize=3, linewidth=1)
        ax.set_ylabel(title)
        if key in ("loss", "grad_norm"):
            ax.set_yscale("log")
    styles = ["-", "--", ":", "-."]
    for row, (keys, label) in enumerate(times, start=len(panels)):
        ax = axes[row][0]
        for j, run in enumerate(runs):
            for k, key in enumerate(keys):
                steps, values = series(run, key)
                # One run: a colour per time. Several: a colour per run, a line style per time.
                colour = colours[(k if len(runs) == 1 else j) % len(colours)]
                style = "-" if len(runs) == 1 else styles[k % len(styles)]
                name = key.removesuffix("_ms")
                name = name if len(runs) == 1 else f"{run['name']} {name}"
                ax.plot(steps, values, style, color=colour, label=name, linewidth=1)
        ax.set_ylabel(label)
    for row in axes:
        ax = row[0]
        for run in runs:
            for step, kind in run["events"]:
                ax.axvline(step, color=EVENT_COLOURS.get(kind, "grey"), alpha=0.4, linewidth=0.8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[-1][0].set_xlabel("step")
    kinds = sorted({kind for run in runs for _, kind in run["events"]})
    title = " vs ".join(run["name"] for run in runs)
    if kinds:
        title += "  (vertical lines: " + ", ".join(kinds) + ")"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)


def plot_terminal(runs: list[dict], colour: bool) -> str:
    plt = plotting_library("plotext", "--terminal")

    out = []
    for key, title in [("loss", "loss"), ("tokens_per_sec", "tokens/s")]:
        plt.clear_figure()
        if not colour:
            plt.theme("clear")
        plt.title(title)
        for run in runs:
            steps, values = series(run, key)
            if steps:
                plt.plot(steps, values, label=run["name"])
            for step, _kind in run["events"]:
                plt.vline(step)
        plt.plotsize(100, 20)
        out.append(plt.build())
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories (logging.dir)")
    p.add_argument("--output", type=figure_path,
                   help="figure to write, .png (or .pdf, .svg, .jpg) (default: FIRST_RUN/plot.png)")
    p.add_argument("--terminal", action="store_true", help="draw loss and tokens/s as text instead")
    args = p.parse_args(argv)
    try:
        runs = [load_run(d) for d in args.runs]
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.terminal:
        print(plot_terminal(runs, colour=sys.stdout.isatty()))
        return 0
    output = args.output or args.runs[0] / "plot.png"
    plot_png(runs, output)
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
