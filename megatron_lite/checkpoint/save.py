"""Saving: every rank snapshots its state to host memory and writes its own file, in parallel
(in the background when asked); rank 0 commits. A failure on any rank raises on every rank and
leaves the previous checkpoint intact."""

from __future__ import annotations

import platform
import shutil
import threading
import time
from pathlib import Path

import torch

from megatron_lite.checkpoint import store
from megatron_lite.checkpoint.context import CheckpointContext, as_checkpoint_error
from megatron_lite.checkpoint.host_copy import HostCopies
from megatron_lite.checkpoint.load import architecture
from megatron_lite.checkpoint.run_state import EngineState, RngState
from megatron_lite.checkpoint.shard_index import fragment_index
from megatron_lite.checkpoint.shards import local_fragments
from megatron_lite.checkpoint.store import CheckpointError
from megatron_lite.config import to_yaml
from megatron_lite.distributed.collectives import all_gather_object, broadcast_object, on_one_rank_then_all


class CheckpointWriter:
    def __init__(self, ctx: CheckpointContext):
        self.ctx = ctx
        self.cfg, self.dims, self.acc, self.engine, self.log = ctx.cfg, ctx.dims, ctx.acc, ctx.engine, ctx.log
        self.root = ctx.root
        self._pending: tuple[threading.Thread, dict] | None = None
        self.host = HostCopies(ctx.acc)  # host buffers kept from save to save

    def _rank_state(self, step: int, extra: dict | None) -> dict:
        self.host.begin()
        try:
            fragments = local_fragments(self.engine, self.dims, self.host.copy)
        finally:
            self.host.end()
        state = {"rank": self.dims.rank, "fragments": [f.to_dict() for f in fragments],
                 "rng": RngState(self.acc).state_dict()}
        if self.dims.rank == 0:
            state["trainer"] = {**EngineState(self.engine).state_dict(), "extra": extra}
        return state

    def _manifest(self, step: int, consumed_samples: int, files: list[dict], phases: list | None) -> dict:
        import deepspeed

        return {
            "format": store.FORMAT_VERSION, "step": step, "consumed_samples": consumed_samples,
            "consumed_tokens": consumed_samples * self.cfg.data.seq_length,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "topology": self.ctx.topology(),
            "model": architecture(self.ctx.model_cfg),
            "data": {"seq_length": self.cfg.data.seq_length, "tokenizer": self.cfg.data.tokenizer.type,
                     # The data phases, as the trainer's state holds them: for a reader of the manifest.
                     **({"phases": phases} if phases is not None else {})},
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
                phases = ((snapshot or {}).get("trainer", {}).get("extra") or {}).get("data_phases")
                store.commit(root, tmp, self._manifest(step, consumed_samples, files, phases))
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
