"""What launch/ray_train.py hands its workers: the environment a Gaudi, GPU or CPU worker needs,
secrets kept out of what Ray records, and the rendezvous host rank 0 picks on its own node."""

from __future__ import annotations

import json
import socket
import stat
import tempfile
from dataclasses import asdict
from pathlib import Path

from megatron_lite.launch.ray_rendezvous import rendezvous_host
from megatron_lite.launch.ray_spec import WorkerSpec, is_secret, ray_setup, take_secrets, worker_environment


def test_an_hpu_worker_gets_gaudi_sh_settings_and_the_habana_variables():
    env = worker_environment("hpu", "lazy", {"HCCL_SOCKET_IFNAME": "ens1", "PT_HPU_RECIPE_CACHE_CONFIG": "x",
                                             "HABANA_VISIBLE_MODULES": "0,1", "HOME": "/root"})
    assert env == {"HCCL_SOCKET_IFNAME": "ens1", "PT_HPU_RECIPE_CACHE_CONFIG": "x",
                   "DS_ACCELERATOR": "hpu", "PT_HPU_LAZY_MODE": "1"}  # Ray assigns the modules
    for mode in ("eager", "compile"):
        assert worker_environment("hpu", mode, {})["PT_HPU_LAZY_MODE"] == "0"
    assert worker_environment("hpu", "eager", {"PT_HPU_LAZY_MODE": "1"})["PT_HPU_LAZY_MODE"] == "1"


def test_gpu_and_cpu_workers_get_their_accelerator_unless_the_launcher_names_one():
    assert worker_environment("cuda", "lazy", {"NCCL_DEBUG": "INFO"}) == {"NCCL_DEBUG": "INFO",
                                                                         "DS_ACCELERATOR": "cuda"}
    assert worker_environment("cpu", "lazy", {})["DS_ACCELERATOR"] == "cpu"
    assert worker_environment("cuda", "lazy", {"DS_ACCELERATOR": "cpu"})["DS_ACCELERATOR"] == "cpu"


def test_secrets_reach_ray_as_the_path_of_a_private_file_only(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # what TMPDIR sets for the launcher
    secrets = {"WANDB_API_KEY": "wandb-0123456789abcdef", "HF_TOKEN": "hf_abcdefghijklmnop"}
    env = worker_environment("cuda", "lazy", {**secrets, "WANDB_MODE": "online", "NCCL_DEBUG": "INFO",
                                              "FI_CXI_SECRET_KEY": "fi-secret-value", "HOME": "/root"})
    assert {"WANDB_API_KEY", "HF_TOKEN", "FI_CXI_SECRET_KEY", "WANDB_MODE"} <= env.keys()
    assert {n for n in env if is_secret(n)} == {"WANDB_API_KEY", "HF_TOKEN", "FI_CXI_SECRET_KEY"}
    setup = ray_setup(WorkerSpec(recipe="r.yaml", overrides=[], device="cuda", env=env))
    try:
        # What Ray records (the job's runtime_env) and what each worker is sent hold no value ...
        recorded = json.dumps(setup.runtime_env) + json.dumps(asdict(setup.spec))
        for value in [*secrets.values(), "fi-secret-value"]:
            assert value not in recorded
        assert setup.runtime_env["env_vars"]["WANDB_MODE"] == "online"
        assert setup.spec.secret_names == ["FI_CXI_SECRET_KEY", "HF_TOKEN", "WANDB_API_KEY"]
        # ... but the path of a file only this user reads, in a directory only this user enters.
        path = Path(setup.spec.secrets_file)
        assert path.parent.parent == tmp_path
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        # A worker takes what its node lacks from the file; a node's own value wins.
        worker_env = {"HF_TOKEN": "hf_of_the_node"}
        own, taken, missing = take_secrets(setup.spec.secret_names, str(path), worker_env)
        assert (own, taken, missing) == (["HF_TOKEN"], ["FI_CXI_SECRET_KEY", "WANDB_API_KEY"], [])
        assert worker_env == {"HF_TOKEN": "hf_of_the_node", "FI_CXI_SECRET_KEY": "fi-secret-value",
                              "WANDB_API_KEY": secrets["WANDB_API_KEY"]}
    finally:
        setup.close()
    assert not path.parent.exists()
    # A node that cannot read the file (another machine): the names it lacks, for the warning.
    assert take_secrets(["WANDB_API_KEY"], str(path), {}) == ([], [], ["WANDB_API_KEY"])


def test_no_private_file_without_secrets():
    setup = ray_setup(WorkerSpec(recipe="r.yaml", overrides=[], device="cpu", env={"NCCL_DEBUG": "INFO"}))
    assert setup.secrets is None and setup.spec.secrets_file is None and setup.spec.secret_names == []


def a_non_loopback_address_of_this_machine() -> str | None:
    import psutil

    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def test_the_ranks_meet_on_rank_0s_node_whatever_address_is_configured():
    # Nothing configured: loopback when the whole job is on rank 0's node, else the node's address.
    assert rendezvous_host(None, "MASTER_ADDR", "10.1.2.3", whole_job_here=True) == ("127.0.0.1", None)
    assert rendezvous_host(None, "MASTER_ADDR", "10.1.2.3", whole_job_here=False) == ("10.1.2.3", None)
    # An address of this machine (an interface the user picked) is kept.
    assert rendezvous_host("127.0.0.1", "MASTER_ADDR", "10.1.2.3", True) == ("127.0.0.1", None)
    assert rendezvous_host("localhost", "MASTER_ADDR", "10.1.2.3", True) == ("localhost", None)
    mine = a_non_loopback_address_of_this_machine()
    if mine is not None:
        assert rendezvous_host(mine, "MASTER_ADDR", "10.1.2.3", False) == (mine, None)
    # Another machine's address (TEST-NET-2, on no machine) or a name that does not resolve:
    # ignored with a one-line warning naming it and the fix.
    host, warning = rendezvous_host("198.51.100.7", "MASTER_ADDR", "10.1.2.3", whole_job_here=False)
    assert host == "10.1.2.3"
    assert warning == ("warning: MASTER_ADDR=198.51.100.7 is not an address of the node Ray placed rank 0 "
                       "on (10.1.2.3); the ranks meet at 10.1.2.3 instead (Ray chooses rank 0's node: "
                       "leave MASTER_ADDR unset, or name an interface of that node)")
    host, warning = rendezvous_host("no-such-host.invalid", "distributed.master_addr", "10.1.2.3", True)
    assert host == "127.0.0.1"
    assert warning.startswith("warning: distributed.master_addr=no-such-host.invalid does not resolve")
    # Loopback is rank 0's own machine, but not the other nodes'.
    host, warning = rendezvous_host("127.0.0.1", "MASTER_ADDR", "10.1.2.3", whole_job_here=False)
    assert host == "10.1.2.3" and "is loopback but the workers run on several nodes" in warning
