"""DeepSpeed's CPU op build lock: a live build is waited for (and said so), a stale lock is named;
CPU Adam's load reads the CPU once; NVMe offload without libaio is refused at start."""

import os
import re
import threading
import time
from types import SimpleNamespace

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


def _stale_lock(root, name):
    build = root / name
    build.mkdir(parents=True)
    (build / "lock").touch()
    then = time.time() - 3600
    for p in (build / "lock", build):
        os.utime(p, (then, then))
    return build / "lock"


# Each op through DeepSpeed's own builder, as a run loads it: the guard stops at the stale lock
# before torch would wait on it (and before anything compiles).
_LOAD_OPS = """
import sys
from megatron_lite.distributed import cpu_extensions
cpu_extensions.guard_op_builds(print)
import deepspeed.ops.op_builder.cpu as ops
from deepspeed.ops.op_builder.cpu import AsyncIOBuilder, CPUAdamBuilder, ShareMemCommBuilder
builders = [CPUAdamBuilder, ShareMemCommBuilder]
if hasattr(ops, "CPULionBuilder"):  # DeepSpeed 0.17 and later
    builders.append(ops.CPULionBuilder)
if AsyncIOBuilder().is_compatible(verbose=False):  # libaio present
    builders.append(AsyncIOBuilder)
for builder in builders:
    try:
        builder().load()
        print("LOADED", builder.NAME)
    except cpu_extensions.StaleBuildLock as e:
        print("REFUSED", builder.NAME, e)
"""


def test_every_op_a_run_builds_stops_at_a_stale_lock_instead_of_waiting(tmp_path):
    """CPU Adam, the CPU communication op, CPU Lion (any other op) and async I/O (where libaio
    is installed): torch would wait on each lock forever, without a word."""
    import subprocess
    import sys

    # (DeepSpeed 0.17+ builds the pinned-memory op first when it loads async I/O: its lock stops
    # that load, before the build a free lock would start.)
    locks = {name: _stale_lock(tmp_path, name)
             for name in ("cpu_adam", "deepspeed_shm_comm", "cpu_lion", "async_io", "pin_memory")}
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "DS_ACCELERATOR": "cpu"}
    try:
        proc = subprocess.run([sys.executable, "-c", _LOAD_OPS], env=env, capture_output=True,
                              text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"an op build waited on a stale lock: {e.stdout}")
    refused = [line for line in proc.stdout.splitlines() if line.startswith("REFUSED")]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    named = {line.split()[1] for line in refused}
    import deepspeed.ops.op_builder.cpu as ops

    lion = ["cpu_lion"] if hasattr(ops, "CPULionBuilder") else []
    assert named >= {"cpu_adam", "deepspeed_shm_comm", *lion}, proc.stdout
    assert "LOADED" not in proc.stdout
    for line in refused:
        op = re.search(r"DeepSpeed's (\S+) op", line).group(1)  # async I/O's may be pin_memory
        assert op in (line.split()[1], "pin_memory"), line
        assert f"rm {locks[op]})" in line, line
        assert locks[op].exists()  # named, never removed behind the user's back


def test_the_guard_uses_the_build_directory_a_build_names(tmp_path, monkeypatch):
    """An op built into a directory of its own (``build_directory``): that directory's lock; once
    the lock is gone the build goes ahead, announced once however often the guard was set."""
    import torch.utils.cpp_extension as cpp

    built = []

    def load(name, sources, build_directory=None, verbose=False):  # torch's, without compiling
        built.append(name)
        return name

    monkeypatch.setattr(cpp, "load", load)
    monkeypatch.setattr(cpu_extensions, "_op_build_hooks", list(cpu_extensions._op_build_hooks))
    lock = _stale_lock(tmp_path / "elsewhere", "any_op")
    said = []
    cpu_extensions.guard_op_builds(said.append)
    cpu_extensions.guard_op_builds(said.append)  # again: still one guard
    with pytest.raises(cpu_extensions.StaleBuildLock, match=f"rm {lock}"):
        cpp.load("any_op", [], str(lock.parent))
    with pytest.raises(cpu_extensions.StaleBuildLock, match=f"rm {lock}"):
        cpp.load(name="any_op", sources=[], build_directory=str(lock.parent))
    assert built == []
    lock.unlink()
    assert cpp.load("any_op", [], build_directory=str(lock.parent)) == "any_op"
    assert built == ["any_op"]
    assert said == [f"building DeepSpeed's any_op op in {lock.parent} (once per environment; a "
                    "minute or more)"]


def test_the_cpu_is_read_once_per_process(monkeypatch):
    """py-cpuinfo starts a Python process at every call (a second each): after
    ``ask_cpu_info_once`` the first answer serves every later call, each a copy."""
    import cpuinfo

    real, calls = cpuinfo.get_cpu_info(), []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: calls.append(1) or dict(real))
    cpu_extensions.ask_cpu_info_once()
    answer = cpuinfo.get_cpu_info()
    answer["flags"] = []  # a caller's change stays in its copy
    assert cpuinfo.get_cpu_info() == real and len(calls) == 1


def test_nvme_offload_is_refused_where_the_async_io_op_cannot_build(monkeypatch):
    import deepspeed.git_version_info as installed

    from megatron_lite.distributed.device import nvme_problem

    class Accelerator:
        def __init__(self, libaio: bool):
            self.libaio, self.asked = libaio, []

        def create_op_builder(self, name: str):
            self.asked.append(name)
            return SimpleNamespace(name="async_io", is_compatible=lambda verbose: self.libaio)

    without = Accelerator(libaio=False)
    said = nvme_problem(without, "nvme", "nvme")
    assert said.startswith("parallel.offload_optimizer=nvme and parallel.offload_params=nvme needs "
                           "DeepSpeed's async-I/O op") and "apt install libaio-dev" in said, said
    assert without.asked == ["AsyncIOBuilder"]
    assert nvme_problem(Accelerator(libaio=True), "none", "nvme") is None
    unasked = Accelerator(libaio=False)
    assert nvme_problem(unasked, "cpu", "none") is None and unasked.asked == []
    # DeepSpeed installed with the op compiled (DS_BUILD_AIO=1) loads it without building it.
    monkeypatch.setitem(installed.installed_ops, "async_io", True)
    assert nvme_problem(Accelerator(libaio=False), "nvme", "none") is None
