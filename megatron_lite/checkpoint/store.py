"""Checkpoint directories on disk: atomic commit, manifest with checksums, the ``latest`` pointer.

Layout of ``checkpoint.dir``::

    latest                 one line: the name of the newest committed checkpoint
    step_00001000/         a committed checkpoint
        manifest.json      written last: step, data position, config, topology, files + SHA-256
        rank_00000.pt ...  one file per rank (its fragments, RNG states; rank 0: trainer state)
    .tmp-step_00002000/    a save in progress (never loaded; removed when found at start)
    .lock                  held (flock) by the run using the directory; names its host and pid
    rollbacks.json         the run's spike rollbacks: data windows skipped, rollbacks used

A checkpoint is committed by renaming its temporary directory after every rank has written and
the manifest is on disk; ``latest`` is replaced by write-temp-then-rename afterwards. A crash at
any moment leaves the previous checkpoint and ``latest`` valid.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import socket
import stat
import time
from pathlib import Path
from typing import IO

import torch

MANIFEST = "manifest.json"
LATEST = "latest"
LOCK = ".lock"
ROLLBACKS = "rollbacks.json"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or is not valid to load."""


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary name, flushed to disk before the rename."""
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def serialize(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _numpy_array_globals() -> list:
    """What unpickling a numpy array needs (checkpoints of earlier versions hold numpy's RNG
    state as one): its reconstruction function and types, no arbitrary callable."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core  # numpy 2, numpy 1
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_rank_file(file: Path):
    """A rank's file, read with torch's weights-only unpickler: tensors, containers, numbers and
    strings only, so a file planted in a shared checkpoint directory cannot run code. Anything
    else, and a file that is not a regular one (a link to elsewhere), is a ``CheckpointError``
    naming the file."""
    fd = open_regular(file)
    try:
        try:
            with torch.serialization.safe_globals(_numpy_array_globals()):
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"{file} holds objects other than tensors and plain values, which "
                                  f"are not loaded (they could run code): {_unpickling_reason(e)}") from None
        # torch opens the file by name again: it must still be the one checked above.
        now, checked = os.stat(file, follow_symlinks=False), os.fstat(fd)
        if (now.st_dev, now.st_ino) != (checked.st_dev, checked.st_ino):
            raise CheckpointError(f"{file} was replaced while it was read; restore the checkpoint")
    finally:
        os.close(fd)
    return state


def open_regular(file: Path) -> int:
    """A read-only descriptor of ``file``, which must be a regular file itself: a symbolic link
    (or a device, a FIFO, a directory) in a checkpoint would have verify and load read whatever
    it points at, outside the checkpoint. Refused by name (``CheckpointError``); the check is
    made on the open descriptor, so the name cannot be swapped for a link in between."""
    try:
        # O_NONBLOCK: opening a planted FIFO must not wait for a writer.
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing") from None
    except OSError as e:
        if os.path.islink(file):  # O_NOFOLLOW's ELOOP
            raise CheckpointError(f"{file} is a symbolic link (to {os.readlink(file)}), not a file of "
                                  "the checkpoint; a checkpoint's files are read only when they are "
                                  "regular files inside it: put the file itself there, or use another "
                                  "checkpoint") from None
        raise CheckpointError(f"cannot read {file}: {e}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CheckpointError(f"{file} is not a regular file (mode {stat.filemode(mode)}); a "
                              "checkpoint's files are read only when they are regular files inside "
                              "it: restore it, or use another checkpoint")
    return fd


def _unpickling_reason(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), lines[-1] if lines
                else type(error).__name__)


def write_rank_file(directory: Path, rank: int, obj) -> dict:
    """Write one rank's state; returns its manifest entry (name, bytes, sha256)."""
    return write_rank_bytes(directory, rank, serialize(obj))


def write_rank_bytes(directory: Path, rank: int, data: bytes) -> dict:
    name = rank_file(rank)
    write_bytes_durably(directory / name, data)
    return {"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def commit(root: Path, tmp: Path, manifest: dict) -> Path:
    """Rank 0, after every rank wrote its file: manifest, rename into place, then ``latest``."""
    write_bytes_durably(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
    fsync_dir(tmp)
    final = root / step_name(manifest["step"])
    if final.exists():
        # The same step saved again (e.g. after a resume): swap, then drop the old one.
        old = root / f".old-{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    write_bytes_durably(root / LATEST, (final.name + "\n").encode())
    fsync_dir(root)
    return final


STEP_NAME = re.compile(r"step_\d{8}")


def step_of(path: Path) -> int:
    """The step a checkpoint directory's name says (``step_00001000`` -> 1000)."""
    return int(path.name[len("step_"):])


def committed_steps(root: Path) -> list[Path]:
    """Committed-looking checkpoint directories, newest first. Only names this module writes
    count: a copy someone made beside them (``step_00001000.bak``, ``step_00001000-old``) is
    neither loaded nor removed by retention."""
    return sorted((p for p in root.glob("step_*") if STEP_NAME.fullmatch(p.name) and p.is_dir()),
                  key=lambda p: p.name, reverse=True)


def read_latest(root: Path) -> Path | None:
    """The directory ``latest`` names, None when there is no ``latest``; a garbage pointer is an
    error (never a silent start from step 0)."""
    pointer = root / LATEST
    if not pointer.exists():
        return None
    try:
        name = pointer.read_text().strip()
    except UnicodeDecodeError:
        name = ""
    if not STEP_NAME.fullmatch(name) or not (root / name).is_dir():
        raise CheckpointError(f"{pointer} does not name a checkpoint directory in {root} "
                              f"(it reads {name[:60]!r})")
    return root / name


_HELD: set[int] = set()
"""Descriptors of the directory locks this process holds."""


def _drop_locks_in_child() -> None:
    # The child's copy must not keep the lock's open file alive; /dev/null keeps the descriptor
    # number valid for the file object the child inherited (closing it is harmless).
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in _HELD:
            os.dup2(null, fd)
    finally:
        os.close(null)


os.register_at_fork(after_in_child=_drop_locks_in_child)


class _HeldLock:
    """The open lock file, registered in ``_HELD`` until closed."""

    def __init__(self, file: IO):
        self.file, self.fd = file, file.fileno()
        _HELD.add(self.fd)

    def __getattr__(self, name: str):
        return getattr(self.file, name)

    def close(self) -> None:
        _HELD.discard(self.fd)
        self.file.close()

    def __del__(self) -> None:
        if not self.file.closed:
            self.close()


def claim(root: Path, fresh: bool) -> tuple[IO | None, str | None]:
    """Rank 0, before anything in ``root`` is read or removed: take the directory for this run.

    An exclusive ``flock`` on ``root/.lock``, held while the returned file is open (the kernel
    drops it when the process dies, so a crashed run leaves no stale lock). A ``flock`` belongs
    to the open file, which forked children (data-loader workers) would share and keep for a
    while after the run is killed, refusing its restart: in a forked child the descriptor is
    pointed at /dev/null at once (``_drop_locks_in_child``). Not a POSIX ``lockf``, which no fork
    inherits, but which a second claim in the same process would not see, and which closing
    any other descriptor of the file would drop. A second run on the same directory (a requeued
    job beside a live one) is refused before it can delete the live run's
    save in progress. ``fresh`` (``checkpoint.resume=false``) also refuses a directory that
    holds committed checkpoints: the new run's saves, retention and ``latest`` would mix with
    another run's. Returns the open lock file (keep it open) and a warning when the filesystem
    cannot lock (then nothing guards against a second run).
    """
    root.mkdir(parents=True, exist_ok=True)
    lock = open(root / LOCK, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "holder unknown"
        lock.close()
        raise CheckpointError(f"{root} is in use by another run ({holder}); two runs must not share "
                              "a checkpoint.dir: wait for that run to end, or give this one its own "
                              "checkpoint.dir") from None
    except OSError as e:  # e.g. Lustre mounted without -o flock, some NFS setups
        lock.close()
        lock, warning = None, (f"warning: cannot lock {root} ({e}); make sure no other run uses this "
                               "checkpoint.dir")
    else:
        lock, warning = _HeldLock(lock), None
    if fresh:
        existing = committed_steps(root)
        if existing or (root / LATEST).exists():
            if lock is not None:
                lock.close()
            newest = existing[0].name if existing else f"'{LATEST}' only"
            raise CheckpointError(
                f"{root} holds another run's checkpoints (newest: {newest}) and checkpoint.resume is "
                "false: a new run there would replace, retain-away or repoint them. Give this run its "
                "own checkpoint.dir, or set checkpoint.resume=true to continue that run")
    if lock is not None:
        lock.seek(0)
        lock.truncate()
        lock.write(f"host {socket.gethostname()}, pid {os.getpid()}, since "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        lock.flush()
    return lock, warning


def remove_stale(root: Path) -> list[Path]:
    """Remove saves that never committed (``.tmp-*``) and replaced copies (``.old-*``); a copy
    whose replacement never arrived is put back. Returns what was removed."""
    stale = list(root.glob(".tmp-*"))
    for old in root.glob(".old-*"):
        original = root / old.name[len(".old-"):]
        if original.exists():
            stale.append(old)
        else:
            os.replace(old, original)
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def abandon_after(root: Path, keep: Path, reason: str) -> list[Path]:
    """Rank 0: point ``latest`` at ``keep``, then move every committed checkpoint newer than
    ``keep`` into ``root/abandoned/`` (suffixed with ``reason``; ``.2``, ``.3``, ... after that
    when the name is taken, so an earlier copy is never replaced). Returns the new paths.

    In this order a crash at any moment leaves ``latest`` naming a directory that exists (first
    the old newest, then ``keep``); the other order had a window where it named a moved one."""
    newer = [p for p in committed_steps(root) if p.name > keep.name]
    try:
        if not newer and read_latest(root) == keep:
            return []  # nothing to do: no write
    except CheckpointError:
        pass  # a garbage pointer: rewritten below
    write_bytes_durably(root / LATEST, (keep.name + "\n").encode())
    fsync_dir(root)
    moved = []
    aside = root / "abandoned"
    for path in newer:
        aside.mkdir(exist_ok=True)
        target = unused_name(aside / f"{path.name}-{reason}")
        os.replace(path, target)
        moved.append(target)
    fsync_dir(root)
    return moved


def unused_name(path: Path) -> Path:
    """``path``, or ``path.2``, ``path.3``, ... whichever does not exist yet. Rank 0 holds the
    directory's lock (``claim``), so nothing else takes the name before it is used."""
    k, candidate = 1, path
    while candidate.exists() or candidate.is_symlink():
        k += 1
        candidate = path.with_name(f"{path.name}.{k}")
    return candidate


def read_rollbacks(root: Path) -> list[dict]:
    """The rollback history kept with the checkpoints ([] when there is none)."""
    file = root / ROLLBACKS
    if not file.exists():
        return []
    try:
        records = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        records, problem = None, f"{type(e).__name__}: {e}"
    else:
        problem = "not a list of rollback records"
    if not (isinstance(records, list) and all(
            isinstance(r, dict) and isinstance(r.get("rollbacks"), int)
            and isinstance(r.get("skip_samples"), list) and len(r["skip_samples"]) == 2
            and all(isinstance(x, int) for x in r["skip_samples"]) for r in records)):
        raise CheckpointError(f"{file} cannot be read ({problem}); it holds the run's rollback history "
                              "(data windows to skip, rollbacks used): restore it, or move it aside to "
                              "resume without that history")
    return records


def append_rollback(root: Path, record: dict) -> None:
    """Add one rollback to the history, durably (write-temp-then-rename: never a torn file)."""
    records = read_rollbacks(root) + [record]
    write_bytes_durably(root / ROLLBACKS, json.dumps(records, indent=1).encode())
    fsync_dir(root)


def set_aside_rollbacks(root: Path) -> Path | None:
    """A fresh start in a directory with an old history: keep it under a new name, unused."""
    file = root / ROLLBACKS
    if not file.exists():
        return None
    k = 1
    while (old := root / f"rollbacks.{k}.json").exists():
        k += 1
    os.replace(file, old)
    return old


def retained(steps: list[int], keep_last: int, keep_every: int, protect: set[int]) -> set[int]:
    """Which steps to keep: the newest ``keep_last`` (0: all), every ``keep_every``-th step, and
    ``protect`` (the one ``latest`` names)."""
    keep = set(protect)
    ordered = sorted(steps, reverse=True)
    keep.update(ordered if keep_last <= 0 else ordered[:keep_last])
    if keep_every > 0:
        keep.update(s for s in steps if s % keep_every == 0)
    return keep
