"""The preprocessing run: this process's or this rank's part of the input read, encoded (in worker
processes where asked), written in input order, and summarised."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict

# (By full name: the package's __init__ imports this module. Looked up at each call, so a
# test's wrapper of encode_batch is what runs.)
import megatron_lite.data.preprocess.encode as encode
from megatron_lite.data.indexed import IndexedDatasetWriter, token_dtype
from megatron_lite.data.preprocess.merge import finish
from megatron_lite.data.preprocess.options import PreprocessOptions
from megatron_lite.data.preprocess.parts import (
    RanksError,
    commit_part,
    committed_part,
    forget_failure,
    forget_part,
    part_prefix,
    record_failure,
    signature,
    signature_fields,
    tokenizer_fingerprint,
)
from megatron_lite.data.preprocess.pieces import Piece, rank_inputs
from megatron_lite.data.preprocess.readers import batch_records, expand_inputs, read_records
from megatron_lite.data.preprocess.records import (
    MAX_KEYS_SEEN,
    POLICIES,
    PreprocessError,
    Summary,
)
from megatron_lite.data.preprocess.separators import separator_policy
from megatron_lite.data.tokenizers import Tokenizer, load_tokenizer


def preprocess(inputs: Sequence[str], output_prefix: str, options: PreprocessOptions, *,
               log: Callable[[str], None] = print, rank: int = 0, world: int = 1,
               wait: float = 0.0) -> Summary:
    """Tokenize ``inputs`` into ``{output_prefix}_{key}_document.bin/.idx`` for every key of
    ``options``. With ``world`` ranks, this rank writes its part of the input, and returns only
    once the whole dataset is written and verified (by the last rank to finish, ``merge.py``),
    waiting at most ``wait`` seconds for the other ranks: ``PartsPending`` when they have not
    finished by then. The summary is the whole dataset's where known, else this rank's. A run
    that would write no document raises, naming the keys its records have."""
    if not 0 <= rank < world:
        raise PreprocessError(f"rank {rank} is not in 0..{world - 1} (world size {world}): give every rank "
                              "the number of ranks sharing the input (--world-size)")
    paths = expand_inputs(inputs)
    tokenizer = load_tokenizer(options.tokenizer_type, options.tokenizer_model)
    if world == 1:
        summary = _encode_into(paths, options, tokenizer, lambda key: f"{output_prefix}_{key}_document")
        for line in format_summary(summary, output_prefix):
            log(line)
        return summary
    hub = [p for p in paths if isinstance(p, str)]
    if hub:
        raise PreprocessError(
            f"{hub[0]} is a Hugging Face dataset: preprocessing on several ranks splits files; "
            "run one rank for it, or save it as parquet/jsonl files and pass those")
    started = time.time()
    fields = signature_fields(paths, world, options.output_fields(
        tokenizer_fingerprint(options.tokenizer_type, options.tokenizer_model),
        separator_policy(tokenizer, options.append_eod).description))
    sig = signature(fields)
    try:
        return _preprocess_part(paths, output_prefix, options, tokenizer, rank, world, wait, sig, fields,
                                started, log)
    except RanksError:
        raise  # about the parts on disk, which every rank reads for itself (or still missing)
    except Exception as e:  # this rank's own work failed: the ranks waiting for it stop with its reason
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        record_failure(output_prefix, rank, world, sig, reason)
        raise


def _preprocess_part(paths, output_prefix: str, options: PreprocessOptions, tokenizer: Tokenizer, rank: int,
                     world: int, wait: float, sig: str, fields: dict, started: float,
                     log: Callable[[str], None]) -> Summary:
    """This rank's part (reused when committed from the same inputs and options), then the
    merged dataset (``merge.finish``)."""
    keys = options.json_keys
    forget_failure(output_prefix, rank, world)
    reused = committed_part(output_prefix, keys, rank, world, sig)
    if reused is not None:
        summary = Summary(**reused)
        log(f"rank {rank} of {world}: part already committed from the same inputs and options: reused")
    else:
        forget_part(output_prefix, rank, world)
        summary = _encode_into(rank_inputs(paths, rank, world), options, tokenizer,
                               lambda key: part_prefix(output_prefix, key, rank, world),
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


def _encode_into(paths, options: PreprocessOptions, tokenizer: Tokenizer, prefix_of: Callable[[str], str],
                 require_documents: bool = True) -> Summary:
    """Read ``paths``, encode them (in ``options.workers`` processes) and write one dataset per
    key at ``prefix_of(key)``, in input order; nothing is in place unless all of it is."""
    keys, workers = options.json_keys, options.workers
    policy = separator_policy(tokenizer, options.append_eod)
    dtype = token_dtype(tokenizer.vocab_size)
    summary = Summary(separator_policy=policy.description, tokens={k: 0 for k in keys})
    total_bytes = sum(p.end - p.start if isinstance(p, Piece) else p.stat().st_size
                      for p in paths if not isinstance(p, str))
    bar = _progress_bar(total_bytes, options.show_progress)
    writers = {k: IndexedDatasetWriter(prefix_of(k), dtype) for k in keys}
    init_args = (options.tokenizer_type, options.tokenizer_model, options.append_eod, keys, dtype.str,
                 workers > 1)
    # concurrent.futures rather than multiprocessing.Pool: a worker killed mid-batch (the OOM
    # killer on a huge line) breaks the executor and every waiting result raises, where Pool
    # replaces the worker and waits forever for the lost batch.
    portable = getattr(tokenizer, "fast", None)  # HFTokenizer's backend: workers skip transformers
    pool: Executor | None = None
    if workers > 1:
        pool = ProcessPoolExecutor(workers, mp.get_context("spawn"), encode.init_worker,
                                   (*init_args, portable))
    start = time.time()

    def advance(nbytes: int) -> None:
        summary.input_bytes += nbytes
        if bar is not None:
            bar.update(nbytes)

    try:
        batches = batch_records(read_records(paths, keys, options.text_split, advance, options.split,
                                             options.streaming))
        if pool is None:
            encode.init_worker(*init_args, tok=tokenizer)  # loaded once (transformers: seconds)
            # Two threads: one batch's parsing and flattening (Python, one core) runs while the
            # other batch is in the tokenizer, which releases the GIL and uses every core. In one
            # thread a core would idle through the Python part, a tenth of the time.
            pool = ThreadPoolExecutor(2, thread_name_prefix="encode")
        # In flight: a batch per thread and one read ahead (processes: four each, their pipes).
        results = _in_order(pool, batches, ahead=4 * workers if workers > 1 else 3)
        for out, n_docs, problems, keys_seen in results:
            if keys_seen and len(summary.keys_seen) < MAX_KEYS_SEEN:
                summary.keys_seen = sorted({*summary.keys_seen, *keys_seen})[:MAX_KEYS_SEEN]
            for problem, where in problems:
                summary.add(problem, where)
                if options.strict:
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


def _in_order(pool: Executor, batches: Iterable, ahead: int) -> Iterator:
    """``encode_batch`` over ``batches`` in the pool's workers, results in input order, with at most
    ``ahead`` batches in flight (the input is read only as fast as it is encoded)."""
    pending: deque = deque()
    for batch in batches:
        pending.append(pool.submit(encode.encode_batch, batch))
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
