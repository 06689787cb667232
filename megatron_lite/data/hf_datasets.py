"""Hugging Face ``datasets`` as preprocessing input: a Hub name (``hf:NAME[:CONFIG]``), a
directory written by ``Dataset.save_to_disk``, another local dataset directory, or ``.arrow``
files. Rows become the same records as parquet rows, so the policies for bad input, the
separators and the output bytes are those of every other input (jsonl, parquet, text).

``datasets`` is optional (``pip install -e .[ray]``): it is imported only for these inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

HUB_PREFIX = "hf:"
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
"""Files ``save_to_disk`` writes (a ``Dataset`` or a ``DatasetDict``)."""


def is_datasets_input(spec: str) -> bool:
    """A Hub name, a dataset directory (saved, or holding data files) or an Arrow file."""
    if spec.startswith(HUB_PREFIX):
        return True
    path = Path(spec)
    return path.is_dir() or (path.suffix == ".arrow" and path.is_file())


def _import_datasets(spec: str, error: type[Exception]):
    try:
        import datasets
    except ImportError:
        raise error(f"'{spec}' is a Hugging Face dataset: install the datasets library "
                    "(pip install -e .[ray], or pip install datasets)") from None
    return datasets


def load(spec: str, split: str, streaming: bool, error: type[Exception]):
    """The split ``split`` of the dataset ``spec`` (iterable rows), or ``error`` naming it."""
    datasets = _import_datasets(spec, error)
    path = Path(spec)
    if spec.startswith(HUB_PREFIX):
        name, _, config = spec[len(HUB_PREFIX):].partition(":")
        if not name:
            raise error(f"'{spec}': expected hf:NAME or hf:NAME:CONFIG (e.g. hf:wikitext:wikitext-2-raw-v1)")
        try:
            return datasets.load_dataset(name, config or None, split=split, streaming=streaming)
        except Exception as e:  # the Hub, the network, a wrong name or config: one line for each
            reason = " ".join(str(e).split())[:300] or type(e).__name__
            raise error(
                f"cannot load the Hugging Face dataset '{name}'{f' (config {config})' if config else ''}, "
                f"split '{split}': {reason}. Without network access: load it where the network "
                "allows, Dataset.save_to_disk(DIR), and pass DIR as --input") from None
    if path.suffix == ".arrow":
        return datasets.Dataset.from_file(str(path))
    if any((path / m).exists() for m in SAVED_MARKERS):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise error(f"'{spec}' has no split '{split}' (it has {', '.join(loaded)}): choose one "
                            "with --split")
            loaded = loaded[split]
        return loaded
    try:  # a directory of data files (parquet, json, csv, text) that datasets recognises
        return datasets.load_dataset(str(path), split=split, streaming=streaming)
    except Exception as e:
        raise error(f"'{spec}' is neither a saved dataset (Dataset.save_to_disk) nor a directory of "
                    f"data files the datasets library reads: {' '.join(str(e).split())[:300]}") from None


def rows(spec: str, dataset: Any, keys: Sequence[str], progress: Callable[[int], None],
         batch_size: int = 1024) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, {key: value}) per row, columns other than ``keys`` not read. ``progress`` gets the
    characters of the texts read (a dataset's bytes on disk are not its text's)."""
    columns = getattr(dataset, "column_names", None) or list(keys)
    present = [k for k in keys if k in columns]
    if hasattr(dataset, "select_columns") and present:
        dataset = dataset.select_columns(present)
    row = 0
    for batch in dataset.iter(batch_size=batch_size):
        n = len(next(iter(batch.values()))) if batch else 0
        size = 0
        for i in range(n):
            row += 1
            values = {k: batch[k][i] for k in present}
            size += sum(len(v) for v in values.values() if isinstance(v, str))
            yield f"{spec}:row {row}", values
        progress(size)
