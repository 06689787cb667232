"""A rank's part on disk: what it was made from (the signature of everything its bytes depend
on), its marker once committed, and a rank's recorded failure."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
from collections.abc import Sequence
from pathlib import Path

from megatron_lite.data.indexed import IndexedDataset

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


def signature_fields(paths: Sequence[Path], world: int, output_fields: dict) -> dict:
    """Everything a part's bytes depend on: the format, the ranks, the inputs (names, sizes,
    modification times) and the options' ``output_fields`` (``PreprocessOptions``)."""
    return {"format": FORMAT_VERSION, "world": world,
            "inputs": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in paths],
            **output_fields}


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


CLOCK_SKEW_S = 5.0
"""Between this host's clock and the shared filesystem's (file times come from its server)."""


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
