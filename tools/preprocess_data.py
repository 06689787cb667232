#!/usr/bin/env python
r"""Tokenize jsonl / parquet / plain-text files or Hugging Face datasets into Megatron-LM indexed
datasets (.bin/.idx).

Example:
    python tools/preprocess_data.py --input data/works.jsonl --output-prefix data/works \
        --json-keys text --tokenizer-type sentencepiece --tokenizer-model data/sp.model \
        --append-eod --workers 2
writes data/works_text_document.bin/.idx (Megatron's naming).

    python tools/preprocess_data.py --input hf:wikitext:wikitext-2-raw-v1 --split train ...
reads a Hugging Face dataset (the datasets library: pip install -e .[ray]).

    mpiexec -n 8 --ppn 1 python tools/preprocess_data.py --input 'data/shards/*.jsonl' ...
splits the files across 8 ranks (nodes); each writes its part, and the last to finish writes
the same dataset one process would (docs/data.md). --rank/--world-size name the part by hand.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.data.indexed import dataset_exists  # noqa: E402
from megatron_lite.data.preprocess import TEXT_SPLITS, PartsPending, PreprocessOptions, preprocess  # noqa: E402
from megatron_lite.distributed.launcher_env import detect  # noqa: E402
from tools._cli_args import non_negative_float, positive_int  # noqa: E402

TYPES = {"char": "char", "sentencepiece": "sentencepiece", "huggingface": "huggingface",
         "megatron-sentencepiece": "megatron-sentencepiece",
         # Megatron-LM's names, meaning what they mean there: its SentencePieceTokenizer appends
         # its own special tokens and ends documents with <EOD>; its GPTSentencePieceTokenizer is
         # the model's vocabulary with the model's EOS.
         "SentencePieceTokenizer": "megatron-sentencepiece", "GPTSentencePieceTokenizer": "sentencepiece",
         "HuggingFaceTokenizer": "huggingface"}

# Ranks under one launcher start together; a rank waits this long for the slowest one.
LAUNCHED_WAIT_S = 3600.0
PENDING = 3  # exit status: this rank's part is committed, the dataset is not written yet


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True,
                   help="input files or globs: .jsonl/.jsonl.gz (one JSON document per line), "
                        ".parquet (with pyarrow), or plain text (see --text-split); Hugging Face "
                        "datasets: hf:NAME[:CONFIG] from the Hub, a directory (Dataset.save_to_disk "
                        "or data files), .arrow files")
    p.add_argument("--split", default="train", help="the split of Hugging Face dataset inputs")
    p.add_argument("--streaming", action="store_true",
                   help="stream hf: datasets from the Hub instead of downloading them first")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSON keys to extract")
    p.add_argument("--tokenizer-type", required=True, choices=sorted(TYPES),
                   help="the kind of --tokenizer-model")
    p.add_argument("--tokenizer-model", required=True,
                   help="sentencepiece .model, Hugging Face directory, or char vocabulary JSON")
    p.add_argument("--append-eod", action="store_true",
                   help="end every document with the end-of-document token (added only where the "
                        "tokenizer did not already add it)")
    p.add_argument("--workers", type=positive_int, default=1, help="tokenizer processes")
    p.add_argument("--text-split", choices=TEXT_SPLITS, default="file",
                   help="plain-text inputs: one document per file, or per blank-line-separated block")
    p.add_argument("--strict", action="store_true",
                   help="any bad input (see docs/data.md) is an error naming the file and line; "
                        "no output is written")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--rank", type=int, default=None,
                   help="this process's rank of --world-size (default: from mpiexec, torchrun, Slurm)")
    p.add_argument("--world-size", type=positive_int, default=None,
                   help="ranks that share the input (default: from the launcher; 1 without one)")
    p.add_argument("--wait", type=non_negative_float, default=None, metavar="SECONDS",
                   help="several ranks: how long a rank whose part is written waits for the others "
                        f"and the merged dataset (default: {LAUNCHED_WAIT_S:.0f} under a launcher, 0 "
                        "with --rank/--world-size by hand). Exit status 0 means the whole dataset is "
                        f"written and verified; {PENDING} means this rank's part is committed and other "
                        "parts are still missing")
    p.add_argument("--overwrite", action="store_true",
                   help="replace datasets already at the output prefix (several ranks: give it to each)")
    args = p.parse_args(argv)
    if args.output_prefix.endswith(("/", "\\")) or Path(args.output_prefix).is_dir():
        p.error(f"--output-prefix {args.output_prefix} is a directory; give a name in it "
                f"({args.output_prefix.rstrip('/')}/corpus writes corpus_text_document.bin/.idx)")
    launched = detect()
    by_hand = args.rank is not None or args.world_size is not None
    rank = launched.rank if args.rank is None else args.rank
    world = launched.world_size if args.world_size is None else args.world_size
    wait = args.wait if args.wait is not None else (0.0 if by_hand else LAUNCHED_WAIT_S)
    # Replacing a dataset is refused by default: training runs built on it would change under
    # them. Under several ranks the merged dataset appears only once every rank's part is in,
    # so one already there when a rank starts is another run's.
    existing = [f"{args.output_prefix}_{key}_document" for key in args.json_keys
                if dataset_exists(f"{args.output_prefix}_{key}_document")]
    if existing and not args.overwrite:
        every = "" if world == 1 else " (given to every rank)"
        print(f"error: {existing[0]}.bin/.idx exists; give another --output-prefix, or --overwrite{every} "
              "to replace it", file=sys.stderr)
        return 2
    try:
        options = PreprocessOptions(TYPES[args.tokenizer_type], args.tokenizer_model, tuple(args.json_keys),
                                    append_eod=args.append_eod, text_split=args.text_split,
                                    strict=args.strict, workers=args.workers, split=args.split,
                                    streaming=args.streaming,
                                    show_progress=False if args.no_progress else None)
        preprocess(args.input, args.output_prefix, options, rank=rank, world=world, wait=wait)
    except PartsPending as e:
        print(str(e), file=sys.stderr)
        return PENDING
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
