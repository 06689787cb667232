"""Raw text -> tokenized Megatron indexed datasets, streaming, parallel and robust.

Pipeline: the main process reads raw records (jsonl lines, text blocks or files, parquet rows,
Hugging Face dataset rows)
in batches of about ``BATCH_BYTES``; workers decode, validate and tokenize a whole batch and
return flat numpy arrays (cheap to pickle); results are taken in input order, so the output
bytes do not depend on the worker count; one writer per JSON key streams to ``.tmp`` files that are
renamed into place only when everything succeeded.

Bad input never crashes a run and is never dropped silently. Policies (``POLICIES``):
skipped and counted — malformed JSON, a missing key, a non-string value, an empty or
whitespace-only document; repaired and counted — invalid UTF-8 (replaced by U+FFFD), a
byte-order mark (removed), CRLF line endings (to LF; in jsonl they only end the line); kept and
counted — documents over ``LONG_DOC_BYTES``. ``strict=True`` turns any of them into an error
naming the file and line, and no output is written.
"""

from __future__ import annotations

import glob
import gzip
import itertools
import json
import multiprocessing as mp
import os
import re
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from megatron_lite.data import hf_datasets
from megatron_lite.data.indexed import IndexedDatasetWriter, token_dtype
from megatron_lite.data.preprocess_ranks import (
    Piece,
    RanksError,
    commit_part,
    committed_part,
    finish,
    forget_failure,
    forget_part,
    part_prefix,
    piece_blocks,
    rank_inputs,
    record_failure,
    signature,
    signature_fields,
    tokenizer_fingerprint,
)
from megatron_lite.data.tokenizers import Tokenizer, load_tokenizer

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


# ---------------------------------------------------------------- reading (main process)

@dataclass
class Record:
    """Raw input: a block of whole jsonl lines (split into records by the worker), a jsonl line,
    a text block or file, or parquet values."""

    where: str
    kind: str  # "jsonl-block", "json", "text" or "values"
    raw: bytes | dict | None
    line: int = 0  # first line number of a jsonl block


def expand_inputs(inputs: Sequence[str]) -> list[Path | str]:
    """Files (globs expanded) and, as strings, Hugging Face datasets (``hf_datasets``), in order."""
    sources: list[Path | str] = []
    for pattern in inputs:
        if hf_datasets.is_datasets_input(pattern):
            sources.append(pattern)
            continue
        matches = sorted(glob.glob(pattern)) or [pattern]
        sources.extend(Path(m) for m in matches)
    missing = [str(p) for p in sources if isinstance(p, Path) and not p.is_file()]
    if missing:
        raise FileNotFoundError(f"input file(s) not found: {', '.join(missing)}")
    return sources


def _is_jsonl(path: Path) -> bool:
    return path.name.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz"))


def _open_binary(path: Path):
    """(line-iterable binary file, raw file) — progress is read from the raw file's position."""
    raw = open(path, "rb")
    return (gzip.GzipFile(fileobj=raw) if path.suffix == ".gz" else raw), raw


def read_records(paths: Sequence[Path | str | Piece], keys: Sequence[str], text_split: str,
                 progress: Callable[[int], None], split: str = "train",
                 streaming: bool = False) -> Iterator[Record]:
    for path in paths:
        if isinstance(path, Piece):  # this rank's lines of a jsonl file (preprocess_ranks.py)
            where = f"{path.path}[from byte {path.start}]"
            for block, line in piece_blocks(path, BATCH_BYTES, progress):
                yield Record(where, "jsonl-block", block, line=line)
            continue
        if isinstance(path, str):  # a Hugging Face dataset
            dataset = hf_datasets.load(path, split, streaming, PreprocessError)
            for where, values in hf_datasets.rows(path, dataset, keys, progress):
                yield Record(where, "values", values)
            continue
        if path.suffix == ".parquet":
            yield from _parquet_records(path, keys, progress)
            continue
        f, raw = _open_binary(path)
        with f, raw:
            last = 0
            if _is_jsonl(path):
                # Whole-line blocks of about BATCH_BYTES: the reading process does no per-line
                # work, the workers split, parse and tokenize.
                lineno = 1
                while block := f.read(BATCH_BYTES):
                    if not block.endswith(b"\n"):
                        block += f.readline()
                    yield Record(str(path), "jsonl-block", block, line=lineno)
                    lineno += block.count(b"\n")
                    progress(raw.tell() - last)
                    last = raw.tell()
            elif text_split == "file":
                yield Record(f"{path}:1", "text", f.read())
            else:
                block: list[bytes] = []
                start = 1
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        if not block:
                            start = lineno
                        block.append(line)
                    elif block:
                        yield Record(f"{path}:{start}", "text", b"".join(block))
                        block = []
                if block:
                    yield Record(f"{path}:{start}", "text", b"".join(block))
            progress(raw.tell() - last)


def _parquet_records(path: Path, keys: Sequence[str], progress) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PreprocessError(f"'{path}' is parquet: install pyarrow to read it") from None
    pf = pq.ParquetFile(path)
    present = [k for k in keys if k in pf.schema_arrow.names]
    row = 0
    for batch in pf.iter_batches(columns=present, batch_size=1024):
        columns = batch.to_pydict()
        for i in range(batch.num_rows):
            row += 1
            yield Record(f"{path}:row {row}", "values", {k: columns[k][i] for k in present})
    progress(path.stat().st_size)


def batch_records(records: Iterator[Record]) -> Iterator[list[Record]]:
    batch: list[Record] = []
    size = 0
    for rec in records:
        batch.append(rec)
        size += len(rec.raw) if isinstance(rec.raw, bytes) else 256
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# ---------------------------------------------------------------- encoding (workers)

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
    if any(LONE_SURROGATE.search(obj[k]) for k in keys):
        # Valid pairs were joined by the JSON decoder; a lone half cannot be encoded as UTF-8
        # (every tokenizer would raise on it).
        obj = {**obj, **{k: LONE_SURROGATE.sub("\ufffd", obj[k]) for k in keys}}
        problems.append(("lone surrogate", rec.where))
    if any(len(obj[k]) > LONG_DOC_BYTES for k in keys):
        problems.append(("long document", rec.where))
    return {k: obj[k] for k in keys}


@dataclass
class SeparatorPolicy:
    """What goes between documents, decided once from what the tokenizer adds by itself."""

    append_eod: bool
    eod_id: int | None
    description: str
    separators: tuple[int, ...] = ()
    """Ids that mark a document boundary (BOS, EOS/EOD)."""
    leads: bool = False
    """True when the separator starts each document (BOS), False when it ends it."""
    frames: bool = False
    """True when the tokenizer adds both: each document is BOS … EOS, and both are kept."""
    always: bool = False
    """Append the end-of-document token even after one already there (Megatron's bytes)."""


def separator_policy(tokenizer: Tokenizer, append_eod: bool) -> SeparatorPolicy:
    """Detect BOS/EOS the tokenizer adds (encoding an empty and a short string) and append the
    end-of-document token only where nothing marks the boundary already."""
    bos, eos = tokenizer.bos_id, tokenizer.eod_id
    if getattr(tokenizer, "megatron_exact", False):
        # Megatron-LM's preprocess_data.py appends EOD to every document, whatever is there.
        if not append_eod:
            return SeparatorPolicy(False, eos, "no separator (--append-eod not given), as Megatron-LM")
        return SeparatorPolicy(True, eos, f"end-of-document token {eos} appended to every document, "
                                          "as Megatron-LM's preprocess_data.py does", always=True)
    # Only a tokenizer with a BOS or an EOS can add one; the others are not asked (a character
    # vocabulary over DNA or digits cannot encode any fixed probe).
    short = tokenizer.encode("a") if bos is not None or eos is not None else []
    adds_bos = bos is not None and len(short) > 0 and short[0] == bos
    adds_eos = eos is not None and len(short) > 0 and short[-1] == eos
    seps = tuple(t for t in (bos, eos) if t is not None)
    if adds_bos and adds_eos:
        return SeparatorPolicy(False, eos, "the tokenizer frames every document with BOS … EOS: "
                                           "nothing added", seps, frames=True)
    if adds_eos:
        return SeparatorPolicy(False, eos, "the tokenizer appends EOS to every document: nothing "
                                           "added", seps)
    if adds_bos:
        return SeparatorPolicy(False, eos, "the tokenizer starts every document with BOS, which "
                                           "separates documents: nothing added", seps, leads=True)
    if not append_eod:
        return SeparatorPolicy(False, eos, "no separator (--append-eod not given)", seps)
    if eos is None:
        raise PreprocessError("--append-eod: the tokenizer has no end-of-document token")
    return SeparatorPolicy(True, eos, f"end-of-document token {eos} appended once per document "
                                      "(never after one already there)", seps)


def one_separator(flat: np.ndarray, lengths: np.ndarray, policy: SeparatorPolicy
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Drop separator tokens that would stand next to another one in the output stream
    (a document whose text already holds the separator, next to the one the tokenizer or
    ``--append-eod`` adds). Returns (tokens, lengths, per-document count of dropped tokens)."""
    if not policy.separators or flat.size == 0:
        return flat, lengths, np.zeros(lengths.size, np.int64)
    is_sep = np.isin(flat, policy.separators)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    doc_of = np.repeat(np.arange(lengths.size), lengths)
    nonempty = lengths > 0
    if policy.frames:
        # Each document is BOS … EOS as the tokenizer made it: keep that frame, and of two
        # separators side by side inside a document drop the one that is not part of it.
        framing = np.zeros(flat.size, dtype=bool)
        framing[starts[nonempty]] = True
        framing[(starts + lengths - 1)[nonempty]] = True
        later = np.flatnonzero(is_sep[1:] & is_sep[:-1] & (doc_of[1:] == doc_of[:-1])) + 1
        drop = np.zeros(flat.size, dtype=bool)
        drop[later[~framing[later]]] = True
        earlier = later[framing[later]] - 1
        drop[earlier[~framing[earlier]]] = True
        dropped = np.bincount(doc_of[drop], minlength=lengths.size).astype(np.int64)
        return flat[~drop], lengths - dropped, dropped
    drop = np.zeros(flat.size, dtype=bool)
    drop[1:] = is_sep[1:] & is_sep[:-1]
    drop[starts] = False  # the first token of a document is judged below
    if policy.leads:
        # BOS starts each document: a document may not end with separators (the next BOS follows).
        last_real = np.full(lengths.size, -1)
        np.maximum.at(last_real, doc_of[~is_sep], np.flatnonzero(~is_sep))
        drop |= np.arange(flat.size) > np.repeat(np.maximum(last_real, starts), lengths)
    else:
        # The separator ends each document: a document may not start with one.
        drop[starts[nonempty]] = is_sep[starts[nonempty]]
    dropped = np.bincount(doc_of[drop], minlength=lengths.size).astype(np.int64)
    return flat[~drop], lengths - dropped, dropped


_worker: tuple[Tokenizer, SeparatorPolicy, tuple[str, ...], np.dtype, re.Pattern | None] | None = None


def _init_worker(kind: str, model: str, append_eod: bool, keys: tuple[str, ...], dtype: str,
                 single_threaded: bool, tok: Tokenizer | None = None) -> None:
    """Set up this process's encoder (``tok``: the caller's tokenizer when it encodes itself, or
    what it handed its workers: ``HFTokenizer.fast``)."""
    global _worker
    if single_threaded:  # one tokenizer thread per worker process: no oversubscription
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = tok if tok is not None else load_tokenizer(kind, model)
    if single_threaded and hasattr(tok, "num_threads"):
        tok.num_threads = 1
    specials = sorted(tok.special_texts, key=len, reverse=True)
    written = re.compile("|".join(map(re.escape, specials))) if specials else None
    _worker = (tok, separator_policy(tok, append_eod), keys, np.dtype(dtype), written)


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
            tok.encode_batch([doc[key]])
        except ValueError:
            return where
    return None


def encode_batch(batch: list[Record]):
    """Worker task: records -> ({key: (flat tokens, lengths)}, documents, problems, keys of
    records without the keys asked for)."""
    assert _worker is not None
    tok, policy, keys, dtype, written = _worker
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
    for key in keys:
        try:
            ids = tok.encode_batch([d[key] for d in docs])
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


# ---------------------------------------------------------------- driver

def preprocess(inputs: Sequence[str], output_prefix: str, json_keys: Sequence[str],
               tokenizer_type: str, tokenizer_model: str, append_eod: bool = False,
               workers: int = 1, text_split: str = "file", strict: bool = False,
               log: Callable[[str], None] = print, show_progress: bool | None = None,
               split: str = "train", streaming: bool = False, rank: int = 0, world: int = 1,
               wait: float = 0.0) -> Summary:
    """Tokenize ``inputs`` into ``{output_prefix}_{key}_document.bin/.idx`` for every key.
    ``split`` and ``streaming`` apply to Hugging Face dataset inputs. With ``world`` ranks, this
    rank writes its part of the input, and returns only once the whole dataset is written and
    verified (by the last rank to finish, ``preprocess_ranks.py``), waiting at most ``wait``
    seconds for the other ranks: ``PartsPending`` when they have not finished by then. The
    summary is the whole dataset's where known, else this rank's. A run that would write no
    document raises, naming the keys its records have."""
    if text_split not in TEXT_SPLITS:
        raise PreprocessError(f"text split '{text_split}' is not one of {TEXT_SPLITS}")
    if not 0 <= rank < world:
        raise PreprocessError(f"rank {rank} is not in 0..{world - 1} (world size {world})")
    paths = expand_inputs(inputs)
    keys = tuple(json_keys)
    if world == 1:
        summary = _preprocess(paths, keys, load_tokenizer(tokenizer_type, tokenizer_model), tokenizer_type,
                              tokenizer_model, append_eod, workers, text_split, strict, show_progress,
                              split, streaming, lambda key: f"{output_prefix}_{key}_document")
        for line in format_summary(summary, output_prefix):
            log(line)
        return summary
    hub = [p for p in paths if isinstance(p, str)]
    if hub:
        raise PreprocessError(
            f"{hub[0]} is a Hugging Face dataset: preprocessing on several ranks splits files; "
            "run one rank for it, or save it as parquet/jsonl files and pass those")
    started = time.time()
    tokenizer = load_tokenizer(tokenizer_type, tokenizer_model)
    fields = signature_fields(paths, world, keys, tokenizer_fingerprint(tokenizer_type, tokenizer_model),
                              append_eod, text_split, separator_policy(tokenizer, append_eod).description)
    sig = signature(fields)
    try:
        return _preprocess_part(paths, output_prefix, keys, tokenizer, tokenizer_type, tokenizer_model,
                                append_eod, workers, text_split, strict, show_progress, split, streaming,
                                rank, world, wait, sig, fields, started, log)
    except RanksError:
        raise  # about the parts on disk, which every rank reads for itself (or still missing)
    except Exception as e:  # this rank's own work failed: the ranks waiting for it stop with its reason
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        record_failure(output_prefix, rank, world, sig, reason)
        raise


def _preprocess_part(paths, output_prefix, keys, tokenizer, tokenizer_type, tokenizer_model, append_eod,
                     workers, text_split, strict, show_progress, split, streaming, rank, world, wait, sig,
                     fields, started, log) -> Summary:
    forget_failure(output_prefix, rank, world)
    reused = committed_part(output_prefix, keys, rank, world, sig)
    if reused is not None:
        summary = Summary(**reused)
        log(f"rank {rank} of {world}: part already committed from the same inputs and options: reused")
    else:
        forget_part(output_prefix, rank, world)
        summary = _preprocess(rank_inputs(paths, rank, world), keys, tokenizer, tokenizer_type,
                              tokenizer_model, append_eod, workers, text_split, strict, show_progress,
                              split, streaming, lambda key: part_prefix(output_prefix, key, rank, world),
                              require_documents=False)  # a rank's share may be empty
        commit_part(output_prefix, rank, world, sig, fields, asdict(summary))
        log(f"rank {rank} of {world}: {summary.documents:,} documents, "
            f"{sum(summary.tokens.values()):,} tokens from {summary.input_bytes / 2**20:,.1f} MiB "
            f"in {summary.seconds:.1f} s")

    def require_documents(parts: list[dict]) -> None:
        _require_documents(_sum_summaries([Summary(**p) for p in parts]), keys)

    parts, merged = finish(output_prefix, keys, rank, world, sig, fields, wait, require_documents, log,
                           started)
    if parts is None:
        log(f"rank {rank} of {world}: {output_prefix}_*_document written by another rank and verified")
        return summary
    whole = _sum_summaries([Summary(**p) for p in parts])
    if merged:
        for line in format_summary(whole, output_prefix):
            log(line)
    else:
        log(f"rank {rank} of {world}: {output_prefix}_*_document written by another rank and verified "
            f"({whole.documents:,} documents)")
    return whole


def _require_documents(summary: Summary, keys: Sequence[str]) -> None:
    """A dataset of no documents is a mistake (a mistyped --json-keys, the wrong files): refuse
    it, naming what the records hold."""
    if summary.documents:
        return
    absent = [k for k in keys if k not in summary.keys_seen]
    if summary.keys_seen and absent:
        raise PreprocessError(
            f"no document written: no record has the key(s) {', '.join(map(repr, absent))} "
            f"(--json-keys {' '.join(keys)}); the records have the keys "
            f"{', '.join(map(repr, summary.keys_seen))}")
    if summary.counts:
        why = ", ".join(f"{problem}: {n:,}" for problem, n in summary.counts.items())
        raise PreprocessError(f"no document written: every record was skipped ({why})")
    raise PreprocessError("no document written: the input holds no records")


def _sum_summaries(parts: list[Summary]) -> Summary:
    whole = Summary(separator_policy=parts[0].separator_policy, tokens=dict.fromkeys(parts[0].tokens, 0))
    for part in parts:
        whole.documents += part.documents
        whole.input_bytes += part.input_bytes
        whole.seconds = max(whole.seconds, part.seconds)
        for key, n in part.tokens.items():
            whole.tokens[key] += n
        whole.keys_seen = sorted({*whole.keys_seen, *part.keys_seen})[:MAX_KEYS_SEEN]
        for problem, n in part.counts.items():
            whole.counts[problem] = whole.counts.get(problem, 0) + n
            locs = whole.first_locations.setdefault(problem, [])
            locs.extend(part.first_locations.get(problem, [])[:3 - len(locs)])
    return whole


def _preprocess(paths, keys, tokenizer: Tokenizer, tokenizer_type, tokenizer_model, append_eod, workers,
                text_split, strict, show_progress, split, streaming, prefix_of: Callable[[str], str],
                require_documents: bool = True) -> Summary:
    policy = separator_policy(tokenizer, append_eod)
    dtype = token_dtype(tokenizer.vocab_size)
    summary = Summary(separator_policy=policy.description, tokens={k: 0 for k in keys})
    total_bytes = sum(p.end - p.start if isinstance(p, Piece) else p.stat().st_size
                      for p in paths if not isinstance(p, str))
    bar = _progress_bar(total_bytes, show_progress)
    writers = {k: IndexedDatasetWriter(prefix_of(k), dtype) for k in keys}
    init_args = (tokenizer_type, tokenizer_model, append_eod, keys, dtype.str, workers > 1)
    # concurrent.futures rather than multiprocessing.Pool: a worker killed mid-batch (the OOM
    # killer on a huge line) breaks the executor and every waiting result raises, where Pool
    # replaces the worker and waits forever for the lost batch.
    portable = getattr(tokenizer, "fast", None)  # HFTokenizer's backend: workers skip transformers
    pool = (ProcessPoolExecutor(workers, mp.get_context("spawn"), _init_worker, (*init_args, portable))
            if workers > 1 else None)
    start = time.time()

    def advance(nbytes: int) -> None:
        summary.input_bytes += nbytes
        if bar is not None:
            bar.update(nbytes)

    try:
        batches = batch_records(read_records(paths, keys, text_split, advance, split, streaming))
        if pool is None:
            _init_worker(*init_args, tok=tokenizer)  # loaded once (transformers: seconds)
            results = map(encode_batch, batches)
        else:
            results = _in_order(pool, batches, ahead=4 * workers)
        for out, n_docs, problems, keys_seen in results:
            if keys_seen and len(summary.keys_seen) < MAX_KEYS_SEEN:
                summary.keys_seen = sorted({*summary.keys_seen, *keys_seen})[:MAX_KEYS_SEEN]
            for problem, where in problems:
                summary.add(problem, where)
                if strict:
                    raise PreprocessError(f"{where}: {problem} (--strict)")
            for key, (flat, lengths) in out.items():
                writers[key].add_flat(flat, lengths)
                summary.tokens[key] += int(flat.size)
            summary.documents += n_docs
            if bar is not None:
                secs = max(time.time() - start, 1e-9)
                bar.set_postfix_str(f"{summary.documents / secs:,.0f} docs/s, "
                                    f"{sum(summary.tokens.values()) / secs:,.0f} tok/s", refresh=False)
        if require_documents:
            _require_documents(summary, keys)  # before anything is in place
        for w in writers.values():
            w.finalize()
    except BrokenProcessPool:
        for w in writers.values():
            w.abort()
        raise PreprocessError(
            f"a tokenizer worker process died (killed, most likely by the out-of-memory killer on a "
            f"very large document); nothing was written to {prefix_of(keys[0])}. Rerun with fewer "
            "--workers or more memory per worker, or split the largest documents") from None
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if bar is not None:
            bar.close()
    summary.seconds = time.time() - start
    return summary


def _in_order(pool: ProcessPoolExecutor, batches: Iterable, ahead: int) -> Iterator:
    """``encode_batch`` over ``batches`` in the workers, results in input order, with at most
    ``ahead`` batches in flight (the input is read only as fast as it is encoded)."""
    pending: deque = deque()
    for batch in batches:
        pending.append(pool.submit(encode_batch, batch))
        if len(pending) >= ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _progress_bar(total: int, show: bool | None):
    if show is False:
        return None
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    if show is None and not tty and not os.environ.get("MEGATRON_LITE_PROGRESS"):
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, mininterval=0.5 if tty else 30,
                desc="preprocess", file=sys.stderr)


def format_summary(s: Summary, prefix: str) -> list[str]:
    secs = max(s.seconds, 1e-9)
    total = sum(s.tokens.values())
    lines = [f"{s.documents:,} documents, {total:,} tokens from {s.input_bytes / 2**20:,.1f} MiB in "
             f"{secs:.1f} s ({total / secs:,.0f} tokens/s, {s.input_bytes / 2**20 / secs:,.1f} MiB/s)",
             f"separators: {s.separator_policy}"]
    lines += [f"wrote {prefix}_{k}_document.bin/.idx ({n:,} tokens)" for k, n in s.tokens.items()]
    for problem, count in s.counts.items():
        locs = ", ".join(s.first_locations[problem])
        lines.append(f"{problem}: {count:,} — {POLICIES[problem]}; first at {locs}")
    return lines
