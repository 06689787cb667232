#!/usr/bin/env python
"""Downstream tasks (lm-evaluation-harness) on a checkpoint: a table on stdout, JSON on request.

    python tools/evaluate.py checkpoints/run --tasks hellaswag,arc_easy --limit 100 --output eval.json
    # tasks of your own: a folder of lm-eval task YAML files
    python tools/evaluate.py checkpoints/run --tasks my_task --include-path tasks/

CHECKPOINT is a step directory or a checkpoint.dir (its 'latest'); an import
(tools/convert_checkpoint.py --from hf) included. The tokenizer is the recipe's, or the Hugging
Face directory an import came from; --tokenizer PATH overrides it. Needs the eval extra:
pip install 'megatron_lite[eval]'. Scores equal lm-eval's own HFLM on the exported model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools._cli_args import positive_int  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="a checkpoint step directory, or a checkpoint.dir")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task (or group) names")
    p.add_argument("--limit", type=positive_int, help="at most N documents per task (a quick look)")
    p.add_argument("--num-fewshot", type=int, help="few-shot examples (default: each task's own, else 0)")
    p.add_argument("--include-path", type=Path, help="a folder of lm-eval task YAML files of your own")
    p.add_argument("--tokenizer", type=Path, help="tokenizer path (HF directory, .model, char JSON), "
                                                  "instead of the one the checkpoint names")
    p.add_argument("--tokenizer-type", help="--tokenizer's type (default: from its path)",
                   choices=["huggingface", "sentencepiece", "megatron-sentencepiece", "char"])
    p.add_argument("--batch-size", type=positive_int, default=8, help="requests per forward pass")
    p.add_argument("--max-length", type=positive_int,
                   help="context window (default: the model's max_seq_len); longer contexts lose their start")
    p.add_argument("--output", type=Path, help="write the metrics and lm-eval's results here (JSON)")
    p.add_argument("--log-samples", action="store_true",
                   help="with --output: each request's responses too (per-request log-likelihoods)")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")
    a = p.parse_args(argv)
    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    problem = _input_problem(a, tasks)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    from megatron_lite.checkpoint.store import CheckpointError
    from megatron_lite.evaluation import harness

    try:
        harness.require_lm_eval()
        include = None if a.include_path is None else str(a.include_path)
        harness.resolve_tasks(tasks, include)  # an unknown task is reported before the model is read
        model, tok, _ = harness.load_checkpoint(a.checkpoint, a.device, a.tokenizer, a.tokenizer_type)
        lm = harness.harness_lm(model, tok, a.max_length or model.cfg.max_seq_len, a.device, a.batch_size)
        results = harness.run_tasks(lm, tasks, limit=a.limit, include_path=include,
                                    num_fewshot=a.num_fewshot, log_samples=a.log_samples)
    except harness.MissingExtraError as e:
        raise SystemExit(f"error: {e}") from None
    except (CheckpointError, harness.UnknownTaskError, FileNotFoundError, OSError, ValueError) as e:
        message = " ".join(str(e).split())  # transformers' and lm_eval's errors span lines
        print(f"error: {message}", file=sys.stderr)
        return 2
    metrics = harness.flat_metrics(results)
    _print_table(metrics)
    if a.output is not None:
        record = {"checkpoint": str(a.checkpoint), "tasks": tasks, "limit": a.limit, "metrics": metrics,
                  "results": results.get("results", {}), "n-shot": results.get("n-shot", {}),
                  "versions": results.get("versions", {})}
        if a.log_samples:
            record["samples"] = {task: [{"doc_id": s.get("doc_id"), "resps": s.get("resps"),
                                         "filtered_resps": s.get("filtered_resps")} for s in samples]
                                 for task, samples in results.get("samples", {}).items()}
        a.output.parent.mkdir(parents=True, exist_ok=True)
        a.output.write_text(json.dumps(record, indent=1, default=str) + "\n")
        print(f"wrote {a.output}")
    return 0


def _input_problem(a: argparse.Namespace, tasks: list[str]) -> str | None:
    """What is wrong with the command line, found before anything is loaded."""
    if not tasks:
        return "--tasks names no task; give comma-separated lm-eval task names"
    if not a.checkpoint.exists():
        return (f"checkpoint {a.checkpoint} does not exist (give a checkpoint step directory, or a "
                "checkpoint.dir whose 'latest' names one)")
    if a.include_path is not None and not a.include_path.is_dir():
        return f"--include-path {a.include_path} is not a directory (a folder of lm-eval task YAML files)"
    if a.tokenizer is not None and not a.tokenizer.exists():
        return f"--tokenizer {a.tokenizer} does not exist"
    if a.output is not None and a.output.is_dir():
        return f"--output {a.output} is a directory; give a file (JSON)"
    if a.log_samples and a.output is None:
        return "--log-samples is written to --output FILE.json; give one"
    import torch

    try:
        device = torch.device(a.device)
    except (RuntimeError, ValueError):
        return f"--device {a.device}: not a torch device (cpu, cuda, cuda:1, hpu, ...)"
    backend = getattr(torch, device.type, None)
    if device.type != "cpu" and not (backend is not None and backend.is_available()):
        return f"--device {a.device}: no {device.type} device here (or this torch build lacks it)"
    return None


def _print_table(metrics: dict[str, float]) -> None:
    rows = [(name.split("/", 2)[1], name.split("/", 2)[2], value) for name, value in metrics.items()]
    width = max([len("task")] + [len(r[0]) for r in rows])
    mwidth = max([len("metric")] + [len(r[1]) for r in rows])
    print(f"{'task':<{width}}  {'metric':<{mwidth}}  value")
    for task, metric, value in rows:
        print(f"{task:<{width}}  {metric:<{mwidth}}  {value:.6g}")


if __name__ == "__main__":
    sys.exit(main())
