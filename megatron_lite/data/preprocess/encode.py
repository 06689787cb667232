"""Encoding a batch of records, in a worker process or the main one: parse, check, tokenize,
add separators; flat numpy arrays back (cheap to pickle)."""

from __future__ import annotations

import itertools
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from megatron_lite.data.preprocess.records import Record, parse_record
from megatron_lite.data.preprocess.separators import SeparatorPolicy, one_separator, separator_policy
from megatron_lite.data.tokenizers import Tokenizer, load_tokenizer


@dataclass(frozen=True)
class Encoder:
    """What encodes a batch: the tokenizer, the separator policy, the keys, the token type and
    the special-token texts to count when written in a document."""

    tok: Tokenizer
    policy: SeparatorPolicy
    keys: tuple[str, ...]
    dtype: np.dtype
    written: re.Pattern | None

    @classmethod
    def of(cls, tok: Tokenizer, keys: tuple[str, ...], append_eod: bool, dtype: np.dtype) -> Encoder:
        specials = sorted(tok.special_texts, key=len, reverse=True)
        written = re.compile("|".join(map(re.escape, specials))) if specials else None
        return cls(tok, separator_policy(tok, append_eod), keys, np.dtype(dtype), written)


TOKENIZER_LOCK = threading.Lock()
"""Held around every tokenizer call. A process that encodes in two threads (one process, no
workers) overlaps one batch's parsing and flattening with the other's tokenizing, which runs
without the GIL; the tokenizer itself is never called from two threads at once (a Hugging Face
backend refuses that: "Already borrowed")."""

_encoder: Encoder | None = None
"""This process's encoder: a process pool's initializer sets it once per worker process (the
tokenizer is loaded there once, not sent with every batch)."""


def init_worker(kind: str, model: str, append_eod: bool, keys: tuple[str, ...], dtype: str,
                single_threaded: bool, tok: Tokenizer | None = None) -> None:
    """Set up this process's encoder (``tok``: the caller's tokenizer when it encodes itself, or
    what it handed its workers: ``HFTokenizer.fast``)."""
    global _encoder
    if single_threaded:  # one tokenizer thread per worker process: no oversubscription
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = tok if tok is not None else load_tokenizer(kind, model)
    if single_threaded and hasattr(tok, "num_threads"):
        tok.num_threads = 1
    _encoder = Encoder.of(tok, keys, append_eod, np.dtype(dtype))


def _expand(batch: list[Record]) -> Iterator[Record]:
    for rec in batch:
        if rec.kind == "jsonl-block":
            assert isinstance(rec.raw, bytes)
            for i, line in enumerate(rec.raw.split(b"\n")):
                if line.strip():
                    yield Record(f"{rec.where}:{rec.line + i}", "json", line)
        else:
            yield rec


def _first_unencodable(tok, docs: list[dict], wheres: list[str], key: str) -> str | None:
    """Where the first document the tokenizer refuses comes from (``file:line``)."""
    for doc, where in zip(docs, wheres, strict=True):
        try:
            with TOKENIZER_LOCK:
                tok.encode_batch([doc[key]])
        except ValueError:
            return where
    return None


def encode_batch(batch: list[Record]):
    """Worker task: records -> ({key: (flat tokens, lengths)}, documents, problems, keys of
    records without the keys asked for)."""
    assert _encoder is not None, "init_worker was not called in this process"
    tok, policy, keys, dtype, written = (_encoder.tok, _encoder.policy, _encoder.keys, _encoder.dtype,
                                         _encoder.written)
    problems: list[tuple[str, str]] = []
    keys_seen: set[str] = set()
    docs, wheres = [], []
    for rec in _expand(batch):
        doc = parse_record(rec, keys, problems, keys_seen)
        if doc is not None:
            docs.append(doc)
            wheres.append(rec.where)
            if written is not None and any(written.search(doc[k]) for k in keys):
                problems.append(("special-token text" if not getattr(tok, "megatron_exact", False)
                                 else "special-token text (parsed)", rec.where))
    out = {}
    arrays = getattr(tok, "encode_batch_arrays", None)
    for key in keys:
        texts = [d[key] for d in docs]
        try:
            with TOKENIZER_LOCK:
                ids = arrays(texts) if arrays is not None else None
                if ids is None:
                    ids = tok.encode_batch(texts)
        except ValueError as e:  # a character outside a char vocabulary: which document has it
            raise ValueError(f"{_first_unencodable(tok, docs, wheres, key) or 'a document'}: {e}") from None
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        if ids and isinstance(ids[0], np.ndarray):  # the character tokenizer's
            flat = np.concatenate(ids).astype(dtype, copy=False)
        else:  # lists of ints: one pass over all of them (an array per document costs twice that)
            flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
        if policy.append_eod:
            ends = np.cumsum(lengths)
            need = np.ones(len(ids), dtype=bool)
            if not policy.always and flat.size:  # not after an end-of-document token already there
                need &= ~((lengths > 0) & (flat[np.maximum(ends - 1, 0)] == policy.eod_id))
            flat = np.insert(flat, ends[need], policy.eod_id)
            lengths = lengths + need
        flat, lengths, dropped = one_separator(flat, lengths, policy)
        for i in np.flatnonzero(dropped):
            problems.append(("doubled separator", wheres[i]))
        out[key] = (flat, lengths)
    return out, len(docs), problems, sorted(keys_seen)
