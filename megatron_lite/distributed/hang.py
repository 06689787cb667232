"""Hangs that explain themselves: where every rank is when a run stops moving.

A hung job otherwise ends at the collective timeout with one rank's "Timed out" and no word of
where the others were. Two parts:

- **The record.** Every collective the project issues (``collectives.py``) is noted while its
  thread is in it: its name, what the ranks are agreeing on, its group's ranks and its number on
  that group. The ranks of a group issue the same collectives in the same order, so a rank that
  stopped earlier shows a lower number. (DeepSpeed's own collectives are not noted: the stacks
  show them.)
- **The watcher** (``HangWatch``), a thread per rank. Every few seconds the watchers exchange two
  flags over a gloo group of their own: "I have waited in one collective for
  ``distributed.hang_dump_after`` of its group's timeout" and "I was sent SIGUSR2". When any rank
  raises one, every rank writes ``hang/rank{R}.json`` under ``logging.dir``: the collective it is
  in (or none), the last one it finished on each group, and the Python stacks of all its threads;
  on NCCL also the flight recorder's buffer (``rank{R}.nccl_trace``). ``tools/hang_report.py``
  reads them (``hang_report.py`` beside this file). The watchers run on their own threads: the
  main thread waits in a collective with the interpreter released, so the watcher can read its
  stack. A rank whose interpreter is held by a stuck call writes nothing; the report names it.

torch's flight recorder covers NCCL only, and it records the device side of collectives, not what
the program was doing: this is the part no library gives (DeepSpeed and gloo give neither).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

DUMP_SIGNAL = signal.SIGUSR2


class Waiting(NamedTuple):
    """One collective a thread is in (a tuple: one is made for every collective of a step)."""

    name: str
    what: str
    group_name: str
    """ParallelDims' name of the group (control, tensor, ...)."""
    group: tuple[int, ...]
    backend: str
    seq: int
    """Its number among the project's collectives on ``group`` (1 for the first)."""
    since: float
    """time.time() when it began."""
    timeout_s: float


_groups: dict[int, tuple[str, tuple[int, ...], str, float]] = {}
"""id(group) -> (its name, its global ranks, its backend, its timeout in seconds); filled by
ParallelDims."""
_counts: dict[str, int] = {}
"""Per group (by its name): how many of the project's collectives this rank has begun on it."""
_last_progress = [time.time()]
"""When this rank last began or ended a collective of the project, or began a training step."""
_waiting: dict[int, Waiting] = {}
"""Thread id -> the collective that thread is in."""


def register_group(group, name: str, timeout_s: float) -> None:
    """Remember ``group``'s name, ranks, backend and timeout (``ParallelDims`` calls it for each
    group it makes)."""
    if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
        _groups[id(group)] = (name, tuple(dist.get_process_group_ranks(group)), dist.get_backend(group),
                              timeout_s)


def progress() -> None:
    """This rank is moving (the trainer calls it at each step): a long silence counts as stuck
    even where the wait is in a collective the project does not issue itself (DeepSpeed's)."""
    _last_progress[0] = time.time()


class waiting_in:
    """``with waiting_in(name, what, group):`` notes that this thread is in collective ``name``
    on ``group`` while the block runs. (A class, not a generator-based context manager: it
    wraps every collective of a tensor-parallel step, and costs a third as much.)"""

    __slots__ = ("name", "what", "group", "me", "outer")

    def __init__(self, name: str, what: str, group):
        self.name, self.what, self.group, self.me, self.outer = name, what, group, None, None

    def __enter__(self) -> None:
        known = _groups.get(id(self.group))
        if known is None:  # a group made elsewhere (DeepSpeed's), or no torch.distributed
            return
        group_name, ranks, backend, timeout_s = known
        seq = _counts[group_name] = _counts.get(group_name, 0) + 1
        now = time.time()
        self.me = threading.get_ident()
        self.outer = _waiting.get(self.me)  # nested: the enclosing collective comes back after
        _waiting[self.me] = Waiting(self.name, self.what, group_name, ranks, backend, seq, now, timeout_s)
        _last_progress[0] = now

    def __exit__(self, *exc) -> None:
        if self.me is not None:
            if self.outer is None:
                _waiting.pop(self.me, None)
            else:
                _waiting[self.me] = self.outer
            _last_progress[0] = time.time()


def _stacks() -> list[dict[str, Any]]:
    """Every thread's Python stack, innermost frame last, the main thread first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    out = []
    for ident, frame in sys._current_frames().items():
        frames = [{"file": f.filename, "line": f.lineno, "function": f.name}
                  for f in traceback.extract_stack(frame)]
        out.append({"thread": names.get(ident, str(ident)), "main": ident == main, "frames": frames})
    out.sort(key=lambda t: not t["main"])
    return out


def snapshot(rank: int, reason: str) -> dict[str, Any]:
    """What ``hang/rank{R}.json`` holds."""
    now = time.time()
    names = {t.ident: t.name for t in threading.enumerate()}
    waiting = [{**w._asdict(), "group": list(w.group), "thread": names.get(ident, str(ident)),
                "waited_s": round(now - w.since, 1)} for ident, w in list(_waiting.items())]
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return {"rank": rank, "world_size": world, "host": socket.gethostname(), "pid": os.getpid(),
            "time": now, "reason": reason, "waiting": waiting,
            "begun": [{"group_name": g, "count": n} for g, n in list(_counts.items())],
            "silent_s": round(now - _last_progress[0], 1),
            "threads": _stacks()}


def _nccl_trace() -> bytes | None:
    """The NCCL flight recorder's buffer (torch ≥ 2.5 with TORCH_NCCL_TRACE_BUFFER_SIZE set), or
    None. (torch's own name; it dumps the same on a timeout with TORCH_NCCL_DUMP_ON_TIMEOUT.)"""
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    try:
        return dump() if dump is not None else None
    except Exception:  # noqa: BLE001 - no recorder (not built with NCCL, buffer size 0)
        return None


def write_dump(folder: Path, rank: int, reason: str, nccl: bool = False) -> Path:
    """Write this rank's ``rank{R}.json`` (and its NCCL trace) under ``folder``; returns the json."""
    folder.mkdir(parents=True, exist_ok=True)
    if nccl and (trace := _nccl_trace()) is not None:  # named as torch's own dumps (fr_trace reads both)
        (folder / f"nccl_trace_rank_{rank}").write_bytes(trace)
    path = folder / f"rank{rank}.json"
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(snapshot(rank, reason), indent=1))
    os.replace(partial, path)  # a reader never sees half a file
    return path


def set_aside(folder: Path) -> None:
    """Move an earlier run's dumps out of the way (``hang-<time>`` beside ``folder``), so that a
    report reads this run's only."""
    if folder.is_dir() and any(folder.iterdir()):
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(folder.stat().st_mtime))
        os.replace(folder, folder.with_name(f"{folder.name}-{stamp}"))


def nccl_recorder_environment(folder: Path) -> dict[str, str]:
    """The flight recorder's settings (read when an NCCL group is made): a buffer of recent
    collectives, dumped on a timeout to ``folder/nccl_trace_rank_{R}`` (older torch reads the
    TORCH_NCCL_ names, newer the TORCH_FR_ ones). A value already set is kept."""
    prefix = str(folder / "nccl_trace_rank_")
    wanted = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_FR_BUFFER_SIZE": "2000",
              "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
              "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix, "TORCH_FR_DUMP_TEMP_FILE": prefix}
    return {k: v for k, v in wanted.items() if k not in os.environ}


class HangWatch:
    """The watcher thread of one rank (see the module's docstring). ``after``: the fraction of a
    collective's group timeout after which a wait counts as stuck; ``exchange(flags)``: the
    element-wise maximum of the flags over every rank's watcher, raising
    ``collectives.CollectiveError`` on failure (``collectives.watch_exchange`` on the watchers'
    own gloo group)."""

    def __init__(self, folder: Path, rank: int, exchange: Callable[[list[int]], list[int]], after: float,
                 nccl: bool = False, poll_s: float | None = None):
        self.folder, self.rank, self.exchange, self.after, self.nccl = folder, rank, exchange, after, nccl
        shortest = min((t for _, _, _, t in _groups.values()), default=600.0)
        # No progress for this long (and at least 2 minutes: model builds, loads and compiles are
        # silent for a while): stuck somewhere unnoted, such as one of DeepSpeed's collectives.
        self.silence_s = max(after * shortest, 120.0)
        self.poll_s = poll_s if poll_s is not None else min(max(after * shortest / 5, 0.5), 10.0)
        self.dumps = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="hang-watch", daemon=True)
        # What wakes the thread before its poll: stop(), and SIGUSR2.
        self._wakeup = os.pipe()
        os.set_blocking(self._wakeup[1], False)
        self._previous: tuple[Any, int] | None = None

    def start(self) -> HangWatch:
        if threading.current_thread() is threading.main_thread():
            # SIGUSR2 wakes this thread through the interpreter's wake-up descriptor: a Python
            # handler would run only when the main thread next runs Python, never while it is
            # stuck. Another user of the descriptor (an event loop) keeps it; SIGUSR2 then
            # does nothing here.
            previous_fd = signal.set_wakeup_fd(self._wakeup[1], warn_on_full_buffer=False)
            if previous_fd == -1:
                self._previous = (signal.signal(DUMP_SIGNAL, lambda *_: None), previous_fd)
            else:
                signal.set_wakeup_fd(previous_fd)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the watchers: this rank's now, the others' at their next exchange (a rank that
        stops alone waits for that exchange at most ``2 × poll_s``)."""
        self._stopping = True
        try:
            os.write(self._wakeup[1], b"\0")
        except OSError:  # the pipe is full: the thread wakes anyway
            pass
        if self._thread.is_alive():
            self._thread.join(2 * self.poll_s + 1)
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            handler, fd = self._previous
            signal.signal(DUMP_SIGNAL, handler if handler is not signal.SIG_DFL else signal.SIG_IGN)
            signal.set_wakeup_fd(fd)
            self._previous = None
        # The descriptors stay open: a signal arriving now still has somewhere to go.

    def _signalled(self) -> bool:
        """Wait up to ``poll_s`` (less when woken); whether SIGUSR2 came meanwhile."""
        ready, _, _ = select.select([self._wakeup[0]], [], [], 0 if self._stopping else self.poll_s)
        return bool(ready) and DUMP_SIGNAL in os.read(self._wakeup[0], 512)

    def _stuck(self) -> Waiting | str | None:
        """The noted collective this rank has waited in too long; else "silent" when it has not
        moved for ``silence_s`` outside any noted collective (a wait in DeepSpeed's); else None."""
        now = time.time()
        waiting = list(_waiting.values())
        found = next((w for w in waiting if now - w.since >= self.after * w.timeout_s), None)
        if found is None and not waiting and now - _last_progress[0] >= self.silence_s:
            return "silent"
        return found

    def _loop(self) -> None:
        dumped_for: object = None
        while True:
            signalled = self._signalled()
            stuck = self._stuck()
            flags = [int(stuck is not None), int(signalled), int(self._stopping)]
            try:
                stuck_any, signalled_any, stopping = self.exchange(flags)
            except RuntimeError as e:  # CollectiveError
                if "timed out" in str(e).lower():  # a rank's watcher no longer answers
                    self._dump(f"the hang watchers' exchange timed out: {e}")
                return  # a rank has exited: its collectives fail on their own
            if stopping:
                return
            episode: object = stuck_any and "elsewhere"
            if isinstance(stuck, Waiting):
                episode = (stuck.group_name, stuck.seq)
            elif stuck is not None:
                episode = stuck
            if signalled_any:
                self._dump(f"{DUMP_SIGNAL.name} received")
            elif stuck_any and episode != dumped_for:
                self._dump(f"a rank waited in a collective, or did not move, for {self.after:.0%} of "
                           "its timeout")
            dumped_for = episode if stuck_any else None

    def _dump(self, reason: str) -> None:
        try:
            path = write_dump(self.folder, self.rank, reason, self.nccl)
            self.dumps += 1
            print(f"[rank {self.rank}] hang: {reason}; where this rank is: {path}", file=sys.stderr,
                  flush=True)
        except OSError as e:  # a full or missing disk must not end the rank: it reports
            print(f"[rank {self.rank}] hang: {reason}; could not write {self.folder}: {e}",
                  file=sys.stderr, flush=True)
