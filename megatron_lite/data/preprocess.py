"""Raw text (jsonl or plain text) -> tokenized Megatron indexed datasets.

Documents are read in order, tokenized in batches (in worker processes when ``workers > 1``;
``imap`` keeps the output order, so the bytes do not depend on the worker count), and streamed
to one ``PREFIX_{key}_document`` dataset per JSON key.
"""

from __future__ import annotations

import glob
import json
import multiprocessing as mp
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megatron_lite.data.indexed import IndexedDatasetWriter, token_dtype
from megatron_lite.data.tokenizers import Tokenizer, load_tokenizer

BATCH_DOCS = 256


@dataclass
class Summary:
    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    first_problems: list[str] = field(default_factory=list)

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if len(self.first_problems) < 5:
            self.first_problems.append(f"{where}: {reason}")


def expand_inputs(inputs: Sequence[str]) -> list[Path]:
    paths: list[Path] = []
    for pattern in inputs:
        matches = sorted(glob.glob(pattern)) or [pattern]
        paths.extend(Path(m) for m in matches)
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"input file(s) not found: {', '.join(missing)}")
    return paths


def iter_documents(paths: Sequence[Path], keys: Sequence[str], summary: Summary
                   ) -> Iterator[dict[str, str]]:
    """Documents as {key: text}: one per jsonl line, or one per plain-text file."""
    for path in paths:
        if path.suffix in (".jsonl", ".json"):
            with open(path, encoding="utf-8", errors="replace") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError:
                        summary.skip("malformed JSON", f"{path}:{lineno}")
                        continue
                    if not isinstance(obj, dict) or not all(isinstance(obj.get(k), str) for k in keys):
                        summary.skip(f"missing or non-string key(s) {list(keys)}", f"{path}:{lineno}")
                        continue
                    yield {k: obj[k] for k in keys}
        else:
            text = path.read_text(encoding="utf-8", errors="replace")
            yield {k: text for k in keys}


_worker_tokenizer: Tokenizer | None = None


def _init_worker(kind: str, model: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(kind, model)


def _encode(batch: list[str]) -> list[list[int]]:
    assert _worker_tokenizer is not None
    return _worker_tokenizer.encode_batch(batch)


def _batches(docs: Iterator[dict[str, str]], key: str, size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for doc in docs:
        batch.append(doc[key])
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def preprocess(inputs: Sequence[str], output_prefix: str, json_keys: Sequence[str],
               tokenizer_type: str, tokenizer_model: str, append_eod: bool = False,
               workers: int = 1, log=print) -> dict[str, Summary]:
    """Tokenize ``inputs`` into ``{output_prefix}_{key}_document.bin/.idx`` for every key."""
    paths = expand_inputs(inputs)
    tokenizer = load_tokenizer(tokenizer_type, tokenizer_model)
    eod = tokenizer.eod_id
    if append_eod and eod is None:
        raise ValueError(f"--append-eod: the {tokenizer_type} tokenizer '{tokenizer_model}' has no "
                         "end-of-document token")
    results: dict[str, Summary] = {}
    for key in json_keys:
        summary = Summary()
        prefix = f"{output_prefix}_{key}_document"
        writer = IndexedDatasetWriter(prefix, token_dtype(tokenizer.vocab_size))
        start = time.time()
        pool = mp.get_context("spawn").Pool(workers, _init_worker, (tokenizer_type, tokenizer_model)) \
            if workers > 1 else None
        try:
            texts = _batches(iter_documents(paths, [key], summary), key, BATCH_DOCS)
            encoded = pool.imap(_encode, texts) if pool else map(tokenizer.encode_batch, texts)
            for batch in encoded:
                if append_eod:
                    # Only where the tokenizer did not already end the document with it.
                    batch = [ids if ids and ids[-1] == eod else [*ids, eod] for ids in batch]
                writer.add_documents(batch)
                summary.documents += len(batch)
            writer.finalize()
        except BaseException:
            writer.abort()
            raise
        finally:
            if pool:
                pool.close()
                pool.join()
        summary.tokens = writer.n_tokens
        secs = max(time.time() - start, 1e-9)
        log(f"{prefix}: {summary.documents} documents, {summary.tokens} tokens "
            f"({summary.tokens / secs:,.0f} tokens/s, {workers} worker(s)); "
            f"end-of-document token {'appended once per document' if append_eod else 'not added'}")
        for reason, count in summary.skipped.items():
            log(f"  skipped {count} line(s): {reason}")
        for where in summary.first_problems:
            log(f"  first problems: {where}")
        results[key] = summary
    return results
