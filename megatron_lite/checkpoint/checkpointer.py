"""Saving and resuming a run: every rank writes its own state in parallel, rank 0 commits.

Collective: every rank calls ``save`` and ``load`` at the same step; a failure on any rank is
raised on every rank (nothing hangs), and a failed save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import dataclasses
import platform
import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megatron_lite.checkpoint import store
from megatron_lite.checkpoint.host_copy import HostCopies
from megatron_lite.checkpoint.shards import (
    Assembler,
    file_fragments,
    fragment_index,
    has_fragment_index,
    load_fragments,
    local_fragments,
    needed_files,
    shape_mismatches,
)
from megatron_lite.checkpoint.store import CheckpointError
from megatron_lite.config import Config, to_yaml
from megatron_lite.config.schema import ModelConfig
from megatron_lite.distributed.collectives import (
    all_gather_object,
    broadcast_object,
    on_one_rank_then_all,
    raise_together,
)
from megatron_lite.distributed.deepspeed_internals import torch_optimizer
from megatron_lite.distributed.parallel_dims import ParallelDims
from megatron_lite.distributed.shard_spec import spec
from megatron_lite.optim.schedule import LRSchedule, ScheduledLR

# Fields that make a checkpoint's weights mean something: loading into a model that differs in
# any of them is refused (checkpoint.strict_model=false overrides).
ARCHITECTURE = ModelConfig.ARCHITECTURE


def architecture(cfg: ModelConfig) -> dict:
    """The ``ARCHITECTURE`` fields of ``cfg``, resolved (defaults that derive a size filled in).
    ``vocab_size`` is the tokenizer's: the padding differs per tensor-parallel size and its rows
    are zero, so a checkpoint moves between sizes exactly."""
    out = {k: getattr(cfg, k) for k in ARCHITECTURE}
    out["vocab_size"] = cfg.tokenizer_vocab_size or cfg.vocab_size
    out["n_kv_heads"] = cfg.kv_heads
    out["ffn_hidden"] = cfg.mlp_hidden
    return out


def _numpy_rng_state() -> tuple:
    """numpy's global RNG state in plain types (the key as a tensor): what the weights-only
    loader reads without allow-listing numpy."""
    name, key, pos, has_gauss, cached = np.random.get_state()
    return name, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(cached)


def _adam_step(engine) -> float:
    for state in torch_optimizer(engine).state.values():
        if "step" in state:
            return float(state["step"])
    return 0.0


def _set_adam_step(engine, step: float) -> None:
    for state in torch_optimizer(engine).state.values():
        if "step" in state:
            old = state["step"]
            state["step"] = (torch.full_like(old, step) if isinstance(old, torch.Tensor) else step)


@dataclass(frozen=True)
class Loaded:
    """What ``Checkpointer.load`` restored."""

    step: int
    consumed_samples: int
    extra: dict | None
    """The trainer state given to ``save(extra=...)`` (None in checkpoints without it)."""
    path: Path


def as_checkpoint_error(context: str) -> Callable[[Exception], BaseException]:
    """For ``on_one_rank_then_all``'s ``fail``: a ``CheckpointError`` stays as it is; any other
    failure becomes one, ``CONTEXT: error``."""
    return lambda e: e if isinstance(e, CheckpointError) else CheckpointError(f"{context}: {e}")


class Checkpointer:
    def __init__(self, cfg: Config, dims: ParallelDims, acc, engine, model_cfg: ModelConfig,
                 log: Callable[[str], None]):
        self.cfg, self.dims, self.acc, self.engine = cfg, dims, acc, engine
        self.model_cfg, self.log = model_cfg, log
        self.root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
        self._pending: tuple[threading.Thread, dict] | None = None
        self._lock = None  # rank 0's open lock file on the directory (store.claim)
        self.host = HostCopies(acc)  # host buffers kept from save to save

    def claim(self) -> None:
        """Collective, before the first load or save: rank 0 locks the directory for this run
        and, under ``checkpoint.resume=false``, refuses one holding another run's checkpoints."""
        def take() -> None:
            self._lock, warning = store.claim(self.root, fresh=not self.cfg.checkpoint.resume)
            if warning:
                self.log(warning)

        on_one_rank_then_all(take, self.dims, "claiming the checkpoint directory",
                             fail=as_checkpoint_error(f"cannot use checkpoint.dir {self.root}"))

    def _topology(self) -> dict:
        d = self.dims
        return {"world_size": d.world_size, "tensor": d.tensor, "pipeline": d.pipeline, "data": d.data,
                "ulysses": d.ulysses, "zero_stage": self.cfg.parallel.deepspeed_zero_stage}

    # ---------------------------------------------------------------- save
    def _rank_state(self, step: int, extra: dict | None) -> dict:
        self.host.begin()
        try:
            fragments = local_fragments(self.engine, self.dims, self.host.copy)
        finally:
            self.host.end()
        state = {
            "rank": self.dims.rank,
            "fragments": [f.to_dict() for f in fragments],
            "rng": {"python": random.getstate(), "numpy": _numpy_rng_state(),
                    "torch": torch.get_rng_state(),
                    "device": self.acc.get_rng_state() if self.acc.device_name() != "cpu" else None},
        }
        if self.dims.rank == 0:
            engine = self.engine
            state["trainer"] = {
                "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
                "schedule": (engine.lr_scheduler.schedule.to_dict()
                             if isinstance(engine.lr_scheduler, ScheduledLR) else None),
                "adam_step": _adam_step(engine),
                "global_steps": engine.global_steps, "global_samples": engine.global_samples,
                "extra": extra,
            }
        return state

    def _manifest(self, step: int, consumed_samples: int, files: list[dict]) -> dict:
        import deepspeed

        return {
            "format": store.FORMAT_VERSION, "step": step, "consumed_samples": consumed_samples,
            "consumed_tokens": consumed_samples * self.cfg.data.seq_length,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "topology": self._topology(),
            "model": architecture(self.model_cfg),
            "data": {"seq_length": self.cfg.data.seq_length, "tokenizer": self.cfg.data.tokenizer.type},
            "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                         "python": platform.python_version()},
            "files": files,
            "config": to_yaml(self.cfg),
        }

    def save(self, step: int, consumed_samples: int, background: bool = False,
             extra: dict | None = None) -> Path | None:
        """Collective. Snapshots this rank's state to host memory, then writes and commits it:
        here (returns the committed directory), or with ``background`` in a thread while training
        goes on (returns None; ``wait`` gives the outcome). A failure on any rank raises
        ``CheckpointError`` on every rank; the partial directory is removed, ``latest`` untouched.
        ``extra``: more trainer state (rank 0's is kept), given back by ``load``.
        """
        assert self.root is not None
        if self._pending is not None:
            raise RuntimeError("a background save is still in flight: call wait() first")
        root, rank = self.root, self.dims.rank
        tmp = root / f".tmp-{store.step_name(step)}"
        def make() -> None:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()

        on_one_rank_then_all(make, self.dims, "creating the checkpoint directory",
                             fail=as_checkpoint_error(f"cannot create {tmp}"))
        try:
            snapshot, error_text = self._rank_state(step, extra), None
        except Exception as e:  # reported on every rank by _write_and_commit
            snapshot, error_text = None, f"rank {rank}: {type(e).__name__}: {e}"
        if not background:
            return self._write_and_commit(step, consumed_samples, tmp, snapshot, error_text, None)

        # The writer's collectives use a gloo group of their own, so they never interleave with
        # the training step's.
        group = self.dims.group("checkpoint")
        outcome: dict = {}

        def work() -> None:
            try:
                outcome["path"] = self._write_and_commit(step, consumed_samples, tmp, snapshot,
                                                         error_text, group)
                self.log(f"saved checkpoint {outcome['path']} (in the background)")
            except BaseException as e:  # handed to wait()
                outcome["error"] = e

        thread = threading.Thread(target=work, name=f"checkpoint-{step}", daemon=True)
        thread.start()
        self._pending = (thread, outcome)
        return None

    def wait(self) -> Path | None:
        """Finish the background save in flight, if any: its directory, or its error raised."""
        if self._pending is None:
            return None
        thread, outcome = self._pending
        thread.join()
        self._pending = None
        if "error" in outcome:
            raise outcome["error"]
        return outcome["path"]

    def _write_and_commit(self, step: int, consumed_samples: int, tmp: Path, snapshot: dict | None,
                          error_text: str | None, group) -> Path:
        root, rank = self.root, self.dims.rank
        try:
            self.host.wait()  # the copies into the host buffers are complete
            index = []
            if snapshot is not None:  # the files hold fp32 whatever the buffers' dtype
                for fragment in snapshot["fragments"]:
                    fragment["tensors"] = {k: t.float() for k, t in fragment["tensors"].items()}
                index = fragment_index(snapshot["fragments"])
            data = store.serialize(snapshot) if snapshot is not None else b""
        except Exception as e:
            data, error_text, index = b"", f"rank {rank}: {type(e).__name__}: {e}", []
        dims = self.dims
        sizes = all_gather_object((len(data), error_text), dims, "the checkpoint sizes", group)
        failed = [err for _, err in sizes if err]
        if not failed and rank == 0 and self.cfg.checkpoint.check_free_space:
            need = sum(n for n, _ in sizes)
            try:
                free = shutil.disk_usage(tmp).free
            except OSError as e:
                failed = [f"cannot read the free space of {tmp}: {e}"]
            else:
                if free < need + max(need // 20, 1 << 20):  # 5% (at least 1 MiB) to spare
                    failed = [f"not enough free space in {root}: the checkpoint needs "
                              f"{need / 2**20:.1f} MiB, {free / 2**20:.1f} MiB are free"]
        failed = broadcast_object(failed, dims, "the checkpoint space check", group)
        if not failed:
            try:
                entry = {"ok": True, **store.write_rank_bytes(tmp, rank, data), "fragments": index}
            except Exception as e:  # ENOSPC, EIO, ...: reported on every rank below
                entry = {"ok": False, "error": f"rank {rank}: {type(e).__name__}: {e}"}
            entries = all_gather_object(entry, dims, "the checkpoint write votes", group)
            failed = [e["error"] for e in entries if not e["ok"]]
        if not failed and rank == 0:
            try:
                files = [{k: e[k] for k in ("name", "bytes", "sha256", "fragments")} for e in entries]
                store.commit(root, tmp, self._manifest(step, consumed_samples, files))
            except Exception as e:  # rank 0 alone: reported on every rank by the broadcast below
                failed = [f"committing: {type(e).__name__}: {e}"]
            else:
                try:
                    self._apply_retention(step)
                except Exception as e:  # the new checkpoint is committed: only old ones stay
                    self.log(f"warning: retention after step {step} failed ({type(e).__name__}: {e}); "
                             "older checkpoints are kept")
        failed = broadcast_object(failed, dims, "the checkpoint commit", group)
        if failed:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"saving step {step} to {root} failed; the previous checkpoint is "
                                  "kept:\n  " + "\n  ".join(failed))
        return root / store.step_name(step)

    def _apply_retention(self, newest: int) -> None:
        ck = self.cfg.checkpoint
        dirs = {store.step_of(p): p for p in store.committed_steps(self.root)}
        keep = store.retained(list(dirs), ck.keep_last, ck.keep_every, protect={newest})
        for step, path in dirs.items():
            if step not in keep:
                shutil.rmtree(path, ignore_errors=True)

    # ---------------------------------------------------------------- load
    def _candidates(self) -> list[tuple[Path, dict]]:
        """Rank 0: the checkpoints to resume from, in order of preference, with their manifests
        (``latest``; with ``checkpoint.load_fallback`` every other committed one, newest first)."""
        ck = self.cfg.checkpoint
        root = self.root
        if root is None or not root.is_dir():
            return []
        for stale in store.remove_stale(root):
            self.log(f"removed an incomplete save: {stale}")
        paths: list[Path] = []
        try:
            latest = store.read_latest(root)
            if latest is not None:
                paths.append(latest)
                # Newer committed ones: a rollback interrupted between repointing `latest` and
                # moving them, or a crash between a commit and its `latest`. Left here, retention
                # would count them as this run's newest saves and delete the run's own.
                for moved in store.abandon_after(root, latest, "newer-than-latest"):
                    self.log(f"warning: a checkpoint newer than '{store.LATEST}' was moved aside to {moved}")
            elif store.committed_steps(root):
                raise CheckpointError(f"{root} has checkpoints but no '{store.LATEST}' pointer")
        except CheckpointError as e:
            if not ck.load_fallback:
                raise CheckpointError(f"{e}; set checkpoint.load_fallback=true to resume from the "
                                      "newest valid checkpoint instead") from None
            self.log(f"warning: {e}; falling back to the newest valid checkpoint")
        if ck.load_fallback:
            paths += [p for p in store.committed_steps(root) if p not in paths]
        candidates = []
        for path in paths:
            try:
                candidates.append((path, store.read_manifest(path, store.RESUME_SECTIONS)))
            except CheckpointError as e:
                if not ck.load_fallback:
                    raise CheckpointError(f"cannot resume: {e}. Set checkpoint.load_fallback=true to "
                                          "resume from the newest valid checkpoint instead") from None
                self.log(f"warning: skipping {path}: {e}")
        if paths and not candidates:
            raise CheckpointError(f"no valid checkpoint in {root}")
        return candidates

    def _verify_shared(self, path: Path, manifest: dict) -> str | None:
        """Collective (control group). Each rank hashes its share of the files (its own file when
        the layout is unchanged), so verifying takes one rank's share of the time, not the whole
        checkpoint's on rank 0 while the others wait. Returns the first problem found on any
        rank (the same on every rank), or None."""
        share = manifest["files"][self.dims.rank::self.dims.world_size]
        problem = None
        try:
            store.verify(path, manifest, share)
        except CheckpointError as e:
            # Which rank saw it: on a shared filesystem, which node's view of the file is bad.
            problem = f"{e} (checked by rank {self.dims.rank})" if self.dims.world_size > 1 else str(e)
        except Exception as e:  # anything else stays a verdict, never one rank's exception
            problem = f"verifying {path} failed on rank {self.dims.rank}: {type(e).__name__}: {e}"
        return next((p for p in all_gather_object(problem, self.dims, "verifying the checkpoint") if p),
                    None)

    def _first_valid(self, candidates: list[tuple[Path, dict]], strict: bool,
                     required: bool = True) -> tuple[Path, dict] | None:
        """Collective: the first candidate whose files all verify. ``strict``: a bad one is an
        error (on every rank) rather than skipped; ``required``: so is finding none among them."""
        for path, manifest in candidates:
            problem = self._verify_shared(path, manifest)
            if problem is None:
                return path, manifest
            if strict:
                raise CheckpointError(f"cannot resume: {problem}. Set checkpoint.load_fallback=true "
                                      "to resume from the newest valid checkpoint instead")
            self.log(f"warning: skipping {path}: {problem}")
        if candidates and required:
            raise CheckpointError(f"no valid checkpoint in {self.root}")
        return None

    def _check_architecture(self, manifest: dict, path: Path) -> None:
        saved, current = manifest["model"], architecture(self.model_cfg)
        # A field added to the architecture after the checkpoint was written had its default.
        defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
        saved = {k: saved.get(k, defaults[k]) for k in ARCHITECTURE}
        diff = [f"model.{k}: checkpoint {saved[k]!r}, recipe {current[k]!r}"
                for k in ARCHITECTURE if saved[k] != current[k]]
        saved_length = manifest["data"].get("seq_length")
        if saved_length is not None and saved_length != self.cfg.data.seq_length:
            diff.append(f"data.seq_length: checkpoint {saved_length}, recipe {self.cfg.data.seq_length}")
        if diff and self.cfg.checkpoint.strict_model:
            raise CheckpointError(f"{path} was written for a different model:\n  " + "\n  ".join(diff)
                                  + "\nset checkpoint.strict_model=false to load it anyway")

    def _schedule_to_follow(self, saved: dict | None, running: LRSchedule, step: int, path: Path,
                            resuming: bool) -> LRSchedule:
        """The learning-rate schedule to go on with: the running one (the recipe's, at a resume),
        unless a resumed checkpoint's gives another rate at some step still to come — then
        ``schedule.on_resume`` decides, as
        Megatron-LM's --use-checkpoint-opt_param-scheduler / --override-opt_param-scheduler do;
        by default the run is refused rather than mix two schedules. (Every rank reads the same
        rank-0 state, so every rank decides alike.)"""
        if saved is None or not resuming:  # a rollback continues the run's own schedule
            return running
        theirs = LRSchedule(**saved)
        if theirs == running or theirs.same_rates_from(running, step):
            return running  # no step from here on would get another rate
        diff = "; ".join(theirs.differences(running))
        mode = self.cfg.schedule.on_resume
        if mode == "check":
            raise CheckpointError(
                f"the recipe's learning-rate schedule differs from {path}'s ({diff}): set "
                "schedule.on_resume=checkpoint to continue the checkpoint's schedule, or "
                f"schedule.on_resume=recipe to switch to the recipe's from step {step} (the rate goes "
                f"from {theirs.at(step):.4g} to {running.at(step):.4g})")
        chosen = theirs if mode == "checkpoint" else running
        self.log(f"learning-rate schedule: the {mode}'s from step {step} (schedule.on_resume={mode}; "
                 f"checkpoint -> recipe: {diff}); next rate {chosen.at(step):.4g}")
        return chosen

    def rollback_history(self, resuming: bool) -> list[dict]:
        """Collective. The rollbacks recorded with the checkpoints (``store.ROLLBACKS``), the
        same on every rank; on a fresh start an old history is set aside and [] returned."""
        def read() -> list[dict]:
            if self.root is None or not self.root.is_dir():
                return []
            if resuming:
                return store.read_rollbacks(self.root)
            if (old := store.set_aside_rollbacks(self.root)) is not None:
                self.log(f"{self.root / store.ROLLBACKS} from an earlier run moved to {old}")
            return []

        return on_one_rank_then_all(
            read, self.dims, "reading the rollback history", share=True,
            fail=as_checkpoint_error(f"cannot read or move the rollback history in {self.root}"))

    def record_rollback(self, record: dict) -> None:
        """Collective, before anything is moved or reloaded: rank 0 adds ``record`` to the
        history kept with the checkpoints, so the skipped data window and the rollback count
        survive a crash and a changed ``logging.dir``."""
        assert self.root is not None
        history = self.root / store.ROLLBACKS
        on_one_rank_then_all(
            lambda: store.append_rollback(self.root, record), self.dims, "recording the rollback",
            fail=lambda e: CheckpointError(f"cannot record the rollback in {history}: {e}"))

    def rollback_target(self, newest_step: int) -> tuple[Path, int, int] | None:
        """Collective. The newest committed, verified checkpoint at or before ``newest_step``:
        its path, step and data position."""
        def listed() -> list[tuple[Path, dict]]:
            out = []
            if self.root is None or not self.root.is_dir():
                return out
            for path in store.committed_steps(self.root):
                try:
                    manifest = store.read_manifest(path, store.RESUME_SECTIONS)
                except Exception as e:  # one unreadable checkpoint: the others may do
                    self.log(f"warning: not rolling back to {path}: {e}")
                    continue
                if manifest["step"] <= newest_step:
                    out.append((path, manifest))
            return out

        candidates = on_one_rank_then_all(
            listed, self.dims, "listing the rollback candidates", share=True,
            fail=as_checkpoint_error(f"cannot list the checkpoints in {self.root}"))
        found = self._first_valid(candidates, strict=False, required=False)
        if found is None:
            return None
        path, manifest = found
        return path, manifest["step"], manifest["consumed_samples"]

    def abandon_after(self, path: Path, reason: str) -> list[Path]:
        """Collective. Make ``path`` the latest checkpoint: newer ones are moved (not deleted)
        to ``abandoned/`` so neither a resume nor retention picks them up."""
        return on_one_rank_then_all(
            lambda: store.abandon_after(self.root, path, reason), self.dims,
            "moving newer checkpoints aside", share=True,
            fail=as_checkpoint_error(f"cannot move checkpoints newer than {path} aside"))

    def load(self, target: Path | None = None) -> Loaded | None:
        """Collective. Loads the checkpoint to resume from (``target``: that one, already
        verified by ``rollback_target``) and returns what the trainer needs of it; None for a
        fresh start."""
        def choices() -> list[tuple[Path, dict]]:
            if target is not None:
                return [(target, store.read_manifest(target, store.RESUME_SECTIONS))]
            return self._candidates()

        candidates = on_one_rank_then_all(
            choices, self.dims, "choosing the checkpoint to load", share=True,
            fail=lambda e: e if isinstance(e, CheckpointError) else CheckpointError(
                f"choosing the checkpoint in {self.root} failed: {type(e).__name__}: {e}"))
        if target is not None:
            chosen = candidates[0]
        else:
            chosen = self._first_valid(candidates, strict=not self.cfg.checkpoint.load_fallback)
        if chosen is None:
            return None
        path, manifest = chosen
        on_one_rank_then_all(lambda: self._check_architecture(manifest, path), self.dims,
                             "checking the checkpoint's model",
                             fail=as_checkpoint_error(f"checking {path}'s model failed"))
        states = {}
        error = None
        same_layout = self._topology() == manifest["topology"]
        try:
            # Only the files holding what this rank's parameters need (by the manifest's index
            # of fragments), rank 0's (the trainer's state) and, same layout, its own (its RNG):
            # not every rank reading every file.
            always = [store.rank_file(0), *([store.rank_file(self.dims.rank)] if same_layout else [])]
            wanted = (needed_files(manifest["files"], self.engine.module, always)
                      if has_fragment_index(manifest["files"]) else None)
            fragments = []
            for entry in manifest["files"] if wanted is None else wanted:
                file = store.listed_file(path, entry)
                states[entry["name"]] = store.load_rank_file(file)
                try:
                    fragments += file_fragments(states[entry["name"]], file.stat().st_size)
                except ValueError as e:
                    raise CheckpointError(f"{file}: {e}") from None
            assembler = Assembler(fragments, complete=wanted is None)
            # Before anything is assembled: a manifest whose model section does not describe its
            # weights (or strict_model=false) is refused by name, not as a size error midway.
            mismatched = shape_mismatches(
                {spec(p).name: spec(p).full_shape for p in self.engine.module.parameters()}, assembler,
                self.model_cfg.tokenizer_vocab_size or self.model_cfg.vocab_size)
            if mismatched:
                more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
                raise CheckpointError(f"its weights do not fit this model: {mismatched[0]}{more}; "
                                      "resume with the recipe it was written with")
            load_fragments(self.engine, assembler, manifest["step"])
        except Exception as e:
            error = CheckpointError(f"loading {path} failed on rank {self.dims.rank}: {e}")
        raise_together(error, self.dims, "loading the checkpoint")

        trainer = states[store.rank_file(0)]["trainer"]
        engine = self.engine
        scheduler = engine.lr_scheduler
        if isinstance(scheduler, ScheduledLR) and trainer["scheduler"] is not None:
            scheduler.load_state_dict(trainer["scheduler"])
            # Also sets the rate on the optimizer, which the scheduler's state does not hold.
            scheduler.follow(self._schedule_to_follow(trainer.get("schedule"), scheduler.schedule,
                                                      manifest["step"], path, resuming=target is None))
        _set_adam_step(engine, trainer["adam_step"])
        engine.global_steps, engine.global_samples = trainer["global_steps"], trainer["global_samples"]
        own = states.get(store.rank_file(self.dims.rank))
        if same_layout and own is not None and own["rng"] is not None:
            rng = own["rng"]
            random.setstate(rng["python"])
            name, key, *rest = rng["numpy"]
            np.random.set_state((name, np.asarray(key, dtype=np.uint32), *rest))
            torch.set_rng_state(rng["torch"])
            if rng["device"] is not None:
                self.acc.set_rng_state(rng["device"])
        self.log(f"{'resumed from' if target is None else 'reloaded'} {path} at step {manifest['step']}"
                 + ("" if same_layout else f" (saved with layout {manifest['topology']})"))
        return Loaded(manifest["step"], manifest["consumed_samples"], trainer.get("extra"), path)
