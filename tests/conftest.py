"""Shared test helpers: paths, the tinyshakespeare char dataset, pretrain.py as a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_harness.checks import install

install()  # this process too (tests that start process groups in spawned children inherit it)

REPO = Path(__file__).resolve().parents[1]
# Where one node (4 x A100-40GB, --plan's default) is not enough: the allocation a recipe's
# header names, as --plan options.
RECIPE_ALLOCATION = {"llama3-8b.yaml": ["--world-size", "8"],
                     "llama3-8b-64k-polaris.yaml": ["--world-size", "16"],
                     "llama2-7b-aurora.yaml": ["--world-size", "24", "--gpus-per-node", "12",
                                               "--device", "Max1550"]}
SHARED_DATA = REPO.parent / "shared" / "data"
TINY_SHAKESPEARE = SHARED_DATA / "tinyshakespeare.txt"
WORKS_JSONL = SHARED_DATA / "shakespeare_works.jsonl"

# Tests run as in an activated environment: its bin directory (mpiexec, ninja) first on PATH, for
# this process and every subprocess. DeepSpeed compiles its CPU communication op with whichever
# ninja PATH finds first; the environment's and the system's ninja discard each other's build log,
# so every switch between them recompiled the op (about a minute on 2 cores).
VENV_BIN = str(Path(sys.executable).parent)
os.environ["PATH"] = os.pathsep.join([VENV_BIN, os.environ.get("PATH", "")])

# Every process the tests start runs torch.distributed with accelerator semantics
# (tests/dist_harness/checks.py): its sitecustomize.py is found first on PYTHONPATH.
HARNESS = REPO / "tests" / "dist_harness"
# The caller's own entries stay after them: where packages come from a path (a module system on
# a cluster, a folder of wheels on a GPU machine) the tests' processes need them too.
INHERITED_PYTHONPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                        if p and Path(p).resolve() not in (HARNESS, REPO)]
os.environ["PYTHONPATH"] = os.pathsep.join([str(HARNESS), str(REPO), *INHERITED_PYTHONPATH])


def require_shared() -> None:
    if not TINY_SHAKESPEARE.is_file():
        pytest.fail(f"test corpus {TINY_SHAKESPEARE} is missing (tests read ../shared/data)")


def cpu_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", WANDB_SILENT="true",
               PYTHONPATH=os.pathsep.join([str(HARNESS), str(REPO), *INHERITED_PYTHONPATH]),
               TOKENIZERS_PARALLELISM="false")
    return env


def char_overrides(tmp: Path) -> list[str]:
    """Overrides that point shakespeare-char at a private copy of its built data and run dir."""
    require_shared()
    return [f"data.prefix={tmp}/data/tiny_text_document", f"data.build_from={TINY_SHAKESPEARE}",
            f"data.tokenizer.model={tmp}/data/chars.json", f"logging.dir={tmp}/run"]


NO_TENSORBOARD = "logging.tensorboard=false"
"""What the tests' runs add unless their arguments name ``logging.tensorboard``: importing
TensorBoard (and the boto3 it imports when installed) is most of a second of rank 0's start,
on every run. The tests that read the events ask for them (test_pretrain_cli,
test_wandb_continuity)."""


def run_worker_script(worker: Path, out: Path, nproc: int, args: list[str]) -> None:
    """``worker OUT ARGS...`` in one process, or on ``nproc`` ranks (``launch_ranks``); fails the
    test with the end of its output unless every rank exits 0."""
    launcher = launch_ranks(nproc) if nproc > 1 else [sys.executable]
    cmd = [*launcher, str(worker), str(out), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def pretrain_command(args: list[str], nproc: int = 1, launcher: str = "tests") -> list[str]:
    """``pretrain.py ARGS`` in one process, or on ``nproc`` ranks started by the tests' launcher
    (``launch_ranks``) or, with ``launcher="torchrun"``, by torchrun."""
    if not any(a.startswith("logging.tensorboard=") for a in args):
        args = [*args, NO_TENSORBOARD]
    if nproc == 1:
        return [sys.executable, str(REPO / "pretrain.py"), *args]
    ranks = torchrun(nproc) if launcher == "torchrun" else launch_ranks(nproc)
    return [*ranks, str(REPO / "pretrain.py"), *args]


def launch_ranks(nproc: int) -> list[str]:
    """``nproc`` ranks on this machine, started and ended as torchrun does, by a launcher that
    does not import torch (tests/dist_harness/launch.py: 1.3 s of CPU less per launch). The
    tests of what torchrun itself does use ``torchrun``."""
    return [sys.executable, str(HARNESS / "launch.py"), str(nproc)]


def torchrun(nproc: int) -> list[str]:
    """torchrun on this machine with ``nproc`` ranks. ``--standalone``: the launcher's store
    binds a free port itself (port 0) and its ranks rendezvous through it. A port chosen first
    and bound later can be taken meanwhile by any process on the machine (the other test
    worker's ranks, an outgoing connection), failing the run with EADDRINUSE."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def run_pretrain(args: list[str], nproc: int = 1, timeout: int = 600,
                 env: dict[str, str] | None = None, launcher: str = "tests") -> subprocess.CompletedProcess:
    return subprocess.run(pretrain_command(args, nproc, launcher), cwd=REPO, env={**cpu_env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def pretrain_main(args: list[str]) -> subprocess.CompletedProcess:
    """``pretrain.py ARGS`` in this process, for what returns before any training (``--plan``,
    usage errors): its exit status, stdout and stderr, without a process's start-up."""
    import contextlib
    import io

    import pretrain

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(REPO), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = pretrain.main([str(a) for a in args])
    return subprocess.CompletedProcess(["pretrain.py", *args], status, out.getvalue(), err.getvalue())


def run_pretrain_and_kill(args: list[str], nproc: int, marker: str, env: dict[str, str] | None = None) -> str:
    """Start pretrain.py, SIGKILL it (every process) as soon as ``marker`` is printed; returns
    the output up to there."""
    proc = subprocess.Popen(pretrain_command(args, nproc), cwd=REPO, env={**cpu_env(), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            kill_tree(proc.pid)
            break
    proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL, "".join(seen[-30:])
    return "".join(seen)


def kill_tree(pid: int) -> None:
    """SIGKILL process ``pid`` and all its descendants, and wait until they are gone.

    Killing the launcher's process group is not enough: torchrun and the tests' launcher start
    each rank in a session of its own, so the ranks outlive a killed launcher (and train on,
    save, and hold the checkpoint directory's lock)."""
    import psutil

    try:
        root = psutil.Process(pid)
        descendants = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in [root, *descendants]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    # (The launcher itself is the caller's child: the caller reaps it.)
    _, alive = psutil.wait_procs(descendants, timeout=60)
    assert not alive, f"processes survived SIGKILL: {alive}"


def _free_port() -> int:
    """A port that is free now, for launches that must be told one (several nodes, ranks started
    by hand, DeepSpeed's launcher); ``torchrun`` above needs none. Drawn below the kernel's
    ephemeral range: the ports the kernel hands out on its own (to outgoing connections, to
    ``bind`` on port 0) never come from there, so between this choice and the launch only another
    such draw could take it."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100):
        port = random.randrange(10000, max(low, 10001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range after 100 draws")


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="session")
def sp_data(tmp_path_factory) -> Path:
    """A sentencepiece tokenizer and dataset of the Shakespeare works (built once per session)."""
    require_shared()
    d = tmp_path_factory.mktemp("spdata")
    for cmd in (
        ["tools/train_tokenizer.py", "--input", str(WORKS_JSONL), "--vocab-size", "1024",
         "--output", f"{d}/sp"],
        ["tools/preprocess_data.py", "--input", str(WORKS_JSONL), "--output-prefix", f"{d}/works",
         "--tokenizer-type", "sentencepiece", "--tokenizer-model", f"{d}/sp.model", "--append-eod"],
    ):
        subprocess.run([sys.executable, *cmd], cwd=REPO, env=cpu_env(), check=True, capture_output=True,
                       timeout=600)
    return d


# `make test` runs the suite on two pytest workers, a file per worker at a time
# (pytest-xdist's loadfile): the files that take longest go first, so that the short ones fill
# the end instead of one worker finishing minutes after the other.
SLOWEST_FIRST = ("tests/e2e/test_ray_train.py", "tests/distributed/", "tests/e2e/", "tests/")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = Path(item.fspath).relative_to(REPO).as_posix()
        return next(i for i, prefix in enumerate(SLOWEST_FIRST) if path.startswith(prefix))

    items.sort(key=rank)
