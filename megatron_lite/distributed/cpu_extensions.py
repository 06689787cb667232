"""DeepSpeed's JIT-built ops (the CPU communication op ``deepspeed_shm_comm``, CPU Adam, async
I/O, and on GPU hosts every op it uses): where they are built, building the CPU ones ahead of a
run, and never waiting silently on a build lock.

DeepSpeed compiles an op the first time a process needs it (about a minute each on two cores),
through torch's JIT extension builder. That builder serialises builds with a ``lock`` file in
the op's build directory and waits, without a word and without end, while the file exists, even
for an op that is already built; a run stopped in the middle of a build (SIGTERM, SIGKILL)
leaves the file behind and every later run hangs on it. Torch offers no staleness check, so
``guard_op_builds`` puts one in front of every op build of the process: a lock whose build
directory has not changed for ``STALE_AFTER_S`` is reported with its path and the fix.

``build()`` builds the CPU ops ahead of any run (``make install`` calls it).
``ask_cpu_info_once`` keeps CPU Adam's load from reading the CPU three times.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

OP = "deepspeed_shm_comm"
# How every op builder builds: torch's function, looked up when the build runs (before_every_op_build;
# pinned in engine/internals.py's RELIED_ON).
OP_BUILD_CALL = "from torch.utils.cpp_extension import load"
STALE_AFTER_S = 300.0  # a build writes an object file at least every minute or two
ANNOUNCE_EVERY_S = 30.0


class StaleBuildLock(RuntimeError):
    """A JIT build lock left by a stopped build."""


def use_environment_extensions_dir() -> None:
    """Unless ``TORCH_EXTENSIONS_DIR`` is set, build into this Python environment
    (``sys.prefix/torch_extensions``) where that is writable. By default torch shares
    ``~/.cache/torch_extensions`` between every environment of a Python version; two
    environments (two checkouts, a CI clone) then rebuild the op in turn, each time under the
    other's running processes."""
    use_environment_ninja()
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return
    target = Path(sys.prefix) / "torch_extensions"
    if os.access(sys.prefix, os.W_OK):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(target)


def use_environment_ninja() -> None:
    """Build with this Python environment's ``ninja`` where it has one (``pip install ninja``),
    whether or not the environment is activated. Torch runs whichever ``ninja`` is first on
    ``PATH``; a system ninja and the environment's write build logs the other does not read, so
    each switch between them rebuilt every op (a minute or more on two cores)."""
    bin_dir = Path(sys.executable).parent
    path = os.environ.get("PATH", "").split(os.pathsep)
    if (bin_dir / "ninja").exists() and (not path or path[0] != str(bin_dir)):
        os.environ["PATH"] = os.pathsep.join([str(bin_dir), *path])


def build_directory(name: str = OP) -> Path:
    """Where torch builds (and finds) op ``name``. Torch computes this only in a private function
    (``cpp_extension._get_build_directory``, which also creates the folder); this mirrors its
    public parts: ``TORCH_EXTENSIONS_DIR``, else the default root and a python/device folder."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root) / name
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    device = ("cpu" if torch.version.cuda is None and torch.version.hip is None
              else f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda
              else f"rocm{torch.version.hip.replace('.', '')}")
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{py}_{device}" / name


def _newest_change(directory: Path) -> float:
    times = [directory.stat().st_mtime]
    for entry in directory.iterdir():
        try:
            times.append(entry.stat().st_mtime)
        except FileNotFoundError:  # removed by the build meanwhile
            pass
    return max(times)


def wait_for_build(log: Callable[[str], None], name: str = OP, directory: Path | None = None,
                   stale_after: float = STALE_AFTER_S, poll: float = 1.0,
                   announce_every: float = ANNOUNCE_EVERY_S) -> None:
    """Before torch builds or loads op ``name`` (in ``directory``, by default torch's): say when
    it will be built, wait (saying so) while another process builds it, and stop with the lock's
    path and the fix when the lock is stale."""
    directory = directory or build_directory(name)
    lock = directory / "lock"
    if not lock.exists() and not (directory.is_dir() and any(directory.glob("*.so"))):
        log(f"building DeepSpeed's {name} op in {directory} (once per environment; a minute or "
            "more)")
    announced = None
    while lock.exists():
        try:
            idle = time.time() - _newest_change(directory)
        except FileNotFoundError:
            break
        if idle > stale_after:
            raise StaleBuildLock(
                f"{lock} is a build lock left by a stopped build of DeepSpeed's {name} op (nothing in "
                f"{directory} has changed for {idle / 60:.0f} min); no build is running: remove it "
                f"(rm {lock}) and start again")
        if announced is None or time.time() - announced > announce_every:
            log(f"waiting for another process's build of DeepSpeed's {name} op to finish ({lock})")
            announced = time.time()
        time.sleep(poll)


def guard_op_builds(log: Callable[[str], None]) -> None:
    """From now on in this process, every op DeepSpeed builds or loads just in time (the CPU
    communication op, CPU Adam, async I/O, pinned memory, GPU ops: any op builder's) first goes
    through ``wait_for_build``, so none can wait silently on a stale lock. Calling it again only
    changes ``log``."""

    def guard(name: str, directory: str | None) -> None:
        wait_for_build(log, name, Path(directory) if directory else None)

    before_every_op_build(guard)


def ask_cpu_info_once() -> None:
    """From now on in this process, py-cpuinfo's ``get_cpu_info`` answers with its first result.
    Each of its calls starts a Python process to read the CPU (about a second of a two-core
    machine), and DeepSpeed asks three times in every rank that loads CPU Adam (the op's build
    flags twice, CPU Adam's vendor check once) and twice for the async-I/O op (NVMe offload):
    ZeRO-Offload's start, on every rank. The CPU does not change under a running process, and
    py-cpuinfo keeps no answer of its own."""
    try:
        import cpuinfo
    except ImportError:  # a DeepSpeed requirement; without it, nothing asks
        return
    if getattr(cpuinfo.get_cpu_info, "_asked_once", False):
        return
    first = functools.cache(cpuinfo.get_cpu_info)

    def get_cpu_info() -> dict:
        return copy.deepcopy(first())  # a caller may change its copy

    get_cpu_info.__doc__, get_cpu_info._asked_once = first.__doc__, True
    cpuinfo.get_cpu_info = get_cpu_info


def build(nvme: bool = True) -> None:
    """Build the op now (as a run would, into the same directory), DeepSpeed's CPU Adam and,
    where libaio exists and ``nvme``, its NVMe ops, which ZeRO-Offload
    (``parallel.offload_optimizer``, ``offload_params``) compiles on first use otherwise."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    use_environment_extensions_dir()
    guard_op_builds(print)
    ask_cpu_info_once()
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, ShareMemCommBuilder

    ShareMemCommBuilder().load()
    print(f"DeepSpeed's {OP} is built in {build_directory()}")
    CPUAdamBuilder().load()
    print("DeepSpeed's CPU Adam (ZeRO-Offload's optimizer) is built")
    if not nvme:
        return
    from deepspeed.ops.op_builder.cpu import AsyncIOBuilder

    if AsyncIOBuilder().is_compatible(verbose=False):
        AsyncIOBuilder().load()
        try:
            from deepspeed.ops.op_builder.cpu import PinMemoryBuilder
        except ImportError:  # DeepSpeed < 0.17: the CPU accelerator pins without an op
            print("DeepSpeed's async-I/O op (NVMe offload) is built")
            return
        PinMemoryBuilder().load()  # NVMe offload's staging buffers on this accelerator
        print("DeepSpeed's async-I/O and pinned-memory ops (NVMe offload) are built")
    else:
        print("DeepSpeed's async-I/O op (NVMe offload) is not built: libaio's headers and library "
              "are missing (apt install libaio-dev)")


_op_build_hooks: list[Callable[[str, str | None], None]] = []


def before_every_op_build(hook: Callable[[str, str | None], None]) -> None:
    """Run ``hook(name, build_directory or None)`` before every op DeepSpeed builds or loads just
    in time, in place of the one given before. Every op builder's ``jit_load`` (``OpBuilder``'s,
    which CPU, CUDA and HPU builders inherit, and XPU's own) imports torch's
    ``cpp_extension.load`` when it runs (``OP_BUILD_CALL``) and calls it with the op's name, so
    wrapping that function reaches every op, whichever copy of the builders (DeepSpeed's
    ``ops.op_builder`` or a prebuilt ``op_builder``) it comes from."""
    import inspect

    import torch.utils.cpp_extension as cpp

    _op_build_hooks[:] = [hook]
    if getattr(cpp.load, "_runs_op_build_hook", False):
        return
    original, signature = cpp.load, inspect.signature(cpp.load)

    def load(*args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(*args, **kwargs).arguments
        for run_hook in _op_build_hooks:
            run_hook(arguments["name"], arguments.get("build_directory"))
        return original(*args, **kwargs)

    load.__doc__, load._runs_op_build_hook = original.__doc__, True
    cpp.load = load
