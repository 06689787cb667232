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
import hashlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_lite.data.indexed import IndexedDataset, merge


@dataclass(frozen=True)
class Piece:
    """Bytes ``start`` to ``end`` of an uncompressed jsonl file: the lines that begin there."""

    path: Path
    start: int
    end: int


def splittable(path: Path) -> bool:
    return path.name.endswith((".jsonl", ".json"))


def rank_inputs(paths: Sequence[Path], rank: int, world: int) -> list[Path | Piece]:
    """This rank's contiguous share of ``paths`` (whole files as paths, parts of files as pieces)."""
    sizes = [p.stat().st_size for p in paths]
    total = sum(sizes)
    lo, hi = total * rank // world, total * (rank + 1) // world
    last = rank == world - 1
    mine: list[Path | Piece] = []
    begin = 0
    for path, size in zip(paths, sizes, strict=True):
        end = begin + size
        if splittable(path) and size > 0:
            s, e = max(begin, lo), min(end, hi)
            if s < e:
                mine.append(path if (s, e) == (begin, end) else Piece(path, s - begin, e - begin))
        elif lo <= begin < hi or (last and begin == total):
            mine.append(path)
        begin = end
    return mine


def piece_blocks(piece: Piece, block_bytes: int,
                 progress: Callable[[int], None]) -> Iterator[tuple[bytes, int]]:
    """(block of whole lines, number of its first line counted from the piece's start)."""
    with open(piece.path, "rb") as f:
        pos = piece.start
        if pos > 0:
            f.seek(pos - 1)
            if f.read(1) != b"\n":  # the line under way belongs to the previous rank
                pos += len(f.readline())
        f.seek(pos)
        line = 1
        reported = piece.start
        while pos < piece.end:
            block = f.read(min(block_bytes, piece.end - pos))
            if not block:
                break
            if not block.endswith(b"\n"):
                block += f.readline()  # the last line begun before the end is ours, whole
            pos += len(block)
            yield block, line
            line += block.count(b"\n")
            progress(pos - reported)
            reported = pos


# ---------------------------------------------------------------- what a part was made from

FORMAT_VERSION = 2
"""Changes whenever the same inputs and options would give other part bytes (the encoding, the
separator rules, the part layout): a part of another version is never merged."""

# Files in a tokenizer directory that do not change how it encodes: a model's weights, often
# beside its tokenizer (gigabytes to hash for nothing).
NOT_TOKENIZER = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt")


class RanksError(ValueError):
    """The parts cannot become one dataset as they are (one line: what and what to run)."""


class PartsPending(RanksError):
    """This rank's part is committed, but the dataset is not written yet (other parts missing)."""


def _sha256_file(path: Path, h) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)


def tokenizer_fingerprint(kind: str, model: str) -> dict:
    """The tokenizer as it encodes: its type and a SHA-256 of its file, or of every file of its
    directory (names and contents; weights skipped). A Hub id is taken by its name alone (its
    files are not read here): ranks that should be checked give one local copy."""
    path = Path(model)
    h = hashlib.sha256()
    if path.is_file():
        _sha256_file(path, h)
        return {"type": kind, "sha256": h.hexdigest()}
    if path.is_dir():
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            rel = f.relative_to(path)
            if rel.parts[0].startswith(".") or f.name.endswith(NOT_TOKENIZER):
                continue
            h.update(str(rel).encode() + b"\0")
            _sha256_file(f, h)
            h.update(b"\0")
        return {"type": kind, "sha256": h.hexdigest()}
    return {"type": kind, "hub": model}


def signature_fields(paths: Sequence[Path], world: int, keys: Sequence[str], tokenizer: dict,
                     append_eod: bool, text_split: str, separators: str) -> dict:
    """Everything a part's bytes depend on."""
    return {"format": FORMAT_VERSION, "world": world,
            "inputs": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in paths],
            "json keys": list(keys), "tokenizer": tokenizer, "append-eod": append_eod,
            "text split": text_split, "separators": separators}


def signature(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def differences(ours: dict, theirs: dict | None) -> str:
    """The fields that differ, as a user names them ("tokenizer contents", "inputs")."""
    if not isinstance(theirs, dict) or theirs.get("format") != ours["format"]:
        return "an older preprocessing format"
    names = []
    for name in ours:
        if ours[name] != theirs.get(name):
            if name == "tokenizer" and isinstance(theirs.get(name), dict) \
                    and theirs[name].get("type") == ours[name]["type"]:
                name = "tokenizer contents"
            elif name == "inputs":
                name = "inputs (names, sizes or modification times)"
            names.append(name)
    return ", ".join(names) or "the signature"


# ---------------------------------------------------------------- parts and their markers

def part_prefix(output_prefix: str, key: str, rank: int, world: int) -> str:
    return f"{output_prefix}_{key}_document.part-{rank:05d}-of-{world:05d}"


def marker(output_prefix: str, rank: int, world: int) -> Path:
    return Path(f"{output_prefix}.part-{rank:05d}-of-{world:05d}.done.json")


def read_marker(output_prefix: str, rank: int, world: int) -> dict | None:
    try:
        data = json.loads(marker(output_prefix, rank, world).read_text())
    except (OSError, ValueError):
        return None  # absent, or being replaced (commit_part renames a whole file into place)
    return data if isinstance(data, dict) else None


def commit_part(output_prefix: str, rank: int, world: int, sig: str, fields: dict, summary: dict) -> None:
    """Written after the part's datasets are in place: the part is complete."""
    path = marker(output_prefix, rank, world)
    tmp = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"signature": sig, "fields": fields, "summary": summary}))
    os.replace(tmp, path)


def committed_part(output_prefix: str, keys: Sequence[str], rank: int, world: int, sig: str) -> dict | None:
    """The summary of this rank's part when an earlier attempt committed it with this signature
    and its files still hold what the summary says (the same bytes: reused), else None."""
    data = read_marker(output_prefix, rank, world)
    if data is None or data.get("signature") != sig:
        return None
    return data["summary"] if verified([part_prefix(output_prefix, k, rank, world) for k in keys],
                                       keys, [data["summary"]]) else None


def forget_part(output_prefix: str, rank: int, world: int) -> None:
    """Uncommit this rank's part before rewriting it: a marker left with other inputs or options
    must not stand for the part being written."""
    marker(output_prefix, rank, world).unlink(missing_ok=True)


def forget_failure(output_prefix: str, rank: int, world: int) -> None:
    """At a rank's start: the failure an earlier attempt recorded is not this attempt's."""
    failure(output_prefix, rank, world).unlink(missing_ok=True)


def failure(output_prefix: str, rank: int, world: int) -> Path:
    return Path(f"{output_prefix}.part-{rank:05d}-of-{world:05d}.failed.json")


def record_failure(output_prefix: str, rank: int, world: int, sig: str, reason: str) -> None:
    """Tell the other ranks, waiting for this one, why it stopped (best effort: the failure being
    recorded may be the filesystem's)."""
    path = failure(output_prefix, rank, world)
    tmp = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps({"signature": sig, "reason": reason}))
        os.replace(tmp, path)


def _failures(output_prefix: str, world: int, sig: str, since: float) -> list[tuple[int, str]]:
    """(rank, reason) of the ranks that failed with this signature after ``since`` (an earlier
    attempt's record is not this one's: the rank's next start removes it)."""
    out = []
    for rank in range(world):
        path = failure(output_prefix, rank, world)
        try:
            data = json.loads(path.read_text())
            recent = path.stat().st_mtime >= since - CLOCK_SKEW_S
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("signature") == sig and recent:
            out.append((rank, str(data.get("reason", "no reason recorded"))))
    return out


# ---------------------------------------------------------------- the merge lock

HEARTBEAT_S = 5.0
LOCK_STALE_S = 60.0
"""A merge lock whose file has not been refreshed for this long (by this rank's own clock: no
comparison with another host's) belongs to a merger that is gone."""
POLL_S = 1.0
CLOCK_SKEW_S = 5.0
"""Between this host's clock and the shared filesystem's (file times come from its server)."""


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

def verified(prefixes: Sequence[str], keys: Sequence[str], parts: list[dict] | None) -> bool:
    """Each key's dataset (``prefixes``, in the order of ``keys``) opens and is consistent; with
    the parts' summaries known, it holds exactly their documents and tokens."""
    for prefix, key in zip(prefixes, keys, strict=True):
        try:
            ds = IndexedDataset(prefix)
        except (OSError, ValueError):
            return False
        if parts is not None and (ds.n_documents != sum(p["documents"] for p in parts)
                                  or ds.n_tokens != sum(p["tokens"][key] for p in parts)):
            return False
    return True


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
                        f"rerun rank {r} with the same inputs and options (--rank {r} --world-size {world})")
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
