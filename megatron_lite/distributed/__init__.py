"""Launcher environment, process layout (ParallelDims) and the device module.

The names below are imported on first use: a tool that reads only the launcher's environment
(``tools/preprocess_data.py`` under mpiexec) does not import torch, a second of its start."""

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_lite.distributed.launcher_env import LaunchEnv, detect
    from megatron_lite.distributed.parallel_dims import ParallelDims, TopologyError
    from megatron_lite.distributed.startup import init_distributed

_HOMES = {"LaunchEnv": "launcher_env", "detect": "launcher_env", "ParallelDims": "parallel_dims",
          "TopologyError": "parallel_dims", "init_distributed": "startup"}

__all__ = ["LaunchEnv", "ParallelDims", "TopologyError", "detect", "init_distributed"]


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
