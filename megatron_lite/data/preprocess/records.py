"""Raw records and what is wrong with them: a record read from the input, its texts by key,
and the bad-input policy (``POLICIES``: what is skipped, repaired or kept, and counted)."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

BATCH_BYTES = 1 << 20
LONG_DOC_BYTES = 10 << 20
POLICIES = {
    "malformed JSON": "skipped",
    "missing key": "skipped",
    "non-string value": "skipped",
    "empty or whitespace-only document": "skipped",
    "invalid UTF-8": "repaired (invalid bytes replaced by U+FFFD)",
    "lone surrogate": "repaired (a JSON \\ud800-\\udfff escape without its pair replaced by U+FFFD)",
    "byte-order mark": "repaired (removed)",
    "CRLF line endings": "repaired (converted to LF)",
    "long document": f"kept whole (over {LONG_DOC_BYTES >> 20} MB)",
    "doubled separator": "repaired (separator tokens in the text next to the added one dropped)",
    "special-token text (parsed)": "parsed as the special token, as Megatron-LM's "
                                   "SentencePieceTokenizer does",
    "special-token text": "kept as text (a written </s> or <|endoftext|> is encoded as its characters, "
                          "never as the token: no document boundary inside a document)",
}
TEXT_SPLITS = ("file", "blank-line")
MAX_KEYS_SEEN = 50
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class PreprocessError(ValueError):
    """Bad input under ``strict``, or unusable arguments."""


@dataclass
class Summary:
    documents: int = 0
    tokens: dict[str, int] = field(default_factory=dict)
    input_bytes: int = 0
    seconds: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    first_locations: dict[str, list[str]] = field(default_factory=dict)
    separator_policy: str = ""
    keys_seen: list[str] = field(default_factory=list)
    """Keys of records skipped for a missing key (a typo in --json-keys shows here)."""

    def add(self, problem: str, where: str) -> None:
        self.counts[problem] = self.counts.get(problem, 0) + 1
        locs = self.first_locations.setdefault(problem, [])
        if len(locs) < 3:
            locs.append(where)


@dataclass
class Record:
    """Raw input: a block of whole jsonl lines (split into records by the worker), a jsonl line,
    a text block or file, or parquet values."""

    where: str
    kind: str  # "jsonl-block", "json", "text" or "values"
    raw: bytes | dict | None
    line: int = 0  # first line number of a jsonl block


def _decode(raw: bytes, where: str, problems: list[tuple[str, str]]) -> str:
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
        problems.append(("byte-order mark", where))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        problems.append(("invalid UTF-8", where))
    return text


def parse_record(rec: Record, keys: Sequence[str], problems: list[tuple[str, str]],
                 keys_seen: set[str] | None = None) -> dict[str, str] | None:
    """The record's texts by key, or None (with the reason in ``problems``) when it is skipped;
    the keys of a record skipped for a missing key go to ``keys_seen``."""
    if rec.kind == "values":
        obj = rec.raw
    elif rec.kind == "json":
        assert isinstance(rec.raw, bytes)
        line = _decode(rec.raw, rec.where, problems)
        if line.endswith("\r"):
            problems.append(("CRLF line endings", rec.where))
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            problems.append(("malformed JSON", rec.where))
            return None
        if not isinstance(obj, dict):
            problems.append(("malformed JSON", rec.where))
            return None
    else:
        assert isinstance(rec.raw, bytes)
        text = _decode(rec.raw, rec.where, problems)
        if "\r\n" in text:
            text = text.replace("\r\n", "\n")
            problems.append(("CRLF line endings", rec.where))
        obj = {k: text for k in keys}
    assert isinstance(obj, dict)
    missing = [k for k in keys if k not in obj or obj[k] is None]
    if missing:
        problems.append(("missing key", rec.where))
        if keys_seen is not None and len(keys_seen) < MAX_KEYS_SEEN:
            keys_seen.update(str(k) for k in itertools.islice(obj, MAX_KEYS_SEEN))
        return None
    if not all(isinstance(obj[k], str) for k in keys):
        problems.append(("non-string value", rec.where))
        return None
    if any(not obj[k].strip() for k in keys):
        problems.append(("empty or whitespace-only document", rec.where))
        return None
    if any(not obj[k].isascii() and LONE_SURROGATE.search(obj[k]) for k in keys):
        # Valid pairs were joined by the JSON decoder; a lone half cannot be encoded as UTF-8
        # (every tokenizer would raise on it).
        obj = {**obj, **{k: LONE_SURROGATE.sub("\ufffd", obj[k]) for k in keys}}
        problems.append(("lone surrogate", rec.where))
    if any(len(obj[k]) > LONG_DOC_BYTES for k in keys):
        problems.append(("long document", rec.where))
    return {k: obj[k] for k in keys}
