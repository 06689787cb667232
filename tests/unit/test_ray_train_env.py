"""What launch/ray_train.py hands its workers: the environment a Gaudi, GPU or CPU worker needs."""

from __future__ import annotations

from megatron_lite.training.ray_train import worker_environment


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
