"""Pipeline parallelism: a stage is the model itself, with only its own parts.

``build_parallel_model`` builds the plain ``Transformer`` on the meta device, parallelizes it as
without pipelining, and ``keep_stage`` removes what other stages hold: the first stage keeps the
embeddings, every stage its range of blocks (names unchanged: ``blocks.7`` stays ``blocks.7``),
the last one the final norm and the output layer. A stage runs ``Transformer.forward``, which
runs whichever parts the model has — the same embedding, blocks, activation checkpointing and
fused output layer + loss (``model/loss.py``) as one process, so the last stage never holds
full logits.

DeepSpeed's pipeline engine runs 1F1B over the micro-batches. It is given one layer per stage,
this rank's stage (``pipeline_module``); the split of blocks over stages is ours (``stage_layers``,
which the planner counts with too). The last stage's output layer is the pipeline's loss
function. With tied embeddings the last stage holds a copy of the first stage's embedding
matrix: their gradients are summed over the ``embedding`` group (``ParallelDims``) by
DeepSpeed's tied-weight step, and the copy is counted once in the gradient norm and the
checkpoint (``distributed/deepspeed_internals.py``).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from megatron_lite.distributed import deepspeed_internals
from megatron_lite.distributed.parallel_dims import ParallelDims
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


def pipeline_module(stage: Transformer, dims: ParallelDims, tied: bool) -> nn.Module:
    """The DeepSpeed ``PipelineModule`` around this rank's ``stage`` (``keep_stage``);
    ``tied``: the model ties its embedding and output layer."""
    return _stage_pipeline_class()(stage, dims, tied)


@functools.cache
def _stage_pipeline_class() -> type:
    # Defined on first use: importing this module does not import DeepSpeed.
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    class _StagePipeline(PipelineModule):
        """One layer per stage, this rank's stage built, the others' never (placeholders)."""

        def __init__(self, stage: Transformer, dims: ParallelDims, tied: bool):
            layers = [stage if s == dims.pp_rank else LayerSpec(nn.Identity) for s in range(dims.pipeline)]
            # DeepSpeed's pipeline topology has no sequence axis. Its data axis spans the Ulysses
            # ranks too: with the data axis outside the sequence axis in our rank order, its
            # "data" groups are our sequence_data groups (a Ulysses rank's gradient is its
            # slice's share, to be summed over the sequence ranks and averaged over the data
            # ranks).
            topology = PipeModelDataParallelTopology(num_pp=dims.pipeline, num_mp=dims.tensor,
                                                     num_dp=dims.data * dims.ulysses)
            super().__init__(layers=layers, topology=topology, partition_method="uniform")
            # The factor a training loss is multiplied by before DeepSpeed's backward. The
            # engine averages gradients over its data axis, Ulysses ranks included, where they
            # must be summed: times ``ulysses`` (and build_engine divides by the accumulation
            # steps where the engine does not average them).
            self.train_scale = float(dims.ulysses)
            # The last stage's output layer is the loss function; a module attribute, so its
            # weights are this pipeline's parameters.
            self.head, stage.lm_head = stage.lm_head, None
            if self.head is not None:
                self.loss_fn = self.loss
            first, last = dims.pp_rank == 0, dims.pp_rank == dims.pipeline - 1
            self._tied: list[tuple[nn.Parameter, object]] = []
            if tied and (first or last):
                weight = stage.tok_emb.weight if first else self.head.weight
                self._tied = [(weight, dims.group("embedding"))]
            deepspeed_internals.mark_pipeline_parameters(
                self, dims.tp_rank, tied_copy=self.head.weight if tied and last else None)

        def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            """The mean next-token loss of the last stage's normed hidden states (B, T, D)."""
            loss = self.head(h, targets)
            return loss * self.train_scale if torch.is_grad_enabled() else loss

        def get_tied_weights_and_groups(self) -> list[tuple[nn.Parameter, object]]:
            """The tied embedding and the group of its first and last stage, whose gradients
            DeepSpeed's engine sums after the backward passes (its tied-weight step)."""
            return self._tied

    return _StagePipeline
