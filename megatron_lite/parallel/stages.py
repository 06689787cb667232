"""Pipeline stages: a stage is the model itself, with only its own parts.

``build_parallel_model`` builds the plain ``Transformer`` on the meta device, parallelizes it as
without pipelining, and ``keep_stage`` removes what other stages hold: the first stage keeps the
embeddings, every stage its range of blocks (names unchanged: ``blocks.7`` stays ``blocks.7``),
the last one the final norm and the output layer. A stage runs ``Transformer.forward``, which
runs whichever parts the model has — the same embedding, blocks, activation checkpointing and
fused output layer + loss (``model/loss.py``) as one process, so the last stage never holds
full logits. The split of blocks over stages (``stage_layers``) is counted by the planner too;
DeepSpeed's pipeline engine runs the stages (``engine/pipeline.py``).
"""

from __future__ import annotations

import os

from megatron_lite.model.flops import ParameterCounts
from megatron_lite.model.transformer import Transformer


def stage_layers(counts: ParameterCounts, pipeline: int, method: str) -> list[tuple[int, int, int]]:
    """(first block, end block, parameters) of each pipeline stage: the layer list
    [embedding, blocks..., head] cut by ``parallel.pipeline_partition`` with DeepSpeed's
    partitioners (by parameters, uniformly, or the blocks evenly with the embedding and head on
    the first and last stage); a tied embedding is also held by the last stage."""
    layers = [counts.embedding, *([counts.block] * counts.n_layers), counts.head]
    if pipeline == 1:
        return [(0, counts.n_layers, counts.total)]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the partitioner needs no device
    from deepspeed.runtime import utils as ds_utils

    if method == "parameters":
        bounds = ds_utils.partition_balanced(layers, pipeline)
    elif method == "uniform":
        bounds = ds_utils.partition_uniform(len(layers), pipeline)
    else:  # type:Block
        inner = ds_utils.partition_uniform(counts.n_layers, pipeline)
        bounds = [0] + [b + 1 for b in inner[1:-1]] + [len(layers)]
    stages = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        first, end = max(lo - 1, 0), min(hi - 1, counts.n_layers)
        stages.append((first, max(end, first), sum(layers[lo:hi])))
    return stages


def keep_stage(model: Transformer, blocks: range, first: bool, last: bool) -> Transformer:
    """Cut ``model`` (parallelized, on meta) down to one stage's parts, in place."""
    for key in list(model.blocks.keys()):
        if int(key) not in blocks:
            del model.blocks[key]
    if not first:
        model.tok_emb = model.pos_emb = None
    if not last:
        model.norm = model.lm_head = None
    return model
