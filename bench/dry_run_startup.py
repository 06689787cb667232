"""Wall time of ``pretrain.py RECIPE --dry-run`` against the same command with torch._dynamo
imported first: what building the model on the meta device would cost if a Python reference
op (nn.Embedding's default normal_ fill, the RoPE tables' arange) ran there. Alternating runs,
medians and their ratio.

    python bench/dry_run_startup.py [--recipe recipes/llama3-8b.yaml] [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN = ("import runpy, sys; sys.argv = ['pretrain.py', sys.argv[1], '--dry-run']; "
       "runpy.run_path('pretrain.py', run_name='__main__')")


def timed(prelude: str, recipe: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", prelude + RUN, recipe], cwd=REPO, check=True,
                   capture_output=True, timeout=300)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/llama3-8b.yaml", help="the recipe to dry-run")
    parser.add_argument("--runs", type=int, default=5, help="runs of each, alternating")
    args = parser.parse_args()
    ours, with_dynamo = [], []
    for _ in range(args.runs):
        ours.append(timed("", args.recipe))
        with_dynamo.append(timed("import torch._dynamo; ", args.recipe))
    a, b = statistics.median(ours), statistics.median(with_dynamo)
    print(f"--dry-run {args.recipe}: {a:.2f} s; with torch._dynamo imported first: {b:.2f} s; "
          f"ratio {a / b:.2f}")


if __name__ == "__main__":
    main()
