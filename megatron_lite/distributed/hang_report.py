"""Read the ranks' ``hang/rank{R}.json`` (hang.py) and say who waits where and who is missing.

The verdict groups the waiting ranks by collective (its group and its number on that group): the
ranks of that group that are not in it are the missing ones, and for each the report says where
it is instead (another collective, an earlier point of its program, or no file at all).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Frames of these files are plumbing, not where the program is.
_PLUMBING = ("/torch/", "/deepspeed/", "/threading.py", "distributed/collectives.py",
             "distributed/hang.py", "/dist_harness/")


def read_dumps(folder: Path) -> dict[int, dict[str, Any]]:
    """rank -> its dump, for every readable ``rank{R}.json`` under ``folder``."""
    out = {}
    for path in sorted(folder.glob("rank*.json")):
        try:
            dump = json.loads(path.read_text())
            out[int(dump["rank"])] = dump
        except (OSError, ValueError, KeyError, TypeError):  # torn or foreign: listed as unread
            continue
    return out


def ranks_text(ranks: list[int]) -> str:
    """'rank 3', 'ranks 0-7' (three or more in a row), 'ranks 0, 1, 4'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def _where(dump: dict[str, Any]) -> str:
    """The innermost frame of the main thread outside the plumbing, with its caller."""
    main = next((t for t in dump.get("threads", []) if t.get("main")), None)
    if main is None:
        return "no main-thread stack"
    own = [f for f in main["frames"] if not any(p in f["file"] for p in _PLUMBING)]
    if not own:
        return "no frame of the program"
    inner = own[-1]
    text = f"{_short(inner['file'])}:{inner['line']} in {inner['function']}"
    if len(own) > 1:
        text += f" (called from {own[-2]['function']})"
    return text


def _short(path: str) -> str:
    for root in ("megatron_lite/", "tools/", "tests/", "pretrain.py"):
        if root in path:
            return root + path.split(root, 1)[1] if root != "pretrain.py" else root
    return path


def _collective_text(w: dict[str, Any]) -> str:
    return (f"{w['name']} '{w['what']}' (#{w['seq']} on the {w['group_name']} group, {w['backend']}, "
            f"{ranks_text(w['group'])})")


def summarize(dumps: dict[int, dict[str, Any]], world_size: int | None = None) -> list[str]:
    """The report: the verdict first (one line), then a line per rank."""
    if not dumps:
        return ["hang: no rank wrote where it was"]
    world = max(world_size or 0, max(d.get("world_size", 1) for d in dumps.values()), max(dumps) + 1)
    # The collectives ranks wait in, by (group, number): the longest-waited first.
    sites: dict[tuple[str, tuple[int, ...], int], list[tuple[int, dict[str, Any]]]] = {}
    for rank, dump in dumps.items():
        for w in dump.get("waiting", []):
            sites.setdefault((w["group_name"], tuple(w["group"]), w["seq"]), []).append((rank, w))
    lines = []
    if sites:
        (name, group, seq), present = max(sites.items(), key=lambda kv: (max(w["waited_s"] for _, w in kv[1]),
                                                                   len(kv[1])))
        waiting = sorted(r for r, _ in present)
        first = present[0][1]
        missing = [r for r in group if r not in waiting]
        verdict = (f"hang: {ranks_text(waiting)} wait{'s' if len(waiting) == 1 else ''} in "
                   f"{_collective_text(first)} for {max(w['waited_s'] for _, w in present):.0f} s")
        if missing:
            verdict += f"; missing: {', '.join(_missing_text(r, name, seq, dumps) for r in missing)}"
        else:
            verdict += "; every rank of its group is in it (the transfer itself is stuck)"
        lines.append(verdict)
    else:
        lines.append("hang: no rank is in a collective of the project (see each rank's stack)")
    silent = [r for r in range(world) if r not in dumps]
    if silent:
        lines[0] += f"; no word from {ranks_text(silent)} (exited, frozen, or its logging.dir is not shared)"
    for rank in range(world):
        dump = dumps.get(rank)
        if dump is None:
            lines.append(f"  rank {rank}: wrote nothing (exited, frozen, or its logging.dir is not shared)")
            continue
        inside = "; ".join(f"{_collective_text(w)} for {w['waited_s']:.0f} s" for w in dump["waiting"])
        lines.append(f"  rank {rank} ({dump.get('host', '?')}, pid {dump.get('pid', '?')}): "
                     f"{'in ' + inside if inside else 'in no collective'}; at {_where(dump)}")
    return lines


def _missing_text(rank: int, name: str, seq: int, dumps: dict[int, dict[str, Any]]) -> str:
    dump = dumps.get(rank)
    if dump is None:
        return f"rank {rank} (wrote nothing)"
    begun = next((b["count"] for b in dump.get("begun", []) if b["group_name"] == name), 0)
    inside = dump.get("waiting", [])
    if inside:
        return f"rank {rank} (in {_collective_text(inside[0])} instead)"
    return f"rank {rank} (has begun {begun} of that group's collectives, not #{seq}; at {_where(dump)})"


def verdict(folder: Path, since: float = 0.0) -> str | None:
    """The report's first line for the dumps under ``folder`` written after ``since`` (a time),
    or None when there are none."""
    dumps = {r: d for r, d in read_dumps(folder).items() if d.get("time", 0) >= since}
    return summarize(dumps)[0] if dumps else None
