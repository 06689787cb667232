"""A run's last words survive the launcher: once one rank has failed, torchrun and mpiexec send
SIGTERM to every other rank; a rank printing its own reason at that moment still prints it (a
traceback ending in 'Stopped: SIGTERM' stood in its place) and exits with the run's status."""

import os
import signal

import pytest

from megatron_lite.config import load_config
from megatron_lite.distributed.launcher_env import LaunchEnv
from megatron_lite.training import entry
from megatron_lite.training.control import SIGNALS
from tests.conftest import REPO


@pytest.fixture
def restore_signal_handlers():
    saved = {sig: signal.getsignal(sig) for sig in SIGNALS}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_a_sigterm_while_the_reason_is_printed_does_not_replace_it(monkeypatch, restore_signal_handlers):
    import megatron_lite.training.run as run_module

    def failing_run(cfg, env, on_record):
        raise ValueError("rank 1 failed during opening the dataset")

    printed = []

    def emit_then_terminated(line, stream):
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher, reacting to the other rank's exit
        printed.append(line)

    monkeypatch.setattr(run_module, "run", failing_run)
    monkeypatch.setattr(entry, "emit_line", emit_then_terminated)
    cfg = load_config(REPO / "recipes/shakespeare-char.yaml", [])
    env = LaunchEnv(rank=0, world_size=2, local_rank=0, local_world_size=2, master_addr="127.0.0.1",
                    master_port=29500, launcher="torchrun")
    assert entry.train_to_exit_status(cfg, env) == 1
    assert printed == ["error: rank 1 failed during opening the dataset"]


def test_a_rank_whose_peer_exited_says_so_in_one_line(monkeypatch, capsys, restore_signal_handlers):
    """When one rank fails alone, the others fail inside a collective whose peer is gone: their
    line says so (the failing rank's own line says why), with no traceback of the collective."""
    import megatron_lite.training.run as run_module

    def peer_gone(cfg, env, on_record):
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:56000. "
                           "This is typically caused by a remote worker crashing.")

    monkeypatch.setattr(run_module, "run", peer_gone)
    cfg = load_config(REPO / "recipes/shakespeare-char.yaml", [])
    env = LaunchEnv(rank=0, world_size=2, local_rank=0, local_world_size=2, master_addr="127.0.0.1",
                    master_port=29500, launcher="torchrun")
    status, reason, _ = entry.train_outcome(cfg, env)
    assert status == 1 and reason.startswith("rank 0: another rank stopped first (its line says why): "
                                             "RuntimeError: Connection closed by peer")
    assert "Traceback" not in capsys.readouterr().err


def test_a_node_without_the_device_is_named_by_its_own_rank(monkeypatch, capsys, restore_signal_handlers):
    """No process group exists yet and nodes differ: rank 1 lacking the GPU must say so itself
    (reported once, only rank 0 would speak, and it has a GPU)."""
    import megatron_lite.training.run as run_module
    from megatron_lite.distributed.device import LocalDeviceError

    def no_gpu_here(cfg, env, on_record):
        raise LocalDeviceError("training.device=cuda, but this process sees no GPU")

    monkeypatch.setattr(run_module, "run", no_gpu_here)
    cfg = load_config(REPO / "recipes/shakespeare-char.yaml", [])
    env = LaunchEnv(rank=1, world_size=2, local_rank=1, local_world_size=2, master_addr="127.0.0.1",
                    master_port=29500, launcher="torchrun")
    assert entry.train_to_exit_status(cfg, env) == 2
    said = capsys.readouterr().err.strip()
    assert said == "error: rank 1: training.device=cuda, but this process sees no GPU"
