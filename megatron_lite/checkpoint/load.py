"""Loading: rank 0 chooses the checkpoint (``latest``, or with ``checkpoint.load_fallback`` the
newest one that verifies), every rank verifies its share of the files and reads only those its
parameters need; the model, the schedule and the random state are checked and restored."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from megatron_lite.checkpoint import store
from megatron_lite.checkpoint.context import CheckpointContext, as_checkpoint_error
from megatron_lite.checkpoint.manifest import RESUME_SECTIONS, listed_file, read_manifest, verify
from megatron_lite.checkpoint.run_state import EngineState, RngState
from megatron_lite.checkpoint.shard_index import has_fragment_index, lists_unfused, needed_files
from megatron_lite.checkpoint.shards import Assembler, file_fragments, load_fragments, shape_mismatches
from megatron_lite.checkpoint.store import CheckpointError
from megatron_lite.config.schema import ModelConfig
from megatron_lite.distributed.collectives import all_gather_object, on_one_rank_then_all, raise_together
from megatron_lite.distributed.shard_spec import spec
from megatron_lite.optim.schedule import ScheduleMismatch, schedule_to_follow

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


@dataclass(frozen=True)
class Loaded:
    """What ``Checkpointer.load`` restored."""

    step: int
    consumed_samples: int
    extra: dict | None
    """The trainer state given to ``save(extra=...)`` (None in checkpoints without it)."""
    path: Path


class CheckpointReader:
    def __init__(self, ctx: CheckpointContext):
        self.ctx = ctx
        self.cfg, self.dims, self.acc, self.engine, self.log = ctx.cfg, ctx.dims, ctx.acc, ctx.engine, ctx.log
        self.root = ctx.root

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
                candidates.append((path, read_manifest(path, RESUME_SECTIONS)))
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
            verify(path, manifest, share)
        except CheckpointError as e:
            # Which rank saw it: on a shared filesystem, which node's view of the file is bad.
            problem = f"{e} (checked by rank {self.dims.rank})" if self.dims.world_size > 1 else str(e)
        except Exception as e:  # anything else stays a verdict, never one rank's exception
            problem = f"verifying {path} failed on rank {self.dims.rank}: {type(e).__name__}: {e}"
        return next((p for p in all_gather_object(problem, self.dims, "verifying the checkpoint") if p),
                    None)

    def first_valid(self, candidates: list[tuple[Path, dict]], strict: bool,
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
        saved, current = manifest["model"], architecture(self.ctx.model_cfg)
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

    def load(self, target: Path | None = None) -> Loaded | None:
        """Collective. Loads the checkpoint to resume from (``target``: that one, already
        verified by ``rollback_target``) and returns what the trainer needs of it; None for a
        fresh start."""
        def choices() -> list[tuple[Path, dict]]:
            if target is not None:
                return [(target, read_manifest(target, RESUME_SECTIONS))]
            return self._candidates()

        candidates = on_one_rank_then_all(
            choices, self.dims, "choosing the checkpoint to load", share=True,
            fail=lambda e: e if isinstance(e, CheckpointError) else CheckpointError(
                f"choosing the checkpoint in {self.root} failed: {type(e).__name__}: {e}"))
        if target is not None:
            chosen = candidates[0]
        else:
            chosen = self.first_valid(candidates, strict=not self.cfg.checkpoint.load_fallback)
        if chosen is None:
            return None
        path, manifest = chosen
        on_one_rank_then_all(lambda: self._check_architecture(manifest, path), self.dims,
                             "checking the checkpoint's model",
                             fail=as_checkpoint_error(f"checking {path}'s model failed"))
        states = {}
        error = None
        # (Checkpoints from before context parallelism record none: they had one.)
        same_layout = self.ctx.topology() == {"context": 1, **manifest["topology"]}
        try:
            # Only the files holding what this rank's parameters need (by the manifest's index
            # of fragments), rank 0's (the trainer's state) and, same layout, its own (its RNG):
            # not every rank reading every file.
            always = [store.rank_file(0), *([store.rank_file(self.dims.rank)] if same_layout else [])]
            # (One written before q|k|v and gate|up were fused lists the separate projections,
            # which the index does not match to the fused ones: every file is read, once.)
            wanted = (needed_files(manifest["files"], self.engine.module, always)
                      if has_fragment_index(manifest["files"]) and not lists_unfused(manifest["files"])
                      else None)
            fragments = []
            for entry in manifest["files"] if wanted is None else wanted:
                file = listed_file(path, entry)
                states[entry["name"]] = store.load_rank_file(file)
                try:
                    fragments += file_fragments(states[entry["name"]], file.stat().st_size)
                except ValueError as e:
                    raise CheckpointError(f"{file}: {e}") from None
            model = self.ctx.model_cfg
            assembler = Assembler(fragments, complete=wanted is None, heads=(model.n_heads, model.kv_heads))
            # Before anything is assembled: a manifest whose model section does not describe its
            # weights (or strict_model=false) is refused by name, not as a size error midway.
            mismatched = shape_mismatches(
                {spec(p).name: spec(p).full_shape for p in self.engine.module.parameters()}, assembler,
                self.ctx.model_cfg.tokenizer_vocab_size or self.ctx.model_cfg.vocab_size)
            if mismatched:
                more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
                raise CheckpointError(f"its weights do not fit this model: {mismatched[0]}{more}; "
                                      "resume with the recipe it was written with")
            load_fragments(self.engine, assembler, manifest["step"])
        except Exception as e:
            error = CheckpointError(f"loading {path} failed on rank {self.dims.rank}: {e}")
        raise_together(error, self.dims, "loading the checkpoint")

        resuming = target is None  # a rollback continues the run's own schedule

        def follow(saved, running):
            if not resuming:
                return running
            try:
                return schedule_to_follow(saved, running, manifest["step"], str(path),
                                          self.cfg.schedule.on_resume, self.log)
            except ScheduleMismatch as e:  # the same verdict on every rank
                raise CheckpointError(str(e)) from None

        trainer = states[store.rank_file(0)]["trainer"]
        EngineState(self.engine).load_state_dict(trainer, follow)
        own = states.get(store.rank_file(self.dims.rank))
        if same_layout and own is not None and own["rng"] is not None:
            RngState(self.acc).load_state_dict(own["rng"])
        self.log(f"{'resumed from' if target is None else 'reloaded'} {path} at step {manifest['step']}"
                 + ("" if same_layout else f" (saved with layout {manifest['topology']})"))
        return Loaded(manifest["step"], manifest["consumed_samples"], trainer.get("extra"), path)
