#!/usr/bin/env python
r"""Concatenate several indexed datasets (.bin/.idx) into one, in the order given.

    python tools/merge_datasets.py --inputs data/a_text_document data/b_text_document \
        --output-prefix data/ab_text_document
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.data.indexed import dataset_exists, merge  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inputs", nargs="+", required=True, help="dataset prefixes (without .bin/.idx)")
    p.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin/.idx")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset already at the output prefix")
    args = p.parse_args(argv)
    if dataset_exists(args.output_prefix) and not args.overwrite:
        print(f"error: {args.output_prefix}.bin/.idx exists; give another --output-prefix, or "
              "--overwrite to replace it", file=sys.stderr)
        return 2
    try:
        docs, tokens = merge(args.inputs, args.output_prefix)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output_prefix}.bin/.idx: {docs:,} documents, {tokens:,} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
