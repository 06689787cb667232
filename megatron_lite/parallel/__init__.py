"""Parallelism applied to the plain model: tensor, sequence (Megatron and Ulysses) and pipeline.

See ``apply.py`` for the order of a build and docs/parallelism.md for choosing a layout.
"""

from megatron_lite.parallel.apply import assemble, build_parallel_model, local_shards, parallelize

__all__ = ["assemble", "build_parallel_model", "local_shards", "parallelize"]
