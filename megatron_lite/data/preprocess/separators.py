"""What goes between documents: decided once from what the tokenizer adds by itself, and applied
to each encoded batch (one separator between two documents, never two)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_lite.data.preprocess.records import PreprocessError
from megatron_lite.data.tokenizers import Tokenizer


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
