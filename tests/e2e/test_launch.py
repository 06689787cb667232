"""launch/polaris.sh and launch/gaudi.sh: the commands they build, and a real mpiexec run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, char_overrides, cpu_env, read_metrics


def _launch_env(**env: str) -> dict[str, str]:
    base = {k: v for k, v in cpu_env().items() if k not in ("PBS_NODEFILE", "PBS_JOBID", "HOSTFILE")}
    return {**base, "PYTHON": sys.executable, **env}


def _launch(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "launch" / script), *args], cwd=REPO, env=_launch_env(**env),
                          capture_output=True, text=True, timeout=300)


def _fake_command(tmp_path: Path, name: str, body: str) -> str:
    """A PATH with a bash script called ``name`` first (a launcher the test can watch)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
    (bin_dir / name).chmod(0o755)
    return os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])


def _nodefile(tmp_path, hosts: list[str]) -> str:
    path = tmp_path / "nodefile"
    path.write_text("".join(f"{h}\n" for h in hosts))  # PBS lists a host once per chunk
    return str(path)


@pytest.mark.parametrize("hosts, ranks", [(["x3001c0s1b0n0", "x3002c0s1b0n0"], 8), (["x3001c0s1b0n0"], 4)])
@pytest.mark.parametrize("flavor", ["pals", "hydra"])
def test_polaris_dry_run_counts_nodes(tmp_path, hosts, ranks, flavor):
    nodefile = _nodefile(tmp_path, hosts)
    out = _launch("polaris.sh", "--dry-run", "recipes/gpt2-124m.yaml", "training.eval_iters=10",
                  PBS_NODEFILE=nodefile, MPI_FLAVOR=flavor)
    assert out.returncode == 0, out.stderr
    command = out.stdout.splitlines()[-1]
    hostfile = "--hostfile" if flavor == "pals" else "-hostfile"
    assert command.startswith(f"mpiexec -n {ranks} -ppn 4 {hostfile} {nodefile} ")
    assert command.endswith(f"{sys.executable} pretrain.py recipes/gpt2-124m.yaml training.eval_iters=10")
    if flavor == "pals":
        assert " --cpu-bind list:0-7:8-15:16-23:24-31 --envall " in command
    else:  # the core lists are Polaris' (Cray PALS): Hydra on a workstation binds nothing
        assert "--cpu-bind" not in command and "-genvall" in command
    assert f"master {hosts[0]}:29500" in out.stdout


# What the placement reads: none of it may come from the environment the tests run in.
_PLACEMENT_SETTINGS = ("CUDA_VISIBLE_DEVICES", "CPU_BIND", "NCCL_OFI_PLUGIN_DIR", "NCCL_NET",
                       "LD_LIBRARY_PATH", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
                       "LAUNCH_START_EPOCH")


def _polaris_launch(tmp_path, *args: str, **env: str):
    """launch/polaris.sh for real, with a fake mpiexec that records its arguments and
    environment (what each rank would start with): (result, mpiexec's argv, its environment)."""
    seen = tmp_path / "seen"
    seen.mkdir(exist_ok=True)
    path = _fake_command(tmp_path, "mpiexec", f'printf "%s\\0" "$@" > {seen}/argv; env -0 > {seen}/env')
    base = {k: v for k, v in _launch_env().items() if k not in _PLACEMENT_SETTINGS}
    out = subprocess.run(["bash", str(REPO / "launch" / "polaris.sh"), *args], cwd=REPO,
                         env={**base, "PATH": path, **env}, capture_output=True, text=True, timeout=300)
    if out.returncode != 0 or not (seen / "argv").exists():
        return out, None, None
    argv = (seen / "argv").read_text().split("\0")[:-1]
    environ = dict(item.split("=", 1) for item in (seen / "env").read_text().split("\0") if "=" in item)
    for name in ("argv", "env"):
        (seen / name).unlink()
    return out, argv, environ


def test_polaris_puts_each_rank_on_the_cores_and_gpu_of_one_numa_domain(tmp_path):
    """Polaris' GPU g is attached to NUMA domain 3-g (8 cores each; hardware threads 32-63 are
    the hyperthreads of cores 0-31): local rank r runs on the physical cores of domain r and
    its cuda:r is GPU 3-r. Depth 16 over 64 hardware threads put ranks 2 and 3 on the
    hyperthreads of ranks 0 and 1, and cuda:r was GPU r, across the node from its cores."""
    recipe = "recipes/gpt2-124m.yaml"
    dry, _, _ = _polaris_launch(tmp_path, "--dry-run", recipe, MPI_FLAVOR="pals")
    assert dry.returncode == 0, dry.stderr
    assert "placement: --cpu-bind list:0-7:8-15:16-23:24-31 " in dry.stdout
    assert "GPUs: CUDA_VISIBLE_DEVICES=3,2,1,0: local rank r's cuda:r is GPU 3-r" in dry.stdout
    assert "allocator: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in dry.stdout
    before = int(time.time())
    out, argv, environ = _polaris_launch(tmp_path, recipe, MPI_FLAVOR="pals", NGPUS_PER_NODE="2")
    assert out.returncode == 0, out.stderr
    assert argv[:6] == ["-n", "2", "-ppn", "2", "--cpu-bind", "list:0-7:8-15"]
    assert environ["CUDA_VISIBLE_DEVICES"] == "3,2,1,0"  # cuda:0 is GPU 3 (domain 0), cuda:1 GPU 2
    assert environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    # The trainer's time limit counts from here, the time the walltime left was read.
    assert before - 1 <= int(environ["LAUNCH_START_EPOCH"]) <= time.time()
    # The user's settings win.
    out, argv, environ = _polaris_launch(tmp_path, recipe, MPI_FLAVOR="pals", CPU_BIND="depth",
                                         CUDA_VISIBLE_DEVICES="1,0",
                                         PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:128")
    assert out.returncode == 0, out.stderr
    assert argv[:6] == ["-n", "4", "-ppn", "4", "--cpu-bind", "depth"]
    assert environ["CUDA_VISIBLE_DEVICES"] == "1,0"
    assert environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    assert "allocator: PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128 (the environment's)" in out.stdout
    # Hydra (a workstation): no Polaris binding, no GPU order.
    out, argv, environ = _polaris_launch(tmp_path, recipe, MPI_FLAVOR="hydra")
    assert out.returncode == 0, out.stderr
    assert "--cpu-bind" not in argv and "CUDA_VISIBLE_DEVICES" not in environ
    assert "placement: none (Hydra" in out.stdout


def test_polaris_uses_the_nccl_ofi_plugin_only_where_its_library_is(tmp_path):
    """NCCL_NET="AWS Libfabric" without the plugin on the library path stops NCCL at start-up:
    the plugin's settings are made only where libnccl-net.so is found (NCCL_OFI_PLUGIN_DIR,
    LD_LIBRARY_PATH, ALCF's install), and the decision is one line."""
    if Path("/soft/libraries/aws-ofi-nccl").exists():
        pytest.skip("ALCF's plugin is installed here: it is always found")
    recipe = "recipes/gpt2-124m.yaml"
    plugin = tmp_path / "aws-ofi-nccl" / "lib"
    plugin.mkdir(parents=True)
    (plugin / "libnccl-net.so").write_bytes(b"")
    out, _, environ = _polaris_launch(tmp_path, recipe, MPI_FLAVOR="pals")
    assert out.returncode == 0, out.stderr
    assert "NCCL_NET" not in environ and "NCCL_NET_GDR_LEVEL" not in environ
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("NCCL: ")]
    assert line.startswith("NCCL: no AWS OFI plugin (libnccl-net.so on LD_LIBRARY_PATH, under "
                           "/soft/libraries/aws-ofi-nccl or in NCCL_OFI_PLUGIN_DIR): NCCL_NET not set")
    dry, _, _ = _polaris_launch(tmp_path, "--dry-run", recipe, MPI_FLAVOR="pals")
    assert line in dry.stdout.splitlines()
    # Named by NCCL_OFI_PLUGIN_DIR: put on the library path.
    out, _, environ = _polaris_launch(tmp_path, recipe, MPI_FLAVOR="pals", NCCL_OFI_PLUGIN_DIR=str(plugin),
                                      LD_LIBRARY_PATH="/opt/other/lib")
    assert out.returncode == 0, out.stderr
    assert (f"NCCL: AWS OFI plugin {plugin}/libnccl-net.so (on LD_LIBRARY_PATH), NCCL_NET=AWS Libfabric"
            in out.stdout.splitlines())
    assert environ["LD_LIBRARY_PATH"] == f"{plugin}:/opt/other/lib"
    assert environ["NCCL_NET"] == "AWS Libfabric" and environ["NCCL_NET_GDR_LEVEL"] == "PHB"
    # Already on the library path (a module's): used as it is.
    out, _, environ = _polaris_launch(tmp_path, recipe, MPI_FLAVOR="pals",
                                      LD_LIBRARY_PATH=f"/opt/other/lib:{plugin}")
    assert environ["LD_LIBRARY_PATH"] == f"/opt/other/lib:{plugin}" and environ["NCCL_NET"] == "AWS Libfabric"
    # none: off, even where a module set it (ALCF: the plugin can hang Megatron-DeepSpeed).
    out, _, environ = _polaris_launch(tmp_path, recipe, MPI_FLAVOR="pals", NCCL_OFI_PLUGIN_DIR="none",
                                      NCCL_NET="AWS Libfabric", LD_LIBRARY_PATH=str(plugin))
    assert "NCCL: AWS OFI plugin off (NCCL_OFI_PLUGIN_DIR=none)" in out.stdout and "NCCL_NET" not in environ
    # A folder without the library: the job stops before mpiexec, in one line.
    out, argv, _ = _polaris_launch(tmp_path, "--dry-run", recipe, MPI_FLAVOR="pals",
                                   NCCL_OFI_PLUGIN_DIR=str(tmp_path))
    assert out.returncode == 2 and argv is None
    (err,) = out.stderr.strip().splitlines()
    assert err == (f"error: NCCL_OFI_PLUGIN_DIR={tmp_path} has no libnccl-net.so: name the plugin's lib "
                   "folder, or none to do without it")


@pytest.mark.parametrize("banner, flavor", [("HYDRA build details:", "hydra"),
                                             ("mpiexec version 1.2.3 (Cray PALS)", "pals")])
def test_polaris_detects_the_mpiexec_flavor(tmp_path, banner, flavor):
    # A long banner, as MPICH's is: a detector that stops reading early (grep -q under pipefail)
    # kills mpiexec with SIGPIPE and misreads Hydra as PALS.
    fake = tmp_path / "bin" / "mpiexec"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/bash\necho '{banner}'\nfor i in $(seq 20000); do echo \"  option $i\"; done\n")
    fake.chmod(0o755)
    for _ in range(3):  # the race this guards against was intermittent
        out = _launch("polaris.sh", "--dry-run", "recipes/gpt2-124m.yaml",
                      PATH=os.pathsep.join([str(fake.parent), os.environ.get("PATH", "")]))
        assert out.returncode == 0, out.stderr
        assert f"mpiexec flavor {flavor}" in out.stdout


def test_polaris_recipe_from_qsub_variables_and_walltime(tmp_path):
    nodefile = _nodefile(tmp_path, ["x3001c0s1b0n0"])
    out = _launch("polaris.sh", "--dry-run", PBS_NODEFILE=nodefile, MPI_FLAVOR="pals",
                  RECIPE="recipes/gpt2-124m.yaml", OVERRIDES="training.eval_iters=5 optimizer.lr=1e-3",
                  WALLTIME="02:00:00", CHECKPOINT_MARGIN_MIN="15", NGPUS_PER_NODE="2")
    assert out.returncode == 0, out.stderr
    command = out.stdout.splitlines()[-1]
    assert command.startswith("mpiexec -n 2 -ppn 2 ")
    # Saves and exits 15 minutes before the 2-hour walltime: by its own clock and by SIGUSR1.
    assert command.endswith("recipes/gpt2-124m.yaml training.eval_iters=5 optimizer.lr=1e-3 "
                            "training.exit_duration_mins=105")
    assert "SIGUSR1 to mpiexec after 6300 s" in out.stdout
    mine = _launch("polaris.sh", "--dry-run", "recipes/gpt2-124m.yaml", "training.exit_duration_mins=30",
                   PBS_NODEFILE=nodefile, MPI_FLAVOR="pals", WALLTIME="02:00:00")
    assert mine.stdout.splitlines()[-1].endswith("training.exit_duration_mins=30")  # the user's wins


def test_polaris_overrides_keep_spaces_and_commas_and_the_walltime_left_counts(tmp_path):
    """OVERRIDES is split as a shell splits (quotes keep spaces; nothing is expanded);
    OVERRIDES_FILE takes one override per line, commas included (qsub -v cannot carry them);
    the walltime watcher uses what the job has left (an interactive job started earlier)."""
    nodefile = _nodefile(tmp_path, ["x3001c0s1b0n0"])
    out = _launch("polaris.sh", "--dry-run", "recipes/gpt2-124m.yaml", PBS_NODEFILE=nodefile,
                  MPI_FLAVOR="pals", WALLTIME="", CHECKPOINT_MARGIN_MIN="10",
                  # a shell would run this touch ($IFS: a space that keeps the override one word)
                  OVERRIDES="training.eval_iters=5 'training.sample_prompt=Once upon a time' "
                            f"checkpoint.dir=$(touch$IFS{tmp_path}/ran)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1].endswith(
        r"recipes/gpt2-124m.yaml training.eval_iters=5 training.sample_prompt=Once\ upon\ a\ time "
        rf"checkpoint.dir=\$\(touch\$IFS{tmp_path}/ran\)")  # taken as written, never run
    assert not (tmp_path / "ran").exists()
    (tmp_path / "my.overrides").write_text("# splits\ndata.split=969,30,1\n  training.sample_prompt=A, B  \n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    qstat = bin_dir / "qstat"
    qstat.write_text("#!/bin/bash\necho '    Resource_List.walltime = 02:00:00'\n"
                     "echo '    resources_used.walltime = 00:30:00'\n")
    qstat.chmod(0o755)
    out = _launch("polaris.sh", "--dry-run", "recipes/gpt2-124m.yaml", PBS_NODEFILE=nodefile,
                  MPI_FLAVOR="pals", PBS_JOBID="123.polaris", OVERRIDES_FILE=str(tmp_path / "my.overrides"),
                  PATH=os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]))
    assert out.returncode == 0, out.stderr
    # 2 h limit, 30 min used, 10 min margin: SIGUSR1 after 80 minutes, not 110.
    assert "SIGUSR1 to mpiexec after 4800 s" in out.stdout
    assert out.stdout.splitlines()[-1].endswith(
        r"data.split=969\,30\,1 training.sample_prompt=A\,\ B training.exit_duration_mins=80")


def _chain_job(tmp_path, status: int, finish: bool, extra: tuple[str, ...] = (), **env: str):
    """One job of a chain (CHAIN=3, job 100.polaris) with fake qstat, qsub, qdel and mpiexec:
    mpiexec exits with ``status`` and, with ``finish``, leaves the trainer's finished.json.
    Returns (result, qsub's arguments or None, qdel's arguments or None, whether mpiexec ran)."""
    seen = tmp_path / "seen"
    shutil.rmtree(seen, ignore_errors=True)
    seen.mkdir()
    run_dir = tmp_path / "run"
    _fake_command(tmp_path, "qstat", "printf '%s\\n' '    Resource_List.select = 2:system=polaris' "
                  "'    Resource_List.walltime = 06:00:00' '    queue = prod' '    Account_Name = MyProj' "
                  "'    Resource_List.filesystems = home:eagle' '    resources_used.walltime = 00:00:10'")
    _fake_command(tmp_path, "qsub", f'printf "%s\\0" "$@" > {seen}/qsub; echo 201.polaris')
    _fake_command(tmp_path, "qdel", f'printf "%s\\0" "$@" > {seen}/qdel')
    path = _fake_command(tmp_path, "mpiexec", f"touch {seen}/ran; mkdir -p {run_dir}; "
                         + (f"echo '{{}}' > {run_dir}/finished.json; " if finish else "") + f"exit {status}")
    base = {k: v for k, v in _launch_env().items() if k not in _PLACEMENT_SETTINGS}
    out = subprocess.run(["bash", str(REPO / "launch" / "polaris.sh"), "recipes/gpt2-124m.yaml",
                          f"logging.dir={run_dir}", f"checkpoint.dir={tmp_path / 'ck'}", *extra], cwd=REPO,
                         env={**base, "PATH": path, "MPI_FLAVOR": "pals", "PBS_JOBID": "100.polaris",
                              "CHAIN": "3", "NGPUS_PER_NODE": "2",
                              "PBS_NODEFILE": _nodefile(tmp_path, ["x3001c0s1b0n0"]), **env},
                         capture_output=True, text=True, timeout=300)
    read = {name: (seen / name).read_text().split("\0")[:-1] if (seen / name).exists() else None
            for name in ("qsub", "qdel")}
    return out, read["qsub"], read["qdel"], (seen / "ran").exists()


def test_a_chained_job_queues_its_successor_and_a_finished_or_failed_run_cancels_it(tmp_path):
    # A run that saved and stopped for walltime (status 0, not finished): the successor stays,
    # queued after this job with the same resources, recipe, overrides and settings.
    prompt = "training.sample_prompt=ROMEO.\n  "  # a newline and edge spaces, kept byte for byte
    out, qsub, qdel, ran = _chain_job(tmp_path, 0, finish=False, extra=(prompt,), CUDA_VISIBLE_DEVICES="0,1",
                                      NCCL_DEBUG="WARN")
    assert out.returncode == 0 and ran, out.stdout[-2000:] + out.stderr[-2000:]
    assert qdel is None
    assert qsub[:qsub.index("-v")] == ["-A", "MyProj", "-q", "prod", "-l", "select=2:system=polaris",
                                       "-l", "walltime=06:00:00", "-l", "filesystems=home:eagle",
                                       "-W", "depend=afterany:100.polaris"]
    assert qsub[-1] == str(REPO / "launch" / "polaris.sh")
    passed = dict(item.split("=", 1) for item in qsub[qsub.index("-v") + 1].split(","))
    assert passed.keys() == {"CHAIN_ENV", "CHAIN", "CHAIN_OF"} and passed["CHAIN"] == "2"
    assert passed["CHAIN_OF"] == "100.polaris"
    # The recipe and the settings as the job was given them (commas too, which qsub -v cannot
    # carry), NCCL's own among them; only those: no default the script filled in.
    settings = subprocess.run(["bash", "-c", f"env -i bash -c 'source {passed['CHAIN_ENV']}; env'"],
                              capture_output=True, text=True, check=True).stdout
    given = dict(line.split("=", 1) for line in settings.splitlines() if "=" in line)
    assert given["RECIPE"] == "recipes/gpt2-124m.yaml" and given["NGPUS_PER_NODE"] == "2"
    assert given["MPI_FLAVOR"] == "pals" and given["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert given["NCCL_DEBUG"] == "WARN" and "CPU_BIND" not in given
    chain_env = Path(passed["CHAIN_ENV"])
    assert chain_env.name == "100.polaris.100.polaris.env"  # the chain's, then the job's id
    assert "chain: submitted 201.polaris" in out.stdout
    # The successor, given nothing but CHAIN_ENV (and CHAIN), launches the same run.
    path = _fake_command(tmp_path, "mpiexec",
                         f'printf "%s\\0" "$@" > {tmp_path}/argv; env -0 > {tmp_path}/env')
    base = {k: v for k, v in _launch_env().items() if k not in _PLACEMENT_SETTINGS}
    successor = subprocess.run(["bash", str(REPO / "launch" / "polaris.sh")], cwd=REPO, capture_output=True,
                               text=True, timeout=300, env={**base, "PATH": path, "CHAIN": "0",
                                                            "CHAIN_ENV": passed["CHAIN_ENV"]})
    assert successor.returncode == 0, successor.stderr
    argv = (tmp_path / "argv").read_text().split("\0")[:-1]
    # The overrides as given (the walltime's exit_duration_mins is each job's own).
    assert argv[-5:] == ["pretrain.py", "recipes/gpt2-124m.yaml", f"logging.dir={tmp_path / 'run'}",
                         f"checkpoint.dir={tmp_path / 'ck'}", prompt]
    env = dict(item.split("=", 1) for item in (tmp_path / "env").read_text().split("\0") if "=" in item)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["NCCL_DEBUG"] == "WARN"

    # The run finished in this job: the successor is cancelled.
    out, qsub, qdel, ran = _chain_job(tmp_path, 0, finish=True)
    assert out.returncode == 0 and qsub is not None and qdel == ["201.polaris"], out.stdout[-2000:]
    assert "chain: the run is finished" in out.stdout
    assert not chain_env.exists()  # the chain ended: no job reads its settings any more
    # A failure that is not a walltime stop: the successor is cancelled, the status kept.
    (tmp_path / "run" / "finished.json").unlink()
    out, qsub, qdel, ran = _chain_job(tmp_path, 1, finish=False)
    assert out.returncode == 1 and qdel == ["201.polaris"], out.stdout[-2000:]
    assert "chain: the run failed (exit status 1" in out.stdout
    # Without checkpoints every job would start over: refused before anything is queued.
    bad = subprocess.run(["bash", str(REPO / "launch" / "polaris.sh"), "--dry-run", "recipes/gpt2-124m.yaml",
                          "checkpoint.dir=null"], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**_launch_env(), "CHAIN": "2"})
    assert bad.returncode == 2 and "CHAIN=2 with checkpoint.dir=null" in bad.stderr, bad.stderr
    # A successor that starts after the run finished trains nothing and queues nothing.
    (tmp_path / "run" / "finished.json").write_text("{}\n")
    out, qsub, qdel, ran = _chain_job(tmp_path, 0, finish=False, CHAIN_OF="100.polaris", CHAIN="2")
    assert out.returncode == 0 and not ran and qsub is None and qdel is None, out.stdout[-2000:]
    assert "is finished" in out.stdout


def test_qdel_of_a_chained_job_cancels_its_successor(tmp_path):
    """qdel sends SIGTERM: the run saves and exits 0 (here: a fake mpiexec that does so), and the
    job cancels the successor it queued instead of letting the chain go on."""
    seen = tmp_path / "seen"
    seen.mkdir()
    _fake_command(tmp_path, "qstat", "echo '    queue = prod'")
    _fake_command(tmp_path, "qsub", "echo 201.polaris")
    _fake_command(tmp_path, "qdel", f'printf "%s\\0" "$@" > {seen}/qdel')
    path = _fake_command(tmp_path, "mpiexec", "trap 'exit 0' TERM\nfor _ in $(seq 600); do sleep 0.1; done")
    base = {k: v for k, v in _launch_env().items() if k not in _PLACEMENT_SETTINGS}
    args = ["recipes/gpt2-124m.yaml", f"checkpoint.dir={tmp_path / 'ck'}", f"logging.dir={tmp_path / 'run'}"]
    env = {**base, "PATH": path, "MPI_FLAVOR": "pals", "PBS_JOBID": "100.polaris", "CHAIN": "3",
           "WALLTIME": ""}
    proc = subprocess.Popen(["bash", str(REPO / "launch" / "polaris.sh"), *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("chain: submitted 201.polaris"):
            time.sleep(1)  # mpiexec has started
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert (seen / "qdel").read_text().split("\0")[:-1] == ["201.polaris"]
    assert "chain: the job was sent SIGTERM (qdel): cancelled 201.polaris" in out


def test_polaris_sends_sigusr2_to_a_run_still_there_after_its_walltime_signal(tmp_path):
    """A run that ignores SIGUSR1 (stuck) gets SIGUSR2 HANG_GRACE_MIN later: its ranks write
    where they are (tests/distributed/test_harness.py shows what they write)."""
    seen = tmp_path / "seen"
    seen.mkdir()
    path = _fake_command(tmp_path, "mpiexec", f"trap 'echo USR1 >> {seen}/signals' USR1\n"
                         f"trap 'echo USR2 >> {seen}/signals; exit 7' USR2\n"
                         "for _ in $(seq 600); do sleep 0.1; done")
    base = {k: v for k, v in _launch_env().items() if k not in _PLACEMENT_SETTINGS}
    out = subprocess.run(["bash", str(REPO / "launch" / "polaris.sh"), "recipes/gpt2-124m.yaml"], cwd=REPO,
                         env={**base, "PATH": path, "MPI_FLAVOR": "pals", "WALLTIME": "00:01:05",
                              "CHECKPOINT_MARGIN_MIN": "1", "HANG_GRACE_MIN": "0.05"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 7, out.stdout[-2000:] + out.stderr[-2000:]
    assert (seen / "signals").read_text().split() == ["USR1", "USR2"]
    assert "still running 3 s after SIGUSR1: stuck; SIGUSR2" in out.stderr
    # A grace at or past the margin would report the hang after PBS has ended the job: refused.
    late = _launch("polaris.sh", "--dry-run", "recipes/gpt2-124m.yaml", CHECKPOINT_MARGIN_MIN="4",
                   HANG_GRACE_MIN="4")
    assert late.returncode == 2 and "HANG_GRACE_MIN=4 must be under CHECKPOINT_MARGIN_MIN=4" in late.stderr


@pytest.mark.parametrize("mode, lazy", [("lazy", "1"), ("eager", "0"), ("compile", "0")])
def test_gaudi_dry_run_sets_the_execution_mode(mode, lazy):
    out = _launch("gaudi.sh", "--dry-run", "recipes/llama2-7b-gaudi.yaml", f"training.hpu_mode={mode}",
                  HPUS_PER_NODE="4")
    assert out.returncode == 0, out.stderr
    env_line, command = out.stdout.splitlines()[-2:]
    assert f"training.hpu_mode={mode} PT_HPU_LAZY_MODE={lazy} HABANA_VISIBLE_MODULES=0,1,2,3" in env_line
    assert "DS_ACCELERATOR=hpu" in env_line
    assert command.startswith("deepspeed --num_gpus 4 ")
    assert command.endswith(f"pretrain.py recipes/llama2-7b-gaudi.yaml training.device=hpu "
                            f"training.hpu_mode={mode}")


def test_gaudi_mpirun_over_a_hostfile(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# the job's nodes\n\ng1 slots=8\ng2 slots=8\n")  # comments are not hosts
    out = _launch("gaudi.sh", "--dry-run", "recipes/llama2-7b-gaudi.yaml", LAUNCHER="mpirun",
                  HOSTFILE=str(hosts))
    assert out.returncode == 0, out.stderr
    env_line, command = out.stdout.splitlines()[-2:]
    assert "PT_HPU_LAZY_MODE=1" in env_line and "MASTER_ADDR=g1" in env_line
    assert command.startswith(f"mpirun -n 16 --map-by ppr:8:node --bind-to none --hostfile {hosts} ")
    assert "-x PT_HPU_LAZY_MODE -x HABANA_VISIBLE_MODULES" in command
    bad = _launch("gaudi.sh", "--dry-run", "recipes/llama2-7b-gaudi.yaml", LAUNCHER="srun")
    assert bad.returncode == 2 and "use deepspeed or mpirun" in bad.stderr


def test_polaris_script_trains_for_real_with_mpiexec(tmp_path):
    if shutil.which("mpiexec") is None:  # conftest puts the environment's bin first on PATH
        pytest.skip("no mpiexec: the test extra installs MPICH's (pip install -e '.[test]'), or "
                    "Debian's mpich package provides one")
    nodefile = _nodefile(tmp_path, [socket.gethostname()])  # one host: this machine
    out = _launch("polaris.sh", "recipes/shakespeare-char.yaml", *char_overrides(tmp_path),
                  "training.iters=3", "training.log_interval=1", "training.eval_interval=0",
                  "training.eval_iters=1", "training.global_batch_size=8", "training.micro_batch_size=4",
                  "training.sample_tokens=0", PBS_NODEFILE=nodefile, NGPUS_PER_NODE="2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "mpiexec -n 2 -ppn 2" in out.stdout and "final validation loss" in out.stdout
    runtime = json.loads((tmp_path / "run" / "runtime.json").read_text())
    assert runtime["world_size"] == 2 and runtime["data_parallel"] == 2
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [1, 2, 3]


# ALCF's documented values (docs.alcf.anl.gov/aurora/running-jobs-aurora/: the 12-rank list;
# .../data-science/frameworks/oneCCL/: the oneCCL variables; argonne-lcf Megatron-DeepSpeed
# ALCF/helpers.sh: the worker cores), written here from those pages, not from the script.
ALCF_12_RANK_LIST = "list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:61-68:69-76:77-84:85-92:93-100"
ALCF_ONECCL = {"CCL_PROCESS_LAUNCHER": "pmix", "CCL_ATL_TRANSPORT": "mpi", "CCL_KVS_MODE": "mpi",
               "CCL_KVS_USE_MPI_RANKS": "1", "CCL_KVS_CONNECTION_TIMEOUT": "600",
               "CCL_CONFIGURATION": "cpu_gpu_dpcpp", "CCL_BCAST": "double_tree",
               "CCL_ALLREDUCE_SCALEOUT": "direct:0-1048576;rabenseifner:1048577-max",
               "FI_PROVIDER": "cxi", "FI_CXI_DEFAULT_CQ_SIZE": "1048576", "FI_CXI_RX_MATCH_MODE": "hybrid",
               "ZE_FLAT_DEVICE_HIERARCHY": "FLAT", "PALS_PMI": "pmix",
               "CCL_WORKER_AFFINITY": "5,13,21,29,37,45,57,65,73,81,89,97"}


def test_aurora_dry_run_prints_alcfs_binding_and_oneccl_environment_for_two_nodes(tmp_path):
    nodefile = _nodefile(tmp_path, [f"x4102c5s{n}b0n0.hostmgmt2000.cm.aurora.alcf.anl.gov" for n in (2, 3)])
    clean = {k: v for k, v in _launch_env().items() if not k.startswith(("CCL_", "FI_", "ZE_"))}
    out = subprocess.run(["bash", str(REPO / "launch" / "aurora.sh"), "--dry-run",
                          "recipes/llama2-7b-aurora.yaml"], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={**clean, "PBS_NODEFILE": nodefile, "MPI_FLAVOR": "pals"})
    assert out.returncode == 0, out.stderr
    command = out.stdout.splitlines()[-1]
    assert command == (f"mpiexec -n 24 -ppn 12 --hostfile {nodefile} --cpu-bind {ALCF_12_RANK_LIST} --envall "
                       f"{sys.executable} pretrain.py recipes/llama2-7b-aurora.yaml training.device=xpu")
    printed = dict(line.strip().split("=", 1) for line in out.stdout.splitlines() if line.startswith("  "))
    for name, value in ALCF_ONECCL.items():
        assert printed.get(name) == value, (name, printed.get(name))
    assert printed["DS_ACCELERATOR"] == "xpu"
    assert printed["MASTER_ADDR"] == "x4102c5s2b0n0.hsn.cm.aurora.alcf.anl.gov"  # the high-speed network


def test_aurora_script_trains_for_real_with_mpiexec_on_cpu(tmp_path):
    if shutil.which("mpiexec") is None:
        pytest.skip("no mpiexec: the test extra installs MPICH's (pip install -e '.[test]'), or "
                    "Debian's mpich package provides one")
    nodefile = _nodefile(tmp_path, [socket.gethostname()])
    out = _launch("aurora.sh", "recipes/shakespeare-char.yaml", *char_overrides(tmp_path),
                  "training.iters=2", "training.log_interval=1", "training.eval_interval=0",
                  "training.eval_iters=1", "training.global_batch_size=8", "training.micro_batch_size=4",
                  "training.sample_tokens=0", PBS_NODEFILE=nodefile, NGPUS_PER_NODE="2", DEVICE="cpu")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "mpiexec -n 2 -ppn 2" in out.stdout and "training.device=cpu" in out.stdout
    runtime = json.loads((tmp_path / "run" / "runtime.json").read_text())
    assert runtime["world_size"] == 2 and runtime["device"] == "cpu"
    assert (tmp_path / "run" / "finished.json").exists()  # what a chained job looks for


def test_polaris_check_mode_runs_check_dist_with_mpiexec(tmp_path):
    if shutil.which("mpiexec") is None:
        pytest.skip("no mpiexec: the test extra installs MPICH's (pip install -e '.[test]'), or "
                    "Debian's mpich package provides one")
    nodefile = _nodefile(tmp_path, [socket.gethostname()])
    dry = _launch("polaris.sh", "--dry-run", PBS_NODEFILE=nodefile, NGPUS_PER_NODE="2", CHECK="1")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines()[-1].endswith(f"{sys.executable} tools/check_dist.py")
    out = _launch("polaris.sh", "--iters", "1", "--timeout-s", "60", PBS_NODEFILE=nodefile,
                  NGPUS_PER_NODE="2", CHECK="1")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "mpiexec -n 2 -ppn 2" in out.stdout
    assert "check_dist: 2 ranks up" in out.stdout and "check_dist: OK (2 ranks" in out.stdout
    assert "mpich" in out.stdout  # the per-rank table names the launcher the ranks were started by


def test_gaudi_environment_reaches_every_node_through_a_private_file(tmp_path):
    """The DeepSpeed launcher forwards to remote nodes only its env file's lines: gaudi.sh writes
    one (the user's ~/.deepspeed_env lines kept) where DeepSpeed's runner looks; mpirun gets -x.
    The user's lines may be secrets: the copy is made only for a real launch, by mktemp (mode
    0600, a name nobody can guess), and removed when the launcher exits; a dry run writes none."""
    hosts = tmp_path / "hosts"
    hosts.write_text("g1 slots=8\ng2 slots=8\n")
    (tmp_path / ".deepspeed_env").write_text("MY_SETTING=1\nAPI_KEY=secret")  # no final newline
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {"HOSTFILE": str(hosts), "HOME": str(tmp_path), "HCCL_SOCKET_IFNAME": "eth0", "TMPDIR": str(tmp)}
    dry = _launch("gaudi.sh", "--dry-run", "recipes/llama2-7b-gaudi.yaml", **env)
    assert dry.returncode == 0, dry.stderr
    assert not list(tmp.iterdir()) and "secret" not in dry.stdout
    assert "HCCL_SOCKET_IFNAME" in dry.stdout.splitlines()[-3]  # what the copy will hold, by name
    seen = tmp_path / "seen"
    path = _fake_command(tmp_path, "deepspeed", f'{{ echo "$DS_ENV_FILE"; stat -c %a "$DS_ENV_FILE"; '
                                                f'cat "$DS_ENV_FILE"; }} > {seen}\nexit 3')
    out = _launch("gaudi.sh", "recipes/llama2-7b-gaudi.yaml", PATH=path, **env)
    assert out.returncode == 3, out.stderr  # the launcher's own status
    env_file, mode, *lines = seen.read_text().splitlines()
    assert Path(env_file).parent == tmp and Path(env_file).name.startswith("megatron_lite_deepspeed_env.")
    assert mode == "600"
    assert {"MY_SETTING=1", "API_KEY=secret", "PT_HPU_LAZY_MODE=1", "HABANA_VISIBLE_MODULES=0,1,2,3,4,5,6,7",
            "DS_ACCELERATOR=hpu", "HCCL_SOCKET_IFNAME=eth0"} <= set(lines)
    assert not list(tmp.iterdir())  # removed when the launcher exited
    # Where DeepSpeed's own runner reads the file from, given DS_ENV_FILE.
    where = ("import os, deepspeed.launcher.runner as r; print(sorted({os.path.join(p, "
             "r.DEEPSPEED_ENVIRONMENT_NAME) for p in r.DEEPSPEED_ENVIRONMENT_PATHS}))")
    probe = subprocess.run([sys.executable, "-c", where], env={**cpu_env(), "DS_ENV_FILE": env_file},
                           capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip().splitlines()[-1] == str([env_file]), probe.stderr[-2000:]
    mpirun = _launch("gaudi.sh", "--dry-run", "recipes/llama2-7b-gaudi.yaml", LAUNCHER="mpirun", **env)
    assert "-x HCCL_SOCKET_IFNAME" in mpirun.stdout.splitlines()[-1]


def test_gaudi_passes_a_signal_on_and_removes_the_env_file(tmp_path):
    """gaudi.sh waits for the DeepSpeed launcher (to remove its env file after it) instead of
    becoming it: a SIGTERM to the script still reaches the launcher, and the file still goes."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    started, stopped = tmp_path / "started", tmp_path / "stopped"
    path = _fake_command(tmp_path, "deepspeed", f"sleep 60 & SLEEP=$!\n"
                                                f"trap 'kill $SLEEP; echo TERM > {stopped}; exit 143' TERM\n"
                                                f'echo "$DS_ENV_FILE" > {started}\nwait')
    proc = subprocess.Popen(["bash", str(REPO / "launch" / "gaudi.sh"), "recipes/llama2-7b-gaudi.yaml"],
                            cwd=REPO, env=_launch_env(PATH=path, HOME=str(tmp_path), TMPDIR=str(tmp)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert started.exists(), proc.communicate(timeout=60)[1][-2000:]
    assert Path(started.read_text().strip()).exists()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    assert stopped.read_text().strip() == "TERM"
    assert not list(tmp.iterdir())


def test_gaudi_refuses_a_missing_hostfile_and_a_bad_hpu_count(tmp_path):
    hosts = tmp_path / "hosts"  # never written
    for env, named in (({"HOSTFILE": str(hosts)}, f"HOSTFILE={hosts} does not exist"),
                       ({"HPUS_PER_NODE": "0"}, "HPUS_PER_NODE=0")):
        out = _launch("gaudi.sh", "--dry-run", "recipes/llama2-7b-gaudi.yaml", **env)
        assert out.returncode == 2, out.stdout
        (line,) = out.stderr.strip().splitlines()
        assert line.startswith("error: ") and named in line



@pytest.mark.parametrize("script", ["polaris.sh", "aurora.sh", "gaudi.sh"])
def test_help_shows_the_settings_and_a_missing_recipe_is_the_usage_line(script):
    helped = _launch(script, "--help")
    assert helped.returncode == 0 and "Settings (environment):" in helped.stdout, helped.stderr
    assert "#" not in helped.stdout.splitlines()[0] and "--dry-run" in helped.stdout
    usage = f"usage: launch/{script} [--dry-run] RECIPE [overrides]   (--help: the settings)"
    for args, says in (((), usage), (("--bogus",), "error: unknown option --bogus; usage:")):
        if script in ("polaris.sh", "aurora.sh") and args:
            continue  # the PBS scripts take CHECK=1's options through to tools/check_dist.py
        out = _launch(script, *args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        (line,) = out.stderr.strip().splitlines()
        assert line.startswith(says), line


def test_polaris_dry_run_prints_the_environment_it_sets():
    # 4 ranks (a Polaris node): a global batch their data-parallel size divides.
    out = _launch("polaris.sh", "--dry-run", "recipes/shakespeare-char.yaml", "training.global_batch_size=48")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    env = lines[lines.index("environment set for the ranks:") + 1:-1]
    names = {line.strip().split("=", 1)[0] for line in env}
    wanted = {"MASTER_ADDR", "MASTER_PORT", "FI_CXI_DISABLE_HOST_REGISTER", "PYTORCH_CUDA_ALLOC_CONF"}
    assert wanted <= names, env


@pytest.mark.parametrize("content", ["", "\n\n"])
def test_an_empty_node_file_or_hostfile_is_one_line(tmp_path, content):
    """A node file that names no host: one line naming it, exit 2 (a count of 0 once ran into
    a shell arithmetic error, then an unbound variable)."""
    empty = tmp_path / "nodes"
    empty.write_text(content)
    runs = [("polaris.sh", "recipes/shakespeare-char.yaml", {"PBS_NODEFILE": str(empty)},
             f"PBS_NODEFILE={empty} names no node")]
    runs += [("gaudi.sh", "recipes/llama2-7b-gaudi.yaml", {"HOSTFILE": str(empty), "LAUNCHER": launcher},
              f"HOSTFILE={empty} names no host") for launcher in ("mpirun", "deepspeed")]
    for script, recipe, env, named in runs:
        out = _launch(script, "--dry-run", recipe, **env)
        assert out.returncode == 2, (script, env, out.stdout, out.stderr)
        (line,) = out.stderr.strip().splitlines()
        assert line.startswith("error: ") and named in line, line
        assert "pretrain.py" not in out.stdout

def test_polaris_overrides_that_cannot_be_split_stop_the_job(tmp_path):
    """An OVERRIDES the shell rules cannot split (an unbalanced quote) stops the job, naming it,
    before mpiexec starts: never the recipe trained without its overrides."""
    started = tmp_path / "started"
    path = _fake_command(tmp_path, "mpiexec", f"touch {started}")
    for dry_run in (["--dry-run"], []):
        out = _launch("polaris.sh", *dry_run, "recipes/gpt2-124m.yaml", MPI_FLAVOR="hydra",
                      OVERRIDES="checkpoint.dir='/x y", PATH=path)
        assert out.returncode == 2, out.stdout
        (line,) = out.stderr.strip().splitlines()
        assert line.startswith("error: OVERRIDES=") and "No closing quotation" in line, line
        assert "OVERRIDES_FILE" in line and "pretrain.py" not in out.stdout
    assert not started.exists()


@pytest.mark.parametrize("args, env, named", [
    (["recipes/nope.yaml"], {}, "recipe file 'recipes/nope.yaml' does not exist"),
    (["recipes/gpt2-124m.yaml", "training.itres=5"], {}, "unknown key 'training.itres'"),
    (["recipes/gpt2-124m.yaml"], {"OVERRIDES": "training.itres=5"}, "unknown key 'training.itres'"),
    (["recipes/gpt2-124m.yaml"], {"NGPUS_PER_NODE": "0"}, "NGPUS_PER_NODE=0"),
])
def test_polaris_checks_the_recipe_before_mpiexec(tmp_path, args, env, named):
    """The recipe is checked where the job starts, before any rank (and by --dry-run, before
    qsub): a typo must not cost a queue wait and a traceback per rank."""
    started = tmp_path / "started"
    path = _fake_command(tmp_path, "mpiexec", f"touch {started}")
    for dry_run in (["--dry-run"], []):
        out = _launch("polaris.sh", *dry_run, *args, MPI_FLAVOR="hydra", PATH=path, **env)
        assert out.returncode == 2, out.stdout
        assert named in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert "pretrain.py" not in out.stdout
    assert not started.exists()


def test_dry_run_after_the_recipe_is_still_a_dry_run_and_a_job_outside_the_repository_is_named(tmp_path):
    for script, recipe in (("gaudi.sh", ["recipes/llama2-7b-gaudi.yaml"]),
                           ("polaris.sh", ["recipes/quickstart.yaml", "training.global_batch_size=64"])):
        out = _launch(script, *recipe, "--dry-run")
        assert out.returncode == 0, (script, out.stderr[-2000:])
        assert out.stdout.splitlines()[-1].split()[0] in ("deepspeed", "mpiexec"), out.stdout[-500:]
        assert "--dry-run" not in out.stdout.splitlines()[-1]
    out = _launch("polaris.sh", "--dry-run", "recipes/quickstart.yaml", PBS_O_WORKDIR=str(tmp_path))
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"error: {tmp_path} is not the repository's root"), line


@pytest.mark.parametrize("script, args, env, says", [
    # llama2-7b-polaris is TP 4 x PP 2: one node's 4 GPUs cannot hold it.
    ("polaris.sh", ["--dry-run", "recipes/llama2-7b-polaris.yaml"], {},
     "world size 4 is not divisible by parallel.tensor × parallel.pipeline × parallel.ulysses × "
     "parallel.context = 4 × 2 × 1 × 1"),
    ("polaris.sh", ["--dry-run", "recipes/shakespeare-char.yaml"], {"NNODES": "2", "NGPUS_PER_NODE": "2"},
     "training.global_batch_size=12 is not a multiple of training.micro_batch_size × data-parallel "
     "size = 12 × 4"),
    ("gaudi.sh", ["--dry-run", "recipes/llama2-7b-gaudi.yaml"], {"HPUS_PER_NODE": "3"},
     "is not a multiple of training.micro_batch_size × data-parallel size = 2 × 3"),
])
def test_a_dry_run_checks_the_layout_for_the_ranks_the_job_starts(script, args, env, says):
    """The ranks would find it after the job waited in the queue, each printing it: the launchers
    check the layout for nodes × ranks per node before they queue or start anything."""
    out = _launch(script, *args, **env)
    assert out.returncode == 2 and says in out.stderr, out.stderr[-2000:]
    assert "mpiexec" not in out.stdout and "deepspeed --num_gpus" not in out.stdout


def test_nnodes_is_for_a_dry_run_on_a_login_node(tmp_path):
    nodes = tmp_path / "nodes"
    nodes.write_text("a\nb\n")
    # A job script's own NNODES: fine when it agrees with the job's nodes, one line when not.
    out = _launch("polaris.sh", "--dry-run", "recipes/shakespeare-char.yaml", "training.global_batch_size=96",
                  NNODES="2", PBS_NODEFILE=str(nodes))
    assert out.returncode == 0, out.stderr
    out = _launch("polaris.sh", "--dry-run", "recipes/shakespeare-char.yaml", NNODES="3",
                  PBS_NODEFILE=str(nodes))
    assert out.returncode == 2 and "NNODES=3, but this job has 2 node(s)" in out.stderr, out.stderr
    out = _launch("polaris.sh", "--dry-run", "recipes/shakespeare-char.yaml", "training.global_batch_size=96",
                  NNODES="2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1].startswith("mpiexec -n 8 -ppn 4 ")


def test_gaudi_hostfile_slots_must_agree_with_hpus_per_node(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("hostA slots=8\nhostB slots=4\n")
    out = _launch("gaudi.sh", "--dry-run", "recipes/llama2-7b-gaudi.yaml", HOSTFILE=str(hosts),
                  LAUNCHER="mpirun")
    assert out.returncode == 2, out.stdout[-1000:]
    assert "line 'hostB slots=4' does not say slots=8" in out.stderr, out.stderr
