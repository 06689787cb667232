#!/usr/bin/env python
r"""Report the loss spikes, non-finite steps and rollbacks of a run.

    python tools/spike_report.py RUN_DIR                 # table of events (RUN_DIR/spikes.jsonl)
    python tools/spike_report.py RUN_DIR --text          # + decoded text of the spiking samples
    python tools/spike_report.py RUN_DIR --plot loss.png # + the loss curve with events marked

``--text`` decodes each event's samples from the datasets recorded in the event, with the
tokenizer of the run's ``config.yaml``; ``--data-prefix`` reads them from another copy of the
dataset and ``--tokenizer-model`` names another tokenizer file. The plot needs matplotlib
(``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.spikes import SPIKES_FILE  # noqa: E402
from tools._cli_args import figure_path, plotting_library, positive_int  # noqa: E402


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # blank, or the torn last line of a run that was killed mid-write
            continue
    return out


def _num(x, fmt: str = ".4g") -> str:
    return "-" if x is None else format(x, fmt)


def table(events: list[dict]) -> list[str]:
    head = f"{'#':>3} {'step':>7} {'event':<10} {'action':<9} {'reasons':<15} {'loss':>8} {'z':>7} " \
           f"{'gnorm':>8} {'z':>7} {'lr':>9}  samples"
    lines = [head, "-" * len(head)]
    for e in events:
        if e["event"] in ("spike", "nonfinite"):
            a, b = e["sample_range"]
            lines.append(f"{e['index']:>3} {e['step']:>7} {e['event']:<10} {e['action']:<9} "
                         f"{'+'.join(e['reasons']):<15} {_num(e['loss']):>8} {_num(e['loss_z'], '.1f'):>7} "
                         f"{_num(e['grad_norm']):>8} {_num(e['grad_norm_z'], '.1f'):>7} "
                         f"{_num(e['lr'], '.2e'):>9}  {a}..{b - 1}")
        elif e["event"] == "rollback":
            a, b = e["skip_samples"]
            lines.append(f"{e['index']:>3} {e['step']:>7} {'rollback':<10} to step {e['to_step']} "
                         f"({e['checkpoint']}), samples {a}..{b - 1} skipped "
                         f"[{e['rollbacks']}/{e['max_rollbacks']}]")
        else:
            lines.append(f"{e['index']:>3} {e['step']:>7} {e['event']:<10} {e.get('message', '')}")
    return lines


def sample_texts(events: list[dict], tokenizer, data_prefix: str | None, per_event: int,
                 chars: int) -> list[str]:
    from megatron_lite.data.indexed import IndexedDataset

    opened: dict[str, IndexedDataset] = {}
    lines = []
    for e in events:
        if "samples" not in e:
            continue
        lines.append(f"== event {e['index']}: {e['event']} at step {e['step']} "
                     f"({len(e['samples'])} samples, showing {min(per_event, len(e['samples']))})")
        for s in e["samples"][:per_event]:
            prefix = data_prefix or s["dataset"]
            if prefix not in opened:
                opened[prefix] = IndexedDataset(prefix)
            data = opened[prefix]
            first = data.pointers // data.dtype.itemsize
            ids = []
            for doc, lo, hi in s["pieces"]:
                ids += data.tokens[int(first[doc]) + lo:int(first[doc]) + hi].tolist()
            docs = ", ".join(f"doc {doc} [{lo}:{hi}]" for doc, lo, hi in s["pieces"])
            text = tokenizer.decode(ids)
            shown = text if len(text) <= chars else text[:chars] + " ..."
            lines.append(f"-- sample {s['index']} ({Path(prefix).name}: {docs})")
            lines.append(shown)
    return lines


def plot(run_dir: Path, events: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r and "event" not in r]
    # A rollback sends the step back: each stretch of rising steps is drawn as its own line.
    segments: list[list[dict]] = [[]]
    for r in records:
        if segments[-1] and r["step"] <= segments[-1][-1]["step"]:
            segments.append([])
        segments[-1].append(r)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for k, seg in enumerate(s for s in segments if s):
        ax.plot([r["step"] for r in seg], [r["loss"] for r in seg], lw=1,
                label="training loss" if k == 0 else f"after rollback {k}")
    styles = {"spike": ("tab:red", "v"), "nonfinite": ("black", "x")}
    for kind, (color, marker) in styles.items():
        hits = [e for e in events if e["event"] == kind and e["loss"] is not None
                and e["loss"] == e["loss"]]  # NaN losses have no height
        if hits:
            ax.scatter([e["step"] for e in hits], [e["loss"] for e in hits], color=color, marker=marker,
                       zorder=3, label=f"{kind} ({len(hits)})")
        flat = [e for e in events if e["event"] == kind and e not in hits]
        for k, e in enumerate(flat):
            ax.axvline(e["step"], color=color, ls=":", lw=1,
                       label=f"{kind}, no finite loss ({len(flat)})" if k == 0 else None)
    for e in events:
        if e["event"] == "rollback":
            ax.axvspan(e["to_step"], e["step"], color="tab:orange", alpha=0.15)
            ax.annotate(f"rollback to {e['to_step']}", (e["to_step"], 1), xycoords=("data", "axes fraction"),
                        xytext=(2, -12), textcoords="offset points", fontsize=8, color="tab:orange")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{run_dir.name}: loss and spike events")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="the run's logging.dir (its spikes.jsonl and metrics.jsonl)")
    p.add_argument("--text", action="store_true", help="decode the samples of each event")
    p.add_argument("--samples", type=positive_int, default=3, help="samples decoded per event (default 3)")
    p.add_argument("--chars", type=positive_int, default=300,
                   help="characters shown per sample (default 300)")
    p.add_argument("--data-prefix", help="read samples from this dataset prefix instead of the recorded one")
    p.add_argument("--tokenizer-type",
                   choices=["char", "sentencepiece", "huggingface", "megatron-sentencepiece"],
                   help="tokenizer type instead of the run config's")
    p.add_argument("--tokenizer-model", help="tokenizer file/dir instead of the run config's")
    p.add_argument("--plot", type=figure_path,
                   help="write the loss curve with events marked to this figure (.png, .pdf, .svg, .jpg)")
    args = p.parse_args(argv)

    events = read_jsonl(args.run_dir / SPIKES_FILE)
    if not events and not (args.run_dir / SPIKES_FILE).is_file():
        if not args.run_dir.is_dir():
            print(f"error: {args.run_dir} is not a directory (give a run's logging.dir)", file=sys.stderr)
            return 2
        print(f"no {SPIKES_FILE} in {args.run_dir}: the run recorded no events")
    print("\n".join(table(events)))
    if args.text:
        from omegaconf import OmegaConf

        from megatron_lite.data.tokenizers import load_tokenizer

        config = args.run_dir / "config.yaml"
        if not config.is_file() and not (args.tokenizer_type and args.tokenizer_model):
            print(f"error: {config} is missing; give --tokenizer-type and --tokenizer-model",
                  file=sys.stderr)
            return 1
        tok_cfg = OmegaConf.load(config).data.tokenizer if config.is_file() else None
        try:
            tokenizer = load_tokenizer(args.tokenizer_type or tok_cfg.type,
                                       args.tokenizer_model or tok_cfg.model)
            texts = sample_texts(events, tokenizer, args.data_prefix, args.samples, args.chars)
        except (OSError, ValueError, IndexError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print()
        print("\n".join(texts))
    if args.plot:
        plotting_library("matplotlib", "--plot")
        plot(args.run_dir, events, args.plot)
        print(f"\nplot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
