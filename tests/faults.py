"""Fault injection for the tests, by wrapping the project's own functions in test processes.

Loaded by ``tests/dist_harness/sitecustomize.py`` (on the PYTHONPATH of every process the tests
start, never on a real run's), so nothing here can alter a real run. Each variable wraps one
function right after its module is imported:

- ``FAULT_BAD_SAMPLES=START:END[,START:END...]``: training samples START..END-1 (global
  indices, as ``spikes.jsonl`` names them) are uniformly random tokens, as from a corrupt shard.
- ``FAULT_NAN_LOSS=STEP[:RANK]``: the first micro-batch loss of step STEP is NaN on RANK (every
  rank without it).
- ``FAULT_KILL_AT=after_rank_file[:RANK]`` or ``before_latest``: the process kills itself
  (SIGKILL) at every save, after its rank file is written (commit not done), or after the
  commit but before ``latest`` moves.
- ``FAULT_SLOW_SAVE=SECONDS``: every rank file is written SECONDS late (a slow filesystem;
  keeps a background save in flight).
- ``FAULT_SAVE_ENOSPC=STEP[,STEP...]``: the first save of each of those steps fails with
  ENOSPC (a full checkpoint filesystem at those moments; every rank's file).
- ``FAULT_SAMPLE_ERROR=TOKEN[:RANK]``: picking the TOKEN-th token of a text sample (counted over
  the run, from 1; after the model's forward) raises on RANK (every rank without it).
- ``FAULT_KILL_TOKENIZER_ON=TEXT``: a preprocessing worker process SIGKILLs itself when its batch
  holds TEXT (the out-of-memory killer on a huge line).
- ``FAULT_SLOW_DATA=START:END:SECONDS[:RANK]``: reading each of training samples START..END-1
  takes SECONDS longer on RANK (every rank without it): a slow filesystem or data loader.
- ``FAULT_STALL_LOG=N:SECONDS[:RANK]``: RANK (every rank without it) sleeps SECONDS before its
  N-th log line's records (``Trainer._train_record``), so before that line's collectives: a
  rank stuck in its own work while the others wait for it.
- ``FAULT_LOG_ENOSPC=1``: writing ``metrics.jsonl`` or ``spikes.jsonl`` fails with ENOSPC (a
  full disk under the run directory, rank 0's alone).
- ``FAULT_DISK_SIZE=BYTES:DIR``: DIR behaves as a filesystem of BYTES: the free space the
  checkpointer asks for is BYTES less what DIR holds, and writing a rank file that would not fit
  fails with ENOSPC (the disk-full tests where no size-limited filesystem can be mounted).

Not faults, by the same mechanism:

- ``RECORD_RANK_FILE_READS=DIR``: every checkpoint rank file a rank opens to load is named in
  ``DIR/rank{RANK}.txt``, one line each.
- ``RECORD_STEP_SYNCS=DIR``: ``DIR/rank{RANK}.json`` lists, for each training step (from one
  ``Trainer.train_step`` call to the next, so a step's log line, evaluation and save count with
  it), the reads of a tensor's value by the training thread (``item``, ``float``, ``int``,
  ``bool``, ``tolist``: each a wait for the device on an accelerator), and the host-control
  collectives (what each agreed on). Reads inside the host collectives and of the step report's
  host buffer (training/step_report.py) are host memory and are not counted.
"""

from __future__ import annotations

import errno
import functools
import importlib.abc
import importlib.util
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

Hook = Callable[[object], None]


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``hooks[name](module)`` right after module ``name`` is executed."""

    def __init__(self, hooks: dict[str, list[Hook]]):
        self.hooks = hooks

    def find_spec(self, name, path, target=None):
        if name not in self.hooks:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        execute = spec.loader.exec_module

        def exec_and_patch(module):
            execute(module)
            for hook in self.hooks[name]:
                hook(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def after_import(name: str, hook: Hook) -> None:
    """Run ``hook(module)`` right after module ``name`` is first executed in this process."""
    sys.meta_path.insert(0, _AfterImport({name: [hook]}))


def _ranges(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in part.split(":")) for part in text.split(",")]


def _bad_samples(run) -> None:
    import torch

    ranges = _ranges(os.environ["FAULT_BAD_SAMPLES"])

    class NoisySamples(torch.utils.data.Dataset):
        def __init__(self, dataset, vocab_size: int):
            self.dataset, self.vocab_size = dataset, vocab_size

        def __len__(self) -> int:
            return len(self.dataset)

        def __getitem__(self, i: int):
            sample = self.dataset[i]
            if not any(start <= i < end for start, end in ranges):
                return sample
            g = torch.Generator().manual_seed(i)
            return torch.randint(0, self.vocab_size, sample.shape, generator=g, dtype=sample.dtype)

        def locate(self, i: int) -> dict:
            return self.dataset.locate(i)

    build_data = run.build_data

    @functools.wraps(build_data)
    def noisy_build_data(*args, **kwargs):
        data = build_data(*args, **kwargs)
        if data is not None and getattr(data, "train", None) is not None:
            data.train = NoisySamples(data.train, data.tokenizer.vocab_size)
        return data

    run.build_data = noisy_build_data


def _slow_data(run) -> None:
    start, end, seconds, *rank = os.environ["FAULT_SLOW_DATA"].split(":")
    start, end, seconds = int(start), int(end), float(seconds)
    if rank and int(rank[0]) != int(os.environ.get("RANK", "0")):
        return

    class SlowSamples:
        def __init__(self, dataset):
            self.dataset = dataset

        def __len__(self) -> int:
            return len(self.dataset)

        def __getitem__(self, i: int):
            if start <= i < end:
                time.sleep(seconds)
            return self.dataset[i]

        def __getattr__(self, name):  # locate() and the rest of the dataset's interface
            if name == "dataset":  # not set yet (unpickling in a loader worker)
                raise AttributeError(name)
            return getattr(self.dataset, name)

    build_data = run.build_data

    @functools.wraps(build_data)
    def slow_build_data(*args, **kwargs):
        data = build_data(*args, **kwargs)
        if data is not None and getattr(data, "train", None) is not None:
            data.train = SlowSamples(data.train)
        return data

    run.build_data = slow_build_data


def _nan_loss(trainer_module) -> None:
    wanted, _, only = os.environ["FAULT_NAN_LOSS"].partition(":")
    trainer = trainer_module.Trainer
    train_step = trainer.train_step

    @functools.wraps(train_step)
    def train_step_with_nan(self, batches):
        step = self.state.step + 1
        if step != int(wanted) or (only and int(only) != self.dims.rank) or self.step_runner.pipelined:
            return train_step(self, batches)
        engine, calls = self.engine, []
        forward = engine.forward

        def first_loss_nan(*args, **kwargs):
            loss = forward(*args, **kwargs)
            calls.append(1)
            return loss * float("nan") if len(calls) == 1 else loss

        engine.forward = first_loss_nan
        try:
            return train_step(self, batches)
        finally:
            del engine.forward

    trainer.train_step = train_step_with_nan


def _stall_log(trainer_module) -> None:
    nth, seconds, *rank = os.environ["FAULT_STALL_LOG"].split(":")
    if rank and int(rank[0]) != int(os.environ.get("RANK", "0")):
        return
    trainer = trainer_module.Trainer
    train_record, calls = trainer._train_record, []

    @functools.wraps(train_record)
    def stalled_record(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == int(nth):
            print(f"[fault] rank {self.dims.rank} stalls {seconds} s before its log line's "
                  "collectives", flush=True)
            time.sleep(float(seconds))
        return train_record(self, *args, **kwargs)

    trainer._train_record = stalled_record


def _kill_at(store) -> None:
    wanted = os.environ["FAULT_KILL_AT"]
    write_rank_bytes, write_bytes_durably = store.write_rank_bytes, store.write_bytes_durably

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    @functools.wraps(write_rank_bytes)
    def write_then_die(directory, rank, data):
        entry = write_rank_bytes(directory, rank, data)
        if wanted in ("after_rank_file", f"after_rank_file:{rank}"):
            die()
        return entry

    @functools.wraps(write_bytes_durably)
    def die_before_latest(path: Path, data: bytes):
        if wanted == "before_latest" and path.name == store.LATEST:
            die()
        return write_bytes_durably(path, data)

    store.write_rank_bytes, store.write_bytes_durably = write_then_die, die_before_latest


def _slow_save(store) -> None:
    seconds = float(os.environ["FAULT_SLOW_SAVE"])
    write_rank_bytes = store.write_rank_bytes

    @functools.wraps(write_rank_bytes)
    def slow_write(directory, rank, data):
        time.sleep(seconds)
        return write_rank_bytes(directory, rank, data)

    store.write_rank_bytes = slow_write


def _save_enospc(store) -> None:
    steps = {int(x) for x in os.environ["FAULT_SAVE_ENOSPC"].split(",")}
    write_rank_bytes = store.write_rank_bytes

    @functools.wraps(write_rank_bytes)
    def write_unless_full(directory, rank, data):
        step = int(Path(directory).name.rpartition("_")[2])
        if step in steps:
            steps.discard(step)
            _no_space()
        return write_rank_bytes(directory, rank, data)

    store.write_rank_bytes = write_unless_full


def _disk_size(store) -> None:
    import shutil

    size, _, root = os.environ["FAULT_DISK_SIZE"].partition(":")
    size, root = int(size), Path(root).resolve()

    def used() -> int:
        return sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())

    def inside(path) -> bool:
        return Path(path).resolve().is_relative_to(root)

    disk_usage = shutil.disk_usage

    def small_disk_usage(path):
        if not inside(path):
            return disk_usage(path)
        taken = used()
        return disk_usage(path)._replace(total=size, used=taken, free=max(size - taken, 0))

    shutil.disk_usage = small_disk_usage
    write_rank_bytes = store.write_rank_bytes

    @functools.wraps(write_rank_bytes)
    def write_if_it_fits(directory, rank, data):
        if inside(directory) and used() + len(data) > size:
            _no_space()
        return write_rank_bytes(directory, rank, data)

    store.write_rank_bytes = write_if_it_fits


def _kill_tokenizer_on(preprocess) -> None:
    wanted = os.environ["FAULT_KILL_TOKENIZER_ON"].encode()
    encode_batch = preprocess.encode_batch

    @functools.wraps(encode_batch)
    def encode_or_die(batch):
        if wanted in repr(batch).encode():
            os.kill(os.getpid(), signal.SIGKILL)
        return encode_batch(batch)

    preprocess.encode_batch = encode_or_die


def _sample_error(generate) -> None:
    token, *only = (int(x) for x in os.environ["FAULT_SAMPLE_ERROR"].split(":"))
    pick = generate.pick
    calls = 0

    @functools.wraps(pick)
    def broken_pick(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == token and (not only or only[0] == int(os.environ.get("RANK", "0"))):
            raise IndexError("list index out of range (injected)")
        return pick(*args, **kwargs)

    generate.pick = broken_pick


def _no_space(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _FullDiskFile:
    """A file object whose writes fail as on a full disk."""

    def __init__(self, file):
        self.file = file

    write = flush = staticmethod(_no_space)

    def close(self) -> None:
        self.file.close()


def _metrics_enospc(metrics) -> None:
    init = metrics.MetricsLogger.__init__

    @functools.wraps(init)
    def init_then_fill_the_disk(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self._jsonl is not None:
            self._jsonl = _FullDiskFile(self._jsonl)

    metrics.MetricsLogger.__init__ = init_then_fill_the_disk


def _spikes_enospc(tracker) -> None:
    def open_on_a_full_disk(path, mode="r", *args, **kwargs):
        if "a" in mode or "w" in mode:
            _no_space()
        return open(path, mode, *args, **kwargs)

    tracker.open = open_on_a_full_disk  # the module's name for the builtin


def _record_rank_file_reads(store) -> None:
    out = Path(os.environ["RECORD_RANK_FILE_READS"]) / f"rank{os.environ.get('RANK', '0')}.txt"
    load_rank_file = store.load_rank_file

    @functools.wraps(load_rank_file)
    def recorded(file):
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as f:
            f.write(f"{Path(file).name}\n")
        return load_rank_file(file)

    store.load_rank_file = recorded


def _record_step_syncs(trainer_module) -> None:
    import json
    import threading

    import torch

    from megatron_lite.distributed import collectives

    out = Path(os.environ["RECORD_STEP_SYNCS"]) / f"rank{os.environ.get('RANK', '0')}.json"
    steps: list[dict] = []
    training_thread = [None]
    host_memory = ("collectives.py", "step_report.py")

    def counted(name: str, method):
        @functools.wraps(method)
        def read(self, *args, **kwargs):
            if steps and threading.get_ident() == training_thread[0]:
                caller = sys._getframe(1)
                if not caller.f_code.co_filename.endswith(host_memory):
                    steps[-1]["reads"].append(f"{name} at {caller.f_code.co_filename}:{caller.f_lineno}")
            return method(self, *args, **kwargs)
        return read

    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__"):
        setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    agree = collectives._agree

    def agree_counted(what, fn, *args):
        if steps and threading.get_ident() == training_thread[0]:
            steps[-1]["host_collectives"].append(what)
        return agree(what, fn, *args)

    collectives._agree = agree_counted
    trainer = trainer_module.Trainer
    train, train_step = trainer.train, trainer.train_step

    @functools.wraps(train)
    def recorded_train(self):
        training_thread[0] = threading.get_ident()
        try:
            return train(self)
        finally:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(steps))

    @functools.wraps(train_step)
    def recorded_step(self, batches):
        steps.append({"step": self.state.step + 1, "reads": [], "host_collectives": []})
        return train_step(self, batches)

    trainer.train, trainer.train_step = recorded_train, recorded_step


FAULTS: dict[str, tuple[str, Hook]] = {
    "FAULT_BAD_SAMPLES": ("megatron_lite.training.run", _bad_samples),
    "FAULT_SLOW_DATA": ("megatron_lite.training.run", _slow_data),
    "FAULT_NAN_LOSS": ("megatron_lite.training.trainer", _nan_loss),
    "FAULT_STALL_LOG": ("megatron_lite.training.trainer", _stall_log),
    "FAULT_KILL_AT": ("megatron_lite.checkpoint.store", _kill_at),
    "FAULT_SLOW_SAVE": ("megatron_lite.checkpoint.store", _slow_save),
    "FAULT_SAVE_ENOSPC": ("megatron_lite.checkpoint.store", _save_enospc),
    "FAULT_DISK_SIZE": ("megatron_lite.checkpoint.store", _disk_size),
    "FAULT_SAMPLE_ERROR": ("megatron_lite.training.generate", _sample_error),
    "FAULT_KILL_TOKENIZER_ON": ("megatron_lite.data.preprocess.encode", _kill_tokenizer_on),
    "RECORD_RANK_FILE_READS": ("megatron_lite.checkpoint.store", _record_rank_file_reads),
    "RECORD_STEP_SYNCS": ("megatron_lite.training.trainer", _record_step_syncs),
}
LOG_FAULTS = {"FAULT_LOG_ENOSPC": [("megatron_lite.logging.metrics", _metrics_enospc),
                                   ("megatron_lite.spikes.tracker", _spikes_enospc)]}


def install() -> None:
    hooks: dict[str, list[Hook]] = {}
    wanted = [(v, m, h) for v, (m, h) in FAULTS.items()]
    wanted += [(v, m, h) for v, pairs in LOG_FAULTS.items() for m, h in pairs]
    for variable, module, hook in wanted:
        if os.environ.get(variable):
            hooks.setdefault(module, []).append(hook)
    if hooks:
        sys.meta_path.insert(0, _AfterImport(hooks))
