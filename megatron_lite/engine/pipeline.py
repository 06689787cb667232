"""Pipeline parallelism through DeepSpeed's pipeline engine, which runs 1F1B over the
micro-batches. It is given one layer per stage, this rank's stage (``parallel/stages.py``:
``keep_stage``), through ``pipeline_module``. The last stage's output layer is the pipeline's
loss function. With tied embeddings the last stage holds a copy of the first stage's embedding
matrix: their gradients are summed over the ``embedding`` group (``ParallelDims``) by
DeepSpeed's tied-weight step, and the copy is counted once in the gradient norm and the
checkpoint (``engine/internals.py``).
"""

from __future__ import annotations

import collections
import functools

import torch
from torch import nn

from megatron_lite.distributed.parallel_dims import ParallelDims
from megatron_lite.engine import internals
from megatron_lite.engine.versions import GAS_SCALING_ALWAYS, deepspeed_version
from megatron_lite.model.transformer import Transformer


def loss_scale(dims: ParallelDims, grad_accum: int) -> float:
    """The factor a pipeline's training loss is multiplied by before DeepSpeed's backward (the
    loss it reports is divided by it again: ``StepRunner``). The engine averages gradients over
    its data axis, sequence ranks included, where they must be summed: times ``sequence``. A
    release that sums the ``grad_accum`` accumulation steps' gradients instead of averaging them
    (``versions.GAS_SCALING_ALWAYS``) gets them averaged through the loss."""
    scale = float(dims.sequence)
    if deepspeed_version() < GAS_SCALING_ALWAYS:
        scale /= grad_accum
    return scale


def keep_output_layer_gradient(engine) -> None:
    """The last stage of a pipeline in bf16 without ZeRO: DeepSpeed's bf16 optimizer (from 0.18.3)
    clears the bf16 gradients when each backward pass starts (its ``backward_prologue``), which
    a hook on the engine's module output runs. The output layer runs after that output, in the
    engine's loss function, so its gradient is there before the hook fires and was cleared with
    the rest: the layer never trained. Cleared after each backward pass instead, once the
    optimizer has added them to its fp32 gradients (``backward_epilogue``): the same gradients
    at the start of the next pass, the output layer's kept. (Releases before 0.18.3 have no
    prologue and clear them before the pass.)"""
    opt = engine.optimizer
    if not hasattr(opt, "backward_prologue"):
        return
    epilogue = opt.backward_epilogue

    def backward_epilogue(update_hp_grads: bool = True, **kwargs):
        result = epilogue(update_hp_grads=update_hp_grads, **kwargs)
        if update_hp_grads:  # now in the fp32 gradients
            opt.clear_lp_grads()
        return result

    opt.backward_prologue = lambda: None
    opt.backward_epilogue = backward_epilogue


def pipeline_module(stage: Transformer, dims: ParallelDims, tied: bool, train_scale: float) -> nn.Module:
    """The DeepSpeed ``PipelineModule`` around this rank's ``stage`` (``keep_stage``);
    ``tied``: the model ties its embedding and output layer; ``train_scale``: the factor its
    training loss carries (``loss_scale``)."""
    return _stage_pipeline_class()(stage, dims, tied, train_scale)


@functools.cache
def _stage_pipeline_class() -> type:
    # Defined on first use: importing this module does not import DeepSpeed.
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    class _StagePipeline(PipelineModule):
        """One layer per stage, this rank's stage built, the others' never (placeholders)."""

        def __init__(self, stage: Transformer, dims: ParallelDims, tied: bool, train_scale: float):
            layers = [stage if s == dims.pp_rank else LayerSpec(nn.Identity) for s in range(dims.pipeline)]
            # DeepSpeed's pipeline topology has no sequence axis. Its data axis spans the sequence
            # (Ulysses × context) ranks too: with the data axis outside the sequence axes in our
            # rank order, its "data" groups are our sequence_data groups (a sequence rank's
            # gradient is its slice's share, to be summed over the sequence ranks and averaged
            # over the data ranks).
            topology = PipeModelDataParallelTopology(num_pp=dims.pipeline, num_mp=dims.tensor,
                                                     num_dp=dims.data * dims.sequence)
            super().__init__(layers=layers, topology=topology, partition_method="uniform")
            self.train_scale = train_scale
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
            internals.mark_pipeline_parameters(
                self, dims.tp_rank, tied_copy=self.head.weight if tied and last else None)
            # Attention within documents: DeepSpeed hands a stage only the previous stage's
            # output, so each micro-batch's documents come beside it, queued in micro-batch
            # order by the step (every stage reads its data rank's batches); the stage's
            # forward takes the next one (an activation recomputation keeps its own).
            self.documents: collections.deque = collections.deque()
            self.takes_documents = False
            stage.register_forward_pre_hook(self._with_documents, with_kwargs=True)

        def _with_documents(self, module, args, kwargs):
            if not self.takes_documents:
                return None
            if not self.documents:
                raise RuntimeError("pipeline stage: a micro-batch ran without its documents (the step "
                                   "queues them: StepRunner._stage_pairs)")
            return args, {**kwargs, "documents": self.documents.popleft()}

        def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            """The mean next-token loss of the last stage's normed hidden states (B, T, D)."""
            loss = self.head(h, targets)
            return loss * self.train_scale if torch.is_grad_enabled() else loss

        def get_tied_weights_and_groups(self) -> list[tuple[nn.Parameter, object]]:
            """The tied embedding and the group of its first and last stage, whose gradients
            DeepSpeed's engine sums after the backward passes (its tied-weight step)."""
            return self._tied

    return _StagePipeline
