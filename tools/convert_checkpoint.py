#!/usr/bin/env python
"""Convert checkpoints to and from Hugging Face transformers directories.

    # a training checkpoint (a step directory, or checkpoint.dir: the one 'latest' names) -> HF
    python tools/convert_checkpoint.py --to hf checkpoints/run checkpoints/run-hf [--tokenizer DIR]
    # an HF Llama / Qwen2 / Qwen3 / GPT-2 directory -> a step-0 checkpoint to start training from
    python tools/convert_checkpoint.py --from hf models/llama-hf checkpoints/new-run
    python pretrain.py RECIPE checkpoint.dir=checkpoints/new-run

Checkpoints are layout-free already: any parallel layout loads them directly.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.checkpoint.convert import export_hf, import_hf  # noqa: E402
from megatron_lite.checkpoint.store import CheckpointError  # noqa: E402
from megatron_lite.data.tokenizers import is_hub_id  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    way = p.add_mutually_exclusive_group(required=True)
    way.add_argument("--to", choices=["hf"], help="checkpoint -> Hugging Face directory")
    way.add_argument("--from", dest="source", choices=["hf"],
                     help="Hugging Face directory (or Hub id, where the network allows) -> checkpoint")
    p.add_argument("input", type=Path,
                   help="--to hf: a checkpoint step directory, or a checkpoint.dir (its 'latest'); "
                        "--from hf: a Hugging Face model directory or Hub id (ORG/NAME)")
    p.add_argument("output", type=Path,
                   help="--to hf: the export directory (new or empty); --from hf: a new checkpoint.dir")
    p.add_argument("--tokenizer", type=Path, help="HF tokenizer directory to copy into the export")
    p.add_argument("--overwrite", action="store_true",
                   help="--to hf: replace the files of an earlier export in OUTPUT")
    a = p.parse_args(argv)
    problem = _output_problem(a) or _tokenizer_problem(a)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    # A path shaped like a Hub id whose first folder exists here (models/llama-hf) is a missing
    # local copy, not a download.
    local = not is_hub_id(str(a.input)) or (len(a.input.parts) > 1 and Path(a.input.parts[0]).is_dir())
    if a.source and not a.input.exists() and local:
        print(f"error: {a.input} does not exist (a local Hugging Face model directory; a Hub id "
              "is written ORG/NAME)", file=sys.stderr)
        return 2
    try:
        if a.to:
            # export_hf raises unless the files it wrote are there: "wrote" is never said of
            # nothing.
            out = export_hf(a.input, a.output, a.tokenizer, log=lambda m: print(m, file=sys.stderr))
            print(f"wrote {out} (transformers.AutoModelForCausalLM.from_pretrained loads it)")
        else:
            out = import_hf(a.input, a.output)
            print(f"wrote {out}; train from it with checkpoint.dir={a.output}")
    except (CheckpointError, FileNotFoundError, OSError, ValueError) as e:
        # One line: transformers' errors (a Hub id without network, a gated model) span several.
        message = " ".join(str(e).split())
        print(f"error: {message if str(a.input) in message else f'{a.input}: {message}'}", file=sys.stderr)
        return 2
    return 0


def _output_problem(a: argparse.Namespace) -> str | None:
    """Why OUTPUT cannot be written (before anything is read): not a directory, or holding files
    that would be overwritten (an earlier export: only with --overwrite; a checkpoint: never)."""
    if not a.output.exists():
        return None
    if not a.output.is_dir():
        return f"output {a.output} exists and is not a directory; give a new or empty directory"
    if not any(a.output.iterdir()):
        return None
    if a.source:
        return f"output {a.output} is not empty; give a new checkpoint directory"
    if not a.overwrite:
        return (f"output {a.output} is not empty; give a new directory, or --overwrite to replace an "
                "earlier export there")
    # --overwrite replaces an export, nothing else: never a checkpoint, a run or a dataset.
    foreign = sorted(e.name for e in a.output.iterdir() if not _export_file(e))
    if foreign or not (a.output / "config.json").is_file():
        what = f"it holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}" if foreign \
            else "it has no config.json"
        return (f"output {a.output} is not an earlier export ({what}): --overwrite only replaces "
                "one; give a new directory")
    return None


EXPORT_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
"""What an export holds: transformers' model and tokenizer files."""


def _export_file(entry: Path) -> bool:
    name = entry.name
    return entry.is_file() and (name in EXPORT_FILES
                                or (name.startswith("model-") and name.endswith(".safetensors")))


def _tokenizer_problem(a: argparse.Namespace) -> str | None:
    """Why ``--tokenizer`` cannot go into the export (before anything is read)."""
    if a.tokenizer is None:
        return None
    if a.source:
        return "--tokenizer is for --to hf (an import keeps the recipe's tokenizer)"
    if not (a.tokenizer / "tokenizer_config.json").is_file():
        return (f"--tokenizer {a.tokenizer}: not a Hugging Face tokenizer directory (no "
                "tokenizer_config.json); give the directory AutoTokenizer.save_pretrained wrote")
    return None

if __name__ == "__main__":
    sys.exit(main())
