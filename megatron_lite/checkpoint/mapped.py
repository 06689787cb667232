"""Weight files a reader maps and reads from long after it checked them (a checkpoint's rank
files, a Hugging Face model's safetensors), while a run builds its model parameter by parameter.

A mapped file changed in place meanwhile would not fail cleanly: one cut short faults with
SIGBUS when its missing pages are touched, which kills the process without a word (and leaves
its peers waiting), and one rewritten in place hands over other weights than the ones checked.
``MappedFiles.check`` compares each file with what was seen when it was opened, before its pages
are read, and names a change. A file deleted, or replaced by another under its name (a rename:
a new download, a new save), is not a change here: the pages mapped are still the checked ones.
What is left is the moment between the check and the read.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from megatron_lite.checkpoint import store
from megatron_lite.checkpoint.shards import Assembler
from megatron_lite.model.transformer import VOCAB_PARAMETERS


class FileChangedError(OSError):
    """A mapped weight file was changed in place after it was opened."""


class MappedFiles:
    """What each mapped file was when it was opened (device, inode, size, modification time)."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, int, int, int]] = {}

    def add(self, file: Path | str) -> None:
        """Record ``file`` as it is now (call right after mapping it)."""
        st = os.stat(file)
        self._seen[str(file)] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def check(self, files: Iterable[str]) -> None:
        """``FileChangedError`` naming the first of ``files`` (as given to ``add``) changed in
        place since it was added."""
        for file in files:
            dev, ino, size, mtime = self._seen[file]
            try:
                st = os.stat(file)
            except FileNotFoundError:
                continue  # deleted: the mapping keeps the checked pages
            if (st.st_dev, st.st_ino) != (dev, ino):
                continue  # another file under the name: the mapping keeps the checked pages
            if st.st_size != size:
                raise FileChangedError(f"{file} was cut short or extended while this run read it "
                                       f"({size} bytes when opened, {st.st_size} now): something "
                                       "rewrote it in place; restore it and start the run again")
            if st.st_mtime_ns != mtime:
                raise FileChangedError(f"{file} was rewritten in place while this run read it: its "
                                       "weights may not be the ones checked; restore it and start "
                                       "the run again")


class CheckpointWeights(Mapping[str, torch.Tensor]):
    """A verified checkpoint's full fp32 weights by plain-model name, each assembled from its
    fragments when asked for: the rank files are memory-mapped, so a reader (each rank of a run
    starting from the checkpoint) holds the parameter it asked for, not the whole model. A rank
    file changed in place since it was verified is an error naming it (``mapped.py``)."""

    def __init__(self, path: Path, assembler: Assembler, vocab_size: int, files: MappedFiles,
                 files_of: dict[str, set[str]]):
        self.path, self._assembler, self._vocab = path, assembler, vocab_size
        self._files, self._files_of = files, files_of
        self._names = sorted(assembler.names())
        # The last one assembled, kept until another is asked for: ZeRO-3's tiles each ask for
        # their parameter whole.
        self._last: tuple[str, torch.Tensor] | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._last is not None and self._last[0] == name:
            return self._last[1]
        if name not in self:
            raise KeyError(name)
        self._last = None
        parts = self._assembler.merged.get(name, (name,))
        self._files.check(sorted({f for part in parts for f in self._files_of[part]}))
        try:
            full = self._assembler.full(name, "param")
        except (KeyError, ValueError) as e:
            raise store.CheckpointError(f"{self.path}: {e}") from None
        # The manifest's vocab_size is the tokenizer's; the rows past it are one layout's padding.
        value = full[:self._vocab] if name in VOCAB_PARAMETERS else full
        self._last = (name, value)
        return value

    def __contains__(self, name: object) -> bool:
        return name in self._assembler.names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        """``name``'s shape as ``self[name]`` has it, without assembling it."""
        shape = self._assembler.shape(name)
        return (min(shape[0], self._vocab), *shape[1:]) if name in VOCAB_PARAMETERS else shape
