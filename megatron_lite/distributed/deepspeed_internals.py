"""Everything this project relies on that DeepSpeed (or torch) does not document as public.

One place, so that a DeepSpeed upgrade that renames any of it fails here, loudly
(tests/unit/test_deepspeed_internals.py pins every name below against the installed release),
instead of silently changing a gradient norm or a skipped update somewhere else.

Parameter attributes DeepSpeed reads:
- ``tensor_model_parallel`` / ``partition_dim``: a tensor-parallel slice, counted in the gradient
  norm on every tensor rank;
- ``model_parallel``: counted on every rank it appears on (a replicated parameter is otherwise
  counted only on model-parallel rank 0, which under pipelining is the first stage alone);
- ``ds_pipe_replicated``: a second copy (a tied weight on a later stage), counted once.
"""

from __future__ import annotations

from torch import nn

from megatron_lite.distributed.parallel_dims import ParallelDims

TENSOR_PARALLEL = "tensor_model_parallel"
PARTITION_DIM = "partition_dim"
MODEL_PARALLEL = "model_parallel"
PIPE_REPLICATED = "ds_pipe_replicated"


def mark_tensor_parallel(param: nn.Parameter, dim: int) -> None:
    """``param`` is a slice along ``dim`` of a tensor-parallel layer."""
    setattr(param, TENSOR_PARALLEL, True)
    setattr(param, PARTITION_DIM, dim)


def is_pipe_replicated(param: nn.Parameter) -> bool:
    """Whether ``param`` is a later pipeline stage's copy of a tied weight."""
    return bool(getattr(param, PIPE_REPLICATED, False))


def mark_pipeline_parameters(pipe: nn.Module, dims: ParallelDims, tied_copy: nn.Parameter | None) -> None:
    """DeepSpeed's pipeline gradient norm counts a parameter that is not tensor-parallel only on
    model-parallel rank 0, which under pipelining is one stage: count each stage's replicated
    parameters on its tensor rank 0 instead; ``tied_copy`` (the last stage's copy of the tied
    embedding) is counted on the first stage only."""
    for p in pipe.parameters():
        setattr(p, PIPE_REPLICATED, p is tied_copy)
        if dims.tp_rank == 0:
            setattr(p, MODEL_PARALLEL, True)
