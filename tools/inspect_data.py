#!/usr/bin/env python
"""Look inside an indexed dataset (.bin/.idx).

    python tools/inspect_data.py PREFIX stats                      # documents, tokens, lengths
    python tools/inspect_data.py PREFIX doc 12 --tokenizer-type sentencepiece --tokenizer-model M
    python tools/inspect_data.py PREFIX sample 7 --seq-length 1024 ...   # a stream window
    python tools/inspect_data.py PREFIX lint --tokenizer-type ... --tokenizer-model ...

``lint`` reports doubled separators, empty documents and token ids outside the vocabulary, and
exits 1 when it finds any.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from megatron_lite.data.indexed import IndexedDataset  # noqa: E402
from megatron_lite.data.tokenizers import load_tokenizer  # noqa: E402
from tools._cli_args import positive_int  # noqa: E402

CHUNK = 1 << 24


def stats(ds: IndexedDataset) -> list[str]:
    lengths = ds.lengths.astype(np.int64)
    lines = [f"documents: {ds.n_documents:,}", f"tokens: {int(lengths.sum()):,}", f"token dtype: {ds.dtype}"]
    if ds.n_documents != len(ds):  # made with --split-sentences: sequences are sentences
        lines.insert(1, f"sequences: {len(ds):,} (several per document; samples are drawn over sequences)")
    if lengths.size:
        q = np.percentile(lengths, [0, 50, 90, 99, 100]).astype(int)
        lines.append(f"document length min/median/p90/p99/max: {' / '.join(f'{x:,}' for x in q)}")
        edges = [0, 1, 16, 128, 1024, 8192, 65536, np.inf]
        hist, _ = np.histogram(lengths, bins=edges)
        for lo, hi, n in zip(edges[:-1], edges[1:], hist, strict=True):
            lines.append(f"  [{lo:>6}, {hi:>6}) tokens: {n:,}")
    return lines


def lint(ds: IndexedDataset, vocab_size: int | None, separators: list[int]) -> list[str]:
    """Problems found, one line each (counts and first positions); reads the tokens in chunks."""
    problems = []
    empty = np.flatnonzero(ds.lengths == 0)
    if empty.size:
        problems.append(f"{empty.size:,} empty document(s), first: {empty[:5].tolist()}")
    seps = np.asarray(separators)
    doubled: list[int] = []
    bad_ids: list[int] = []
    n_doubled = n_bad = 0
    prev_sep = False
    for start in range(0, ds.n_tokens, CHUNK):
        chunk = np.asarray(ds.tokens[start:start + CHUNK])
        if seps.size:
            is_sep = np.isin(chunk, seps)
            # A pair may straddle two chunks: prepend the previous chunk's last flag.
            flags = np.concatenate([[prev_sep], is_sep])
            pairs = np.flatnonzero(flags[1:] & flags[:-1]) + start
            n_doubled += pairs.size
            doubled += pairs[:5 - len(doubled)].tolist()
            prev_sep = bool(is_sep[-1])
        if vocab_size is not None:
            bad = np.flatnonzero((chunk < 0) | (chunk >= vocab_size)) + start
            n_bad += bad.size
            bad_ids += bad[:5 - len(bad_ids)].tolist()
    if n_doubled:
        problems.append(f"{n_doubled:,} doubled separator(s) (two in a row), first at token "
                        f"position(s) {doubled}")
    if n_bad:
        problems.append(f"{n_bad:,} token id(s) outside the vocabulary of {vocab_size}, first at "
                        f"token position(s) {bad_ids}")
    return problems


def _ids(ds: IndexedDataset, command: str, index: int, seq_length: int) -> np.ndarray:
    """The token ids of document ``index`` or of stream window ``index``; IndexError naming the
    range when there is no such one."""
    if command == "doc":
        if not 0 <= index < len(ds):
            raise IndexError(f"document {index} does not exist: {ds.prefix} has {len(ds):,} document(s) "
                             f"(0..{len(ds) - 1})")
        return np.asarray(ds[index])
    windows = max(0, (ds.n_tokens - 1) // seq_length)
    if not 0 <= index < windows:
        raise IndexError(f"sample {index} does not exist: {ds.prefix} has {windows:,} windows of "
                         f"{seq_length} tokens (0..{windows - 1}; --seq-length sets their length)")
    start = index * seq_length
    return np.asarray(ds.tokens[start:start + seq_length + 1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prefix", help="the dataset: PREFIX.bin and PREFIX.idx")
    p.add_argument("command", choices=["stats", "doc", "sample", "lint"],
                   help="what to show: counts and lengths, a document, a training window, problems")
    p.add_argument("index", nargs="?", type=int, default=None,
                   help="doc: the document's number; sample: the window's number (from 0)")
    p.add_argument("--tokenizer-type", choices=["sentencepiece", "huggingface", "char"],
                   help="decode token ids to text (doc, sample), check them against the vocabulary (lint)")
    p.add_argument("--tokenizer-model", help="the tokenizer's file or directory")
    p.add_argument("--seq-length", type=positive_int, default=1024, help="sample: window length")
    a = p.parse_args(argv)
    if a.command in ("doc", "sample") and a.index is None:
        p.error(f"{a.command} needs a number: inspect_data.py PREFIX {a.command} N")
    if a.command in ("stats", "lint") and a.index is not None:
        p.error(f"{a.command} takes no number (it reads the whole dataset)")
    if a.command == "lint" and not (a.tokenizer_type and a.tokenizer_model):
        p.error("lint needs --tokenizer-type and --tokenizer-model: the vocabulary and separators "
                "it checks the token ids against")
    if bool(a.tokenizer_type) != bool(a.tokenizer_model):
        p.error("--tokenizer-type and --tokenizer-model go together")
    try:
        ds = IndexedDataset(a.prefix)
        tok = load_tokenizer(a.tokenizer_type, a.tokenizer_model) if a.tokenizer_model else None
        ids = _ids(ds, a.command, a.index, a.seq_length) if a.command in ("doc", "sample") else None
    except (FileNotFoundError, ValueError, IndexError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.command == "stats":
        print("\n".join(stats(ds)))
        return 0
    if ids is not None:
        if tok is not None and ids.size and int(ids.max()) >= tok.vocab_size:
            print(f"error: token id {int(ids.max())} is outside the tokenizer's {tok.vocab_size} ids: "
                  "give the tokenizer the dataset was made with", file=sys.stderr)
            return 2
        print(tok.decode(ids.tolist()) if tok else " ".join(map(str, ids.tolist())))
        return 0
    separators = [t for t in ((tok.eod_id, tok.bos_id) if tok else ()) if t is not None]
    problems = lint(ds, tok.vocab_size if tok else None, separators)
    print("\n".join(problems) if problems else "no problems found")
    return 1 if problems else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        sys.exit(0)
