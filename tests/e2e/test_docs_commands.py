"""The commands README.md and docs/getting-started.md show work when copied.

Every command of their ```bash blocks is classified: the cheap ones (``--help``,
``--print-config``, ``--dry-run``, ``--plan``, the launchers' dry runs) run here and must exit 0;
the workstation cluster run (``launch/polaris.sh`` through ``mpiexec`` on this machine) trains
on a built dataset; the rest (installs, full training runs, commands on the user's own corpus)
are named by ``NOT_RUN`` with the reason. A command that is none of these fails the test, so a
new example in the docs is either checked or deliberately left out. Commands run in a copy of the
checkout made of links (its own ``data/`` and ``runs/``), as a user would from the repository's
root. Blocks marked ```text (a cluster, the network) are not read."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, _free_port, cpu_env

DOCS = ("README.md", "docs/getting-started.md")
CHEAP = re.compile(r"(^python (pretrain\.py|tools/\S+|launch/ray_train\.py) "
                   r".*--(help|print-config|dry-run|plan)\b)"
                   r"|(^([A-Z_]+=\S+ )*launch/\S+\.sh --(dry-run|help)\b)")
NOT_RUN = {
    r"^make (quickstart|test)$": "installs and the whole suite: what CI runs",
    r"^git clone ": "the clone itself",
    r"^\. \.venv/bin/activate$": "the environment the commands run in",
    r"^pip install ": "installs",
    r"^python3 -m venv ": "installs",
    r"^DS_ACCELERATOR=cpu python -m pytest ": "the suite",
    r"^python pretrain\.py recipes/quickstart\.yaml training\.iters=50 ":
        "a training run (the e2e tests train this recipe)",
    r"^torchrun --nproc-per-node 2 pretrain\.py recipes/quickstart\.yaml ":
        "a two-process run (the distributed tests)",
    r"^python tools/plot_run\.py ": "needs a finished run (tests/unit/test_plot_run.py)",
    r"^python tools/(train_tokenizer|preprocess_data|inspect_data)\.py .*(corpus\.jsonl|data/corpus/)":
        "needs the user's corpus (the tools' tests run them on the test corpora)",
}


def commands(doc: str) -> list[str]:
    """The commands of ``doc``'s ```bash blocks: continuation lines joined, comments dropped."""
    out: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", (REPO / doc).read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#(?![^'\"]*['\"]).*$", "", line).strip()
            line = re.sub(r"\s+", " ", line)
            if line and not line.startswith("#"):
                out.append(line)
    return out


@pytest.fixture(scope="module")
def checkout(tmp_path_factory, sp_data) -> Path:
    """The repository's top level as links, with data of its own: the quickstart dataset and
    tokenizer where recipes/quickstart.yaml expects them (the test corpora's build)."""
    root = tmp_path_factory.mktemp("checkout")
    for entry in REPO.iterdir():
        if entry.name not in ("data", "runs", "checkpoints", "nodes", ".git"):
            (root / entry.name).symlink_to(entry)
    quick = root / "data" / "quickstart"
    quick.mkdir(parents=True)
    for suffix in (".bin", ".idx"):
        (quick / f"works_text_document{suffix}").symlink_to(sp_data / f"works_text_document{suffix}")
    (quick / "tokenizer.model").symlink_to(sp_data / "sp.model")
    return root


def _env() -> dict[str, str]:
    env = cpu_env()
    # `python` is this environment's interpreter, as in an activated venv.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    return env


def _run(line: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    # launch/polaris.sh's own default port (29500) is any other run's on a shared machine.
    return subprocess.run(["bash", "-c", line], cwd=cwd, env={**_env(), "MASTER_PORT": str(_free_port())},
                          capture_output=True, text=True, timeout=timeout)


ALL = [(doc, line) for doc in DOCS for line in commands(doc)]


def test_every_command_is_run_or_named_as_not_run():
    unknown = [f"{doc}: {line}" for doc, line in ALL
               if not CHEAP.search(line) and not any(re.search(p, line) for p in NOT_RUN)
               and "launch/polaris.sh" not in line and line != "hostname > nodes"]
    assert not unknown, "commands the docs show that this test neither runs nor names:\n" + "\n".join(unknown)
    assert sum(bool(CHEAP.search(line)) for _, line in ALL) >= 6


@pytest.mark.parametrize("doc, line", [c for c in ALL if CHEAP.search(c[1])], ids=lambda v: v[:60])
def test_a_cheap_command_works_when_copied(checkout, doc, line):
    proc = _run(line, checkout)
    assert proc.returncode == 0, f"{doc}: {line}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr


def test_the_workstation_cluster_run_trains_through_mpiexec(checkout):
    if shutil.which("mpiexec", path=_env()["PATH"]) is None:
        pytest.skip("no mpiexec: the test extra installs MPICH's (pip install -e '.[test]')")
    lines = commands("docs/getting-started.md")
    start = lines.index("hostname > nodes")
    script = "\n".join(lines[start:start + 2])
    assert "launch/polaris.sh" in script
    proc = _run(f"set -e\n{script}", checkout, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mpiexec -n 2 -ppn 2" in proc.stdout and "final validation loss" in proc.stdout
    metrics = (checkout / "runs" / "polaris-workstation" / "metrics.jsonl").read_text()
    assert '"step": 20' in metrics
