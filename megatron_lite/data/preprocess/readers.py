"""Reading the input in the main process: files (globs), jsonl in whole-line blocks, text files or
blank-line blocks, parquet rows, Hugging Face dataset rows, a rank's piece of a jsonl file; then
batches of about ``BATCH_BYTES`` for the encoders."""

from __future__ import annotations

import glob
import gzip
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from megatron_lite.data import hf_datasets
from megatron_lite.data.preprocess.pieces import Piece, piece_blocks
from megatron_lite.data.preprocess.records import BATCH_BYTES, PreprocessError, Record


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
        if isinstance(path, Piece):  # this rank's lines of a jsonl file (pieces.py)
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
