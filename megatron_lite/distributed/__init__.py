"""Launcher environment, process layout (ParallelDims) and the device module."""

from megatron_lite.distributed.launcher_env import LaunchEnv, detect
from megatron_lite.distributed.parallel_dims import ParallelDims, TopologyError
from megatron_lite.distributed.startup import init_distributed

__all__ = ["LaunchEnv", "ParallelDims", "TopologyError", "detect", "init_distributed"]
