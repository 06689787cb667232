#!/usr/bin/env python
r"""Say where every rank of a hung run was: which collective the waiting ranks are in, on which
group, and which ranks are not there (and where they are instead).

    python tools/hang_report.py RUN_DIR          # RUN_DIR/hang/rank*.json (logging.dir)
    python tools/hang_report.py RUN_DIR --stacks # + each rank's Python stacks, all threads

The ranks write those files when one of them has waited in a collective for
``distributed.hang_dump_after`` of its timeout, or when a rank is sent SIGUSR2 (the launchers
send it to a job stuck past its walltime margin). On NCCL each rank also leaves
``nccl_trace_rank_{R}`` (the name torch gives its own dumps on a timeout): torch's
flight-recorder analyser reads those (``python -m torch.distributed.flight_recorder.fr_trace
--prefix nccl_trace_rank_ RUN_DIR/hang``).
Exit status 1 when there is nothing to read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.distributed.hang_report import read_dumps, summarize  # noqa: E402


def stacks(dump: dict) -> list[str]:
    lines = [f"rank {dump['rank']} ({dump.get('reason', '')}):"]
    for thread in dump.get("threads", []):
        lines.append(f"  thread {thread['thread']}{' (main)' if thread.get('main') else ''}:")
        lines += [f"    {f['file']}:{f['line']} in {f['function']}" for f in thread["frames"]]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="the run's logging.dir (or its hang/ folder)")
    p.add_argument("--stacks", action="store_true", help="print every rank's stacks too")
    a = p.parse_args(argv)
    folder = a.run_dir / "hang"
    if not folder.is_dir() and a.run_dir.name == "hang":  # the hang/ folder itself (a run
        folder = a.run_dir                                 # directory may be named hang too)
    dumps = read_dumps(folder)
    if not dumps:
        print(f"error: no rank*.json under {folder}: no rank reported a hang there "
              "(logging.dir of the run, on a file system every node writes to)", file=sys.stderr)
        return 1
    print("\n".join(summarize(dumps)))
    if a.stacks:
        for rank in sorted(dumps):
            print("\n".join(stacks(dumps[rank])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
