"""Preprocessing on many ranks (nodes): each rank tokenizes a contiguous part of the input and
writes it as a dataset of its own; the last rank to finish concatenates the parts, in rank
order, into the dataset one process would have written, byte for byte.

The input files are laid end to end and cut into ``world`` equal byte ranges. An uncompressed
jsonl file is split inside: a line belongs to the rank whose range holds its first byte. Other
files (compressed, parquet, plain text) are whole units, given to the rank whose range holds
their first byte. Ranks need no network between them, only the output's (shared) filesystem:
each rank's part is committed by a marker file that carries a signature of everything the part's
bytes depend on (inputs, tokenizer contents, options, format version), and the rank that sees
every part's marker with its signature and wins the merge lock writes the result. Every rank
returns only once the merged dataset is in place and verified (or raises): a run that ends well
has a dataset. A part with another signature is never merged.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from megatron_lite.data.indexed import merge
from megatron_lite.data.preprocess.parts import (
    PartsPending,
    RanksError,
    _failures,
    differences,
    failure,
    marker,
    part_prefix,
    read_marker,
    verified,
)

HEARTBEAT_S = 5.0
LOCK_STALE_S = 60.0
"""A merge lock whose file has not been refreshed for this long (by this rank's own clock: no
comparison with another host's) belongs to a merger that is gone."""
POLL_S = 1.0


def _pid_alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class MergeLock:
    """``PREFIX.merging``: created exclusively, holding who merges (host, pid, start time) and
    refreshed every ``HEARTBEAT_S`` while the merge runs. A lock whose holder is gone — a dead
    process on this host, or no refresh for ``LOCK_STALE_S`` — is taken over."""

    def __init__(self, output_prefix: str):
        self.path = Path(f"{output_prefix}.merging")
        self._seen: tuple[int, int] | None = None  # (inode, mtime) of a lock held by another
        self._seen_since = 0.0
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}, f)
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True)
        self._beat.start()
        return True

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        self.path.unlink(missing_ok=True)

    def holder(self) -> str:
        try:
            data = json.loads(self.path.read_text())
            return f"pid {data['pid']} on {data['host']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "an unknown process"

    def gone(self) -> str | None:
        """Why the lock's holder is gone, or None while it may still be merging."""
        try:
            st = self.path.stat()
            data = json.loads(self.path.read_text() or "{}")
        except FileNotFoundError:
            return "released"
        except (OSError, ValueError):
            data = {}
        if not isinstance(data, dict):
            data = {}
        if data.get("host") == socket.gethostname() and not _pid_alive(data.get("pid")):
            return f"its holder, pid {data.get('pid')} on this host, is gone"
        state = (st.st_ino, st.st_mtime_ns)
        now = time.monotonic()
        if state != self._seen:
            self._seen, self._seen_since = state, now
        elif now - self._seen_since >= LOCK_STALE_S:
            return f"its holder ({self.holder()}) has not refreshed it for {now - self._seen_since:.0f} s"
        return None

    def take_over(self) -> bool:
        """Move a lock judged stale aside (one rank wins the rename) and acquire a fresh one."""
        aside = self.path.with_name(f"{self.path.name}.stale.{socket.gethostname()}.{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            pass  # another rank moved it first
        else:
            aside.unlink(missing_ok=True)
        self._seen = None
        return self.acquire()


# ---------------------------------------------------------------- merging, waiting, verifying

def _merge(output_prefix: str, keys: Sequence[str], world: int) -> None:
    # Staged under a name of this process's own, then renamed into place: two mergers (one
    # taking over a lock it wrongly judged stale) write the same bytes, never the same file.
    stage = f"{socket.gethostname()}.{os.getpid()}"
    for key in keys:
        parts = [part_prefix(output_prefix, key, r, world) for r in range(world)]
        staged = f"{output_prefix}_{key}_document.merge-{stage}"
        try:
            merge(parts, staged)
        except BaseException:
            for suffix in (".bin", ".idx"):
                Path(staged + suffix).unlink(missing_ok=True)
            raise
        for suffix in (".bin", ".idx"):  # .bin first: a .idx in place describes a complete .bin
            os.replace(staged + suffix, f"{output_prefix}_{key}_document{suffix}")


def finish(output_prefix: str, keys: Sequence[str], rank: int, world: int, sig: str, fields: dict,
           wait: float, check: Callable[[list[dict]], None], log: Callable[[str], None],
           started: float) -> tuple[list[dict] | None, bool]:
    """After this rank committed its part: wait, at most ``wait`` seconds, until the merged
    dataset exists and verifies, merging it here when every part is committed and no live rank
    holds the merge lock. Returns (the parts' summaries when known, whether this rank merged).
    ``check`` sees the summaries before a merge and raises to refuse it.

    Raises ``PartsPending`` when parts are still missing at the deadline and ``RanksError`` when
    a part was written from other inputs or options (naming the fields), another rank of this
    run failed (``record_failure`` after ``started``: its reason), a merger holds the lock past
    the deadline, or the dataset does not verify."""
    deadline = time.monotonic() + wait
    lock = MergeLock(output_prefix)
    directory = Path(output_prefix).parent
    known: list[dict] | None = None
    merged = [f"{output_prefix}_{key}_document" for key in keys]
    while True:
        # Listing the directory revalidates a network filesystem's cached view of it (NFS caches
        # "no such file" for a while after another host created one).
        with contextlib.suppress(OSError):
            os.listdir(directory)
        failed = [(r, why) for r, why in _failures(output_prefix, world, sig, started) if r != rank]
        if failed:
            r, why = failed[0]
            raise RanksError(f"rank {r} of {world} failed: {why}")
        markers = [read_marker(output_prefix, r, world) for r in range(world)]
        own = markers[rank]
        late = time.monotonic() >= deadline
        if own is None:  # a merger consumed the parts: the dataset is in place
            if verified(merged, keys, known):
                return known, False
            if late:
                raise RanksError(
                    f"the parts of {output_prefix} were merged and removed, but "
                    f"{output_prefix}_{keys[0]}_document.bin/.idx does not verify after {wait:.0f} s: "
                    f"rerun every rank to rebuild it")
        elif own.get("signature") != sig:
            raise RanksError(f"part {rank} of {world} was rewritten by another run with other "
                             f"{differences(fields, own.get('fields'))}: rerun this rank")
        else:
            missing = [r for r, m in enumerate(markers) if m is None]
            other = {r: m for r, m in enumerate(markers) if m is not None and m.get("signature") != sig}
            if not missing and not other:
                known = [m["summary"] for m in markers]
                if _try_merge(lock, output_prefix, keys, world, known, check, log):
                    try:
                        if not verified(merged, keys, known):
                            raise RanksError(f"the merged {output_prefix}_*_document does not hold the "
                                             "parts' documents and tokens: rerun every rank")
                        _remove_parts(output_prefix, keys, world)
                    finally:
                        lock.release()
                    return known, True
                if late:
                    raise RanksError(
                        f"{lock.path} is held by {lock.holder()}, still merging after {wait:.0f} s; "
                        f"if no rank is merging, run: rm {lock.path}  and rerun one rank")
            elif late:
                if other:
                    r, m = next(iter(other.items()))
                    raise RanksError(
                        f"part {r} of {world} ({marker(output_prefix, r, world)}) was written with other "
                        f"{differences(fields, m.get('fields'))}; it is never merged with this one: "
                        f"rerun rank {r} with this rank's inputs and options (--rank {r} --world-size "
                        f"{world}), or this rank with part {r}'s")
                raise PartsPending(
                    f"rank {rank} of {world}: part committed; the dataset is written when part(s) "
                    f"{', '.join(map(str, missing))} are: run "
                    f"{'that rank' if len(missing) == 1 else 'those ranks'} (--rank "
                    f"{missing[0] if len(missing) == 1 else 'R'} --world-size {world}); "
                    f"the last to finish writes {output_prefix}_*_document")
        time.sleep(POLL_S)


def _try_merge(lock: MergeLock, output_prefix: str, keys: Sequence[str], world: int,
               parts: list[dict], check: Callable[[list[dict]], None], log: Callable[[str], None]) -> bool:
    """Merge under the lock; False when a live rank holds it or another merger got there first.
    On success the lock is still held (released after the parts are removed)."""
    if not lock.acquire():
        reason = lock.gone()
        if reason is None or not lock.take_over():  # a released lock: take_over just acquires
            return False
        if reason != "released":
            log(f"took over {lock.path}: {reason}")
    try:
        try:
            check(parts)
        except Exception:
            # Refused as a whole (no document at all): the parts can never make a dataset.
            _remove_parts(output_prefix, keys, world)
            raise
        _merge(output_prefix, keys, world)
    except FileNotFoundError:
        # Another merger (one that took over this lock) finished and removed the parts.
        lock.release()
        return False
    except BaseException:
        lock.release()
        raise
    return True


def _remove_parts(output_prefix: str, keys: Sequence[str], world: int) -> None:
    # Part files first, markers last: a marker present always stands for a complete part.
    for rank in range(world):
        for key in keys:
            for suffix in (".bin", ".idx"):
                Path(part_prefix(output_prefix, key, rank, world) + suffix).unlink(missing_ok=True)
    for rank in range(world):
        marker(output_prefix, rank, world).unlink(missing_ok=True)
        failure(output_prefix, rank, world).unlink(missing_ok=True)
