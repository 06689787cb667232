"""Pipeline parallelism: the model as a DeepSpeed ``PipelineModule`` of layer specs.

Layers: embedding (tied with the output layer when the model ties them), one spec per
transformer block, final norm, output layer. DeepSpeed builds only this stage's layers and runs
1F1B over the micro-batches of a step. Each layer is built on the meta device, parallelized
(tensor/sequence parallelism as in ``apply``) and materialised from the plain model's names, so
the stages start from exactly the single-process weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_lite.config.schema import ModelConfig
from megatron_lite.distributed.parallel_dims import ParallelDims
from megatron_lite.model.transformer import Block, LMHead, make_norm, rope_tables
from megatron_lite.parallel.apply import (
    materialize,
    parallelize_block,
    parallelize_embedding,
    parallelize_head,
    sum_grads_over_tensor_ranks,
    tag_names,
)
from megatron_lite.parallel.tensor_parallel import vocab_parallel_cross_entropy


class _Stage(nn.Module):
    def _finish(self, cfg: ModelConfig, dims: ParallelDims, device, seed: int) -> None:
        materialize(self, cfg, device, seed)
        if dims.tp_rank == 0:
            # DeepSpeed's gradient norm counts a parameter that is not tensor-parallel only on
            # model-parallel rank 0, which under pipelining is one stage; count each stage's
            # replicated parameters on its tensor rank 0 instead.
            for p in self.parameters():
                p.model_parallel = True


class EmbeddingStage(_Stage):
    """Token (and learned position) embeddings; on the last stage, with ``positions=False``,
    the copy of the token embedding that the tied output layer uses."""

    def __init__(self, cfg: ModelConfig, dims: ParallelDims, device, seed: int, positions: bool = True):
        super().__init__()
        with torch.device("meta"):
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            learned = positions and cfg.position == "learned"
            self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if learned else None
        self.drop = nn.Dropout(cfg.dropout)
        tag_names(self)
        parallelize_embedding(self, dims)
        self.dims = dims
        self._finish(cfg, dims, device, seed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)  # (B, T, D)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(tokens.size(1), device=tokens.device))
        return self.drop(x)

    @property
    def weight(self) -> nn.Parameter:
        """The (sliced) embedding matrix, tied to the output layer on the last stage."""
        return self.tok_emb.weight

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return output_logits(x, self.tok_emb.weight, self.dims)


class BlockStage(_Stage):
    def __init__(self, cfg: ModelConfig, index: int, dims: ParallelDims, device, seed: int):
        super().__init__()
        with torch.device("meta"):
            self.block = Block(cfg)
        tag_names(self.block, f"blocks.{index}.")
        parallelize_block(self.block, dims)
        self.checkpointing = cfg.activation_checkpointing
        self.cfg = cfg
        self._finish(cfg, dims, device, seed)

    def reset_buffers(self) -> None:
        if self.cfg.position == "rope":
            cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len,
                                   self.cfg.rope_theta)
            device = next(self.parameters()).device
            self.rope = (cos.to(device), sin.to(device))
        else:
            self.rope = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing and self.training:
            return checkpoint(self.block, x, self.rope, use_reentrant=False)
        return self.block(x, self.rope)


class HeadStage(_Stage):
    """Final norm, and the output layer unless it is tied to the embedding."""

    def __init__(self, cfg: ModelConfig, dims: ParallelDims, device, seed: int):
        super().__init__()
        with torch.device("meta"):
            self.norm = make_norm(cfg)
            self.lm_head = (None if cfg.tie_embeddings
                            else LMHead(cfg.d_model, cfg.vocab_size, cfg.tokenizer_vocab_size))
        tag_names(self)
        self.dims = dims
        if self.lm_head is not None:
            parallelize_head(self, dims, None)
        elif dims.sequence_parallel:
            sum_grads_over_tensor_ranks(self.norm, dims)
        self._finish(cfg, dims, device, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        if self.lm_head is None:
            return x
        return output_logits(x, self.lm_head.weight, self.dims)


def output_logits(x: torch.Tensor, weight: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """(B, T, D) -> this rank's (B, T, V/tp) logits (the loss function finishes the job)."""
    if dims.tensor > 1:
        from megatron_lite.parallel import comm

        x = comm.enter_region(x, dims.group("tensor"), dims.sequence_parallel)
    return F.linear(x, weight)


class PipelineLoss:
    """Mean next-token loss of the last stage's logits (vocabulary-parallel under TP) over the
    tokenizer's ``used`` ids (padding columns take no part)."""

    def __init__(self, dims: ParallelDims, vocab_size: int, used: int):
        self.dims, self.used = dims, used
        self.start = dims.tp_rank * (vocab_size // dims.tensor)
        # The factor a training loss is multiplied by before DeepSpeed's backward (build_engine
        # sets 1/accumulation steps where the pipeline engine does not average them itself).
        self.train_scale = 1.0

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits, targets = logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
        if self.dims.tensor == 1:
            loss = F.cross_entropy(logits[:, :self.used].float(), targets)
        else:
            loss = vocab_parallel_cross_entropy(logits, targets, self.dims.group("tensor"), self.start,
                                                self.used).mean()
        return loss * self.train_scale if torch.is_grad_enabled() else loss


def build_pipeline(cfg: ModelConfig, dims: ParallelDims, device, seed: int, partition: str):
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    if cfg.tie_embeddings:
        first = TiedLayerSpec("embed", EmbeddingStage, cfg, dims, device, seed, tied_weight_attr="weight")
    else:
        first = LayerSpec(EmbeddingStage, cfg, dims, device, seed)
    layers = [first, *(LayerSpec(BlockStage, cfg, i, dims, device, seed) for i in range(cfg.n_layers)),
              LayerSpec(HeadStage, cfg, dims, device, seed)]
    if cfg.tie_embeddings:
        layers.append(TiedLayerSpec("embed", EmbeddingStage, cfg, dims, device, seed, False,
                                    forward_fn=lambda module, x: module.logits(x),
                                    tied_weight_attr="weight"))
    topology = PipeModelDataParallelTopology(num_pp=dims.pipeline, num_mp=dims.tensor, num_dp=dims.data)
    method = "type:BlockStage" if partition == "type:Block" else partition
    loss = PipelineLoss(dims, cfg.vocab_size, cfg.tokenizer_vocab_size)
    return PipelineModule(layers=layers, topology=topology, loss_fn=loss, partition_method=method)
