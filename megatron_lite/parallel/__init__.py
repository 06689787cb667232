"""Parallelism applied to the plain model: tensor, sequence (Megatron and Ulysses) and pipeline.

See ``build.py`` for the order of a build and docs/parallelism.md for choosing a layout.
"""

from megatron_lite.parallel.apply import local_shards, parallelize
from megatron_lite.parallel.build import build_parallel_model

__all__ = ["build_parallel_model", "local_shards", "parallelize"]
