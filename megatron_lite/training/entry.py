"""Train one config and turn the outcome into an exit status and a one-line reason: the end of
every launcher's path (``pretrain.py``, each Ray Train worker)."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from megatron_lite.config import Config
from megatron_lite.distributed.launcher_env import LaunchEnv
from megatron_lite.logging.console import emit_line

REPORT_GRACE_S = 3.0
"""How long the other ranks wait before exiting, so that the first rank has printed the reason:
torchrun and mpiexec stop every rank of the job as soon as one exits with an error."""


def report_once(error: Exception | str, env: LaunchEnv | None = None) -> None:
    """A recipe or layout error is the same on every rank: print it from the first rank only."""
    from megatron_lite.distributed import detect

    env = env or detect()
    if env.rank == 0:
        emit_line(f"error: {error}", sys.stderr)
    else:
        time.sleep(REPORT_GRACE_S)


def exit_process(status: int) -> NoReturn:
    """End a launcher's process with ``status`` once the run is over (its files closed, its
    process groups torn down), without the interpreter's finalization. Rarely (seen once in
    hundreds of 2-process gloo runs, on a rank that had finished and passed the final barrier)
    a C++ object of the communication stack is destroyed during finalization with a thread still
    attached and the process aborts ("terminate called without an active exception", SIGABRT):
    a finished run would end as a crash. What exit does besides finalization is done here: the
    ``atexit`` handlers run (libraries' and the user's; CPython runs them the same way at exit),
    logging is shut down and the console streams are flushed. The metrics sinks, checkpoints
    and process groups were closed by the run itself."""
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said
            pass
    os._exit(status)


def hold_signals() -> None:
    """Ignore the stop signals from here on (the main thread's handlers; elsewhere none are
    ours): the process is about to print its outcome and exit."""
    import signal
    import threading

    from megatron_lite.training.control import SIGNALS

    if threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def train_to_exit_status(cfg: Config, env: LaunchEnv | None = None,
                         on_record: Callable[[dict[str, Any]], None] | None = None) -> int:
    """Run ``cfg`` to the end; 0 when it finished as asked, otherwise non-zero after printing
    ``error: <reason>`` on stderr (2: the config or layout is wrong, 1: the run failed,
    128 + N: stopped by signal N). ``env`` is the launch environment (default: detected from
    the launcher's variables); ``on_record`` receives every training record on every rank."""
    status, reason, every_rank = train_outcome(cfg, env, on_record)
    if reason is not None:
        if every_rank:
            emit_line(f"error: {reason}", sys.stderr)
        else:
            report_once(reason, env)
    return status


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "remote process exited")
"""What gloo's and NCCL's errors say when the rank at the other end of a collective has exited."""


def lost_a_peer(e: BaseException) -> bool:
    """Whether ``e`` is a collective failing because another rank exited (not this rank's own
    failure: no traceback of it is worth printing)."""
    import torch.distributed as dist

    network_error = getattr(dist, "DistNetworkError", None)
    return (network_error is not None and isinstance(e, network_error)) or any(s in str(e) for s in PEER_LOST)


def train_outcome(cfg: Config, env: LaunchEnv | None = None,
                  on_record: Callable[[dict[str, Any]], None] | None = None
                  ) -> tuple[int, str | None, bool]:
    """(exit status, one-line reason or None, whether every rank should print the reason
    rather than the first alone) of training ``cfg``; see ``train_to_exit_status``."""
    import torch.distributed as dist

    from megatron_lite.checkpoint import CheckpointError
    from megatron_lite.checkpoint.init_from import InitFromError
    from megatron_lite.distributed import TopologyError, detect
    from megatron_lite.distributed.collectives import CollectiveError, first_line
    from megatron_lite.distributed.cpu_extensions import StaleBuildLock
    from megatron_lite.distributed.device import DeviceError, LocalDeviceError
    from megatron_lite.model import VocabularyError
    from megatron_lite.spikes import SpikeStop
    from megatron_lite.training.control import Stopped, stop_on_signals
    from megatron_lite.training.run import run
    from megatron_lite.training.saving import UnsavedEnd

    stop_on_signals()
    began = time.time()  # a hang report of this run is newer
    try:
        try:
            run(cfg, env, on_record)
        finally:
            # The outcome is decided: the SIGTERM a launcher sends every rank once one has failed
            # must not cut this rank's reason short (a traceback instead of the line).
            hold_signals()
    except Stopped as e:
        return (128 + e.signum, f"stopped by {e} (a signal saves a checkpoint only once training runs, "
                "with checkpoint.dir and checkpoint.save_on_signal; the last checkpoint is kept)", True)
    except LocalDeviceError as e:  # this node's own: every rank says whether it is one
        return 2, f"rank {(env or detect()).rank}: {e}", True
    except (TopologyError, InitFromError, DeviceError, VocabularyError) as e:  # the same on every rank
        return 2, str(e), False
    except UnsavedEnd as e:  # the same on every rank
        return 1, str(e), False
    except CollectiveError as e:
        rank = (env or detect()).rank
        return 1, _with_hang_verdict(str(e), cfg, began) if rank == 0 else str(e), True
    except (ValueError, CheckpointError, SpikeStop, StaleBuildLock) as e:
        return 1, str(e), True
    except OSError as e:  # the environment (a path, a permission, a full disk): no traceback
        return 1, f"rank {(env or detect()).rank}: {first_line(e)}", True
    except Exception as e:  # unexpected: the traceback for a report, then the one-line reason
        # The launcher's rank: the process groups are already torn down here (run's cleanup).
        rank = (env or detect()).rank
        reason = f"{type(e).__name__}: {first_line(e)}"
        if lost_a_peer(e):  # another rank ended first, and printed its own reason
            return 1, f"rank {rank}: another rank stopped first (its line says why): {reason}", True
        import traceback

        traceback.print_exc()
        if isinstance(e, dist.DistError) or "timed out" in reason.lower():
            # A collective inside DeepSpeed or a layer: another rank stopped, hung or diverged.
            reason = (f"a collective failed (distributed.timeout_minutes="
                      f"{cfg.distributed.timeout_minutes}): {reason}")
            if rank == 0:
                reason = _with_hang_verdict(reason, cfg, began)
        return 1, f"rank {rank}: {reason}", True
    return 0, None, True


def _with_hang_verdict(reason: str, cfg: Config, since: float) -> str:
    """``reason`` followed by the hang report's verdict when the ranks wrote where they were
    during this run (distributed/hang.py), on the same line. The first rank alone reads the
    ranks' files: on thousands of ranks, every rank reading every file would flood the shared
    file system at the moment the job fails."""
    from pathlib import Path

    from megatron_lite.distributed.hang_report import verdict

    folder = Path(cfg.logging.dir) / "hang"
    found = verdict(folder, since) if folder.is_dir() else None
    return reason if found is None else f"{reason} | {found} (tools/hang_report.py {cfg.logging.dir})"
