"""A checkpoint's manifest (``manifest.json``), read and checked: its shape, the sections a loader
reads, each listed file's name; and the files verified against it (size and SHA-256)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from megatron_lite.checkpoint.store import FORMAT_VERSION, MANIFEST, CheckpointError, open_regular
from megatron_lite.config.schema import ModelConfig

# A manifest's sections other than ``files`` and ``step``, with the type each must have where
# present (a checkpoint written by this project has them all; a loader names the ones it needs).
SECTIONS: dict[str, type] = {
    "consumed_samples": int, "consumed_tokens": int, "topology": dict, "model": dict, "data": dict,
    "config": str, "versions": dict, "saved_at": str, "token_ids": dict, "generation_token_ids": dict}
RESUME_SECTIONS = ("consumed_samples", "topology", "model", "data")
"""What a run resuming from a checkpoint reads of its manifest."""


def read_manifest(path: Path, required: Iterable[str] = ()) -> dict:
    """The manifest of checkpoint ``path``; any problem (missing, unreadable, corrupt, of
    another format or shape, a section of the wrong type, a ``required`` section absent) is a
    ``CheckpointError`` naming the file."""
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {MANIFEST} (an incomplete checkpoint)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is corrupt: {e}") from None
    except OSError as e:  # EACCES, EIO, ...
        raise CheckpointError(f"cannot read {file}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{file}: format {found!r}, this version reads format {FORMAT_VERSION}")
    files = manifest.get("files")
    if not (_is_count(manifest.get("step")) and isinstance(files, list) and all(
            isinstance(f, dict) and isinstance(f.get("name"), str) and _is_count(f.get("bytes"))
            and isinstance(f.get("sha256"), str) and _is_fragment_index(f.get("fragments", []))
            for f in files)):
        raise CheckpointError(f"{file} is not a checkpoint manifest (no integer 'step', or 'files' "
                              "is not a list of name/bytes/sha256(/fragments) entries)")
    problem = _section_problem(manifest, required)
    if problem:
        raise CheckpointError(f"{file} is not a valid checkpoint manifest: {problem}; restore it, or "
                              "use another checkpoint")
    for entry in files:
        listed_file(path, entry)
    return manifest


def _is_fragment_index(value: Any) -> bool:
    """A file's list of fragments: [name, cuts ([dim, index, count] each), slice shape, start,
    numel] each (``shard_index.fragment_index``)."""
    return isinstance(value, list) and all(
        isinstance(e, list) and len(e) == 5 and isinstance(e[0], str)
        and isinstance(e[1], list) and all(isinstance(c, list) and len(c) == 3 and all(map(_is_count, c))
                                           for c in e[1])
        and isinstance(e[2], list) and all(map(_is_count, e[2])) and _is_count(e[3]) and _is_count(e[4])
        for e in value)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _section_problem(manifest: dict, required: Iterable[str]) -> str | None:
    """What is wrong with the sections a loader reads (None: nothing). Checked here, once, so
    that none of them reaches a loader as a traceback or as a size to allocate."""
    for key in required:
        if key not in manifest:
            return f"it has no '{key}' section"
    for key, kind in SECTIONS.items():
        value = manifest.get(key)
        # A null recipe reads as none (an export then takes nothing from it).
        if key not in manifest or (value is None and key == "config"):
            continue
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
            name = {int: "a count", dict: "a mapping", str: "a string"}[kind]
            return f"'{key}' is {_short(value)}, not {name}"
    model = manifest.get("model", {})
    for key, value in model.items():
        problem = _model_field_problem(key, value)
        if problem:
            return f"model.{key}={_short(value)}: {problem}"
    length = manifest.get("data", {}).get("seq_length")
    if length is not None and not (_is_count(length) and length > 0):
        return f"data.seq_length={_short(length)} is not a positive integer"
    for key in ("token_ids", "generation_token_ids"):
        for name, value in manifest.get(key, {}).items():
            if not (value is None or _is_count(value)
                    or (isinstance(value, list) and all(_is_count(v) for v in value))):
                return f"{key}.{name}={_short(value)} is not a token id, a list of them or null"
    return None


def _model_field_problem(key: str, value: Any) -> str | None:
    """What is wrong with a model field's recorded value, by ``ModelConfig``'s type for it (fields
    it does not have are not read from a manifest)."""
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    if key not in fields:
        return None
    spec = fields[key]
    kind = str(spec.type)
    if value is None:
        # A recorded vocabulary is always resolved: null would leave export nothing to size by.
        return None if kind.startswith("Optional[") and key != "vocab_size" else "may not be null"
    choices = spec.metadata.get("choices")
    if choices is not None:
        return None if value in choices else f"is not one of {list(choices)}"
    if "bool" in kind:
        return None if isinstance(value, bool) else "is not true or false"
    if "int" in kind:
        return None if _is_count(value) and value > 0 else "is not a positive integer"
    if "float" in kind:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return None if ok and value >= 0 else "is not a non-negative number"
    return None


def listed_file(path: Path, entry: dict) -> Path:
    """The file a manifest entry names in checkpoint ``path``. Only a plain name is a file of
    the checkpoint: a path (``../x``, ``/etc/passwd``, ``a/b``) would have verify and load read
    whatever a planted or corrupt manifest points at, outside the checkpoint."""
    name = entry["name"]
    separators = {"/", "\\", os.sep, os.altsep} - {None}
    if name in ("", ".", "..") or "\0" in name or any(s in name for s in separators):
        raise CheckpointError(f"{path / MANIFEST}: file entry {name!r} is not a plain file name in "
                              f"{path} (a path, which is never read); restore the manifest or "
                              "resume from another checkpoint")
    return path / name


def verify(path: Path, manifest: dict, entries: list[dict] | None = None) -> None:
    """Every file listed (or just ``entries``, a share of the manifest's files) is a regular file
    of the checkpoint with its size and SHA-256; the first problem is raised by name. An entry
    that is a path refuses the whole manifest before any file is read (every rank's share
    alike)."""
    for entry in manifest["files"]:
        listed_file(path, entry)
    for entry in manifest["files"] if entries is None else entries:
        file = listed_file(path, entry)
        fd = open_regular(file)
        try:
            with os.fdopen(fd, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != entry["bytes"]:
                    raise CheckpointError(f"{file} is {size} bytes, the manifest says {entry['bytes']} "
                                          "(truncated or overwritten)")
                digest = hashlib.sha256()
                for block in iter(lambda: f.read(1 << 24), b""):
                    digest.update(block)
        except OSError as e:  # EACCES, EIO, ...
            raise CheckpointError(f"cannot read {file}: {e}") from None
        if digest.hexdigest() != entry["sha256"]:
            raise CheckpointError(f"{file} does not match its SHA-256 in the manifest (corrupt)")
