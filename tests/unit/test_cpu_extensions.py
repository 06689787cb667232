"""DeepSpeed's CPU op build lock: a live build is waited for (and said so), a stale lock is named."""

import os
import threading
import time

import pytest

from megatron_lite.distributed import cpu_extensions


def _lock(tmp_path, monkeypatch, age_s: float):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build = tmp_path / cpu_extensions.OP
    build.mkdir()
    (build / "lock").touch()
    then = time.time() - age_s
    for p in (build / "lock", build):
        os.utime(p, (then, then))
    return build / "lock"


def test_a_live_build_is_waited_for_with_a_message(tmp_path, monkeypatch):
    lock = _lock(tmp_path, monkeypatch, age_s=5)
    threading.Timer(0.5, lock.unlink).start()  # the other process finishes its build
    said = []
    cpu_extensions.wait_for_build(said.append, poll=0.05)
    assert not lock.exists()
    assert any("waiting for another process's build" in s and str(lock) in s for s in said)


def test_a_stale_lock_stops_with_its_path_and_the_fix(tmp_path, monkeypatch):
    lock = _lock(tmp_path, monkeypatch, age_s=3600)
    with pytest.raises(cpu_extensions.StaleBuildLock, match=f"rm {lock}"):
        cpu_extensions.wait_for_build(lambda _: None, poll=0.05)
    assert lock.exists()  # named, never removed behind the user's back


def test_the_environment_gets_its_own_build_directory(monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    cpu_extensions.use_environment_extensions_dir()
    import sys

    assert os.environ["TORCH_EXTENSIONS_DIR"] == os.path.join(sys.prefix, "torch_extensions")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/elsewhere")
    cpu_extensions.use_environment_extensions_dir()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == "/elsewhere"  # the user's setting wins


def test_ops_are_built_with_the_environments_ninja_even_when_it_is_not_activated(monkeypatch):
    # A system ninja first on PATH (an environment used without activation, as `make install`
    # runs it) would rebuild the ops `make install` built with the environment's.
    import shutil
    import sys

    env_bin = os.path.dirname(sys.executable)
    assert os.path.exists(os.path.join(env_bin, "ninja")), "ninja is a dependency of the environment"
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", "/bin"]))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/elsewhere")
    cpu_extensions.use_environment_extensions_dir()
    assert os.environ["PATH"].split(os.pathsep)[0] == env_bin
    assert shutil.which("ninja") == os.path.join(env_bin, "ninja")
    cpu_extensions.use_environment_extensions_dir()  # once only
    assert os.environ["PATH"].split(os.pathsep).count(env_bin) == 1
