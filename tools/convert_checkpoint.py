#!/usr/bin/env python
"""Convert checkpoints to and from Hugging Face transformers directories.

    # a training checkpoint (a step directory, or checkpoint.dir: the one 'latest' names) -> HF
    python tools/convert_checkpoint.py --to hf checkpoints/run checkpoints/run-hf [--tokenizer DIR]
    # an HF Llama / GPT-2 directory -> a step-0 checkpoint to start training from
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    way = p.add_mutually_exclusive_group(required=True)
    way.add_argument("--to", choices=["hf"], help="checkpoint -> Hugging Face directory")
    way.add_argument("--from", dest="source", choices=["hf"],
                     help="Hugging Face directory (or Hub id, where the network allows) -> checkpoint")
    p.add_argument("input", type=Path)
    p.add_argument("output", type=Path)
    p.add_argument("--tokenizer", type=Path, help="HF tokenizer directory to copy into the export")
    a = p.parse_args(argv)
    try:
        if a.output.exists() and not a.output.is_dir():
            raise ValueError(f"{a.output} exists and is not a directory; give a new or existing "
                             "directory as the output")
        if a.to:
            # export_hf raises unless the files it wrote are there: "wrote" is never said of
            # nothing.
            out = export_hf(a.input, a.output, a.tokenizer, log=lambda m: print(m, file=sys.stderr))
            print(f"wrote {out} (transformers.AutoModelForCausalLM.from_pretrained loads it)")
        else:
            if a.output.exists() and any(a.output.iterdir()):
                raise ValueError(f"{a.output} is not empty; give a new checkpoint directory")
            out = import_hf(a.input, a.output)
            print(f"wrote {out}; train from it with checkpoint.dir={a.output}")
    except (CheckpointError, FileNotFoundError, OSError, ValueError) as e:
        # One line: transformers' errors (a Hub id without network, a gated model) span several.
        print(f"error: {a.input}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
