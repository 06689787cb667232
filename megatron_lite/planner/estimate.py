"""Memory and throughput estimates for a recipe on a machine, before queueing for it.

Memory per device, in GB (10^9 bytes), of the largest pipeline stage:

- **Model states** (ZeRO paper accounting). Mixed precision (bf16/fp16) keeps 2 bytes of weights,
  2 of gradients and 12 of optimizer state (fp32 master copy, Adam's two moments) per parameter:
  16 in all. fp32 keeps 4 + 4 + 8. ZeRO-1 divides the optimizer state, ZeRO-2 also the gradients,
  ZeRO-3 also the weights, by the ranks they are sharded over (data × Ulysses; under HSDP the
  shard group only, since its copies hold the same partitions).
  Tensor parallelism divides everything but the norms (replicated), pipeline parallelism keeps
  only a stage's layers.
- **Offload** (ZeRO-Offload / ZeRO-Infinity): ``parallel.offload_optimizer`` moves the fp32
  master weights, the Adam moments and an fp32 gradient partition (4 + 8 + 4 = 16 bytes per
  parameter, divided by the ZeRO ranks) to host memory (``cpu``) or NVMe files (``nvme``); the
  device keeps no optimizer state and, with ZeRO-2/3, no gradient partition (ZeRO-1 still holds
  whole gradients). ``parallel.offload_params`` (ZeRO-3)
  moves the sharded weights the same way. Host memory is per node (ranks per node × per rank).
- **Gathered under ZeRO-3**: ZeRO-3 materializes each parameter whole just before its layer runs,
  with its whole gradient after, then frees both; the largest one sets the peak (``gathered``:
  weight and gradient bytes of the largest parameter). That is a block linear's weight (its
  tensor-parallel slice; with ``parallel.tile_factor`` one tile of factor² ones) or a
  vocabulary layer's (never tiled). A layer larger than the device shows here first.
- **Activations** per transformer block and micro-batch of ``b`` sequences of ``s`` tokens
  (Korthikanti et al. 2022, for an attention kernel that stores no score matrix, as SDPA's
  flash/memory-efficient kernels do): elements kept for backward are the two norms' inputs and
  outputs (4·s·b·h, split over tensor ranks only with sequence parallelism), the q/k/v and
  attention outputs (s·b·(2h + 2·h_kv)) and the MLP's (s·b·3F for SwiGLU, s·b·2F for GELU), the
  latter two split over tensor ranks. Ulysses splits ``s``. With activation checkpointing a
  block keeps only its input (s·b·h) plus one block's full set while it is recomputed. Under
  1F1B the first stage holds min(pipeline, accumulation) micro-batches in flight.
- **Output layer and loss** (``output_layer_bytes``), at their peak at the end of the forward
  pass, when every block's activations are still held: the final norm's input and output, and
  the loss's working set. Without tensor parallelism that is one chunk of logits
  (``model.loss.chunk_rows``) with its softmax gradient, the hidden states' gradient and the
  weight gradient's fp32 sum; with it, each rank's (tokens × vocab/tensor) logits in fp32 twice.

Not counted: framework buffers (ZeRO-3 prefetch of the next parameters, communication buckets, the allocator's
fragmentation, the CUDA context) — keep 10-20% free. FLOPs per token: ``model.flops``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_lite.config.schema import Config, ModelConfig
from megatron_lite.distributed.device import DeviceSpec
from megatron_lite.distributed.parallel_dims import ParallelDims
from megatron_lite.model.flops import ParameterCounts, flops_per_token, parameter_counts
from megatron_lite.model.loss import chunk_rows, compiles_softmax_pass
from megatron_lite.parallel.stages import stage_layers

GB = 1e9


@dataclass(frozen=True)
class Plan:
    dims: ParallelDims
    model: ModelConfig
    counts: ParameterCounts
    stage_parameters: int
    """Parameters held by one rank of the largest stage (after tensor parallelism)."""
    stage_blocks: int
    in_flight: int
    """Micro-batches whose activations the first stage holds at once."""
    weights: float
    grads: float
    optimizer: float
    host: float
    """Offloaded state in host memory, per rank."""
    nvme: float
    """Offloaded state in NVMe files, per rank."""
    activations: float
    activations_if: dict[str, float]
    """Activations under each ``activation_checkpointing`` setting (none, full, selective)."""
    output_layer: float
    """The final norm's activations and the loss's working memory (``output_layer_bytes``)."""
    gathered: float
    """ZeRO-3: the largest parameter gathered whole, with its gradient (``largest_gathered``)."""
    flops_per_token: float
    tokens_per_step: int
    grad_accumulation: int

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.activations
                + self.output_layer + self.gathered)


def largest_gathered(m: ModelConfig, tensor: int, tile_factor: int) -> int:
    """Elements of the largest parameter ZeRO-3 gathers whole on one rank: a block linear's
    weight (its tensor-parallel slice, one of tile_factor² tiles) or a vocabulary layer's."""
    widest = max(m.n_heads * m.head_dim, m.mlp_hidden)  # q/o or the MLP's, against d_model
    block = widest * m.d_model // tensor // tile_factor**2
    assert m.vocab_size is not None
    return max(block, m.vocab_size * m.d_model // tensor)


def activation_bytes(m: ModelConfig, cfg: Config, dims: ParallelDims, recompute: str) -> float:
    """Activation memory of one block for one micro-batch on one rank, under
    ``model.activation_checkpointing`` = ``recompute``."""
    b, s, h = cfg.training.micro_batch_size, cfg.data.seq_length / dims.sequence, m.d_model
    t = dims.tensor
    width = 4 if cfg.training.precision == "fp32" else 2
    h_kv = m.kv_heads * m.head_dim
    ffn = m.mlp_hidden
    sp = t if dims.sequence_parallel else 1
    if recompute == "full":
        return width * s * b * h / sp
    if recompute == "selective":
        # Kept: the block's input, the outputs of the matrix products (q, k, v, gate, up; o and
        # down reduced over the tensor ranks) and the attention's output.
        replicated = 3 * s * b * h / sp
        split = s * b * (2 * h + 2 * h_kv + (2 if m.activation == "swiglu" else 1) * ffn) / t
        return width * (replicated + split)
    replicated = 4 * s * b * h / sp
    split = s * b * (2 * h + 2 * h_kv + (3 if m.activation == "swiglu" else 2) * ffn) / t
    return width * (replicated + split)


def loss_bytes(tokens: int, d_model: int, vocab: int, width: int, tensor: int = 1,
               compiled: bool = False, device_type: str = "cuda") -> float:
    """Peak working memory of the output layer and loss (``model/loss.py``; with ``tensor`` > 1
    ``parallel/tensor_parallel.py``) over ``tokens`` rows of ``d_model`` hidden states in
    ``width``-byte weights; ``compiled``: the softmax pass compiled (``training.compile`` off CPU).
    Measured against the real code in ``tests/unit/test_planner.py``. Up to ``SMALL_LOGITS`` the
    trainer takes the plain cross-entropy instead, whose few MiB this does not model apart."""
    if tensor > 1:
        # Vocabulary-parallel cross-entropy: the rank's logits, an fp32 copy (mixed precision
        # only) and the max-shifted exponentials that become the saved softmax.
        return (8 + (width if width != 4 else 0)) * tokens * vocab / tensor
    chunk = min(tokens, chunk_rows(vocab, device_type)) * vocab  # logits per chunk
    if compiled:
        per_logit = 2 * width  # one pass: logits in, gradient out
    elif width == 4:
        per_logit = 8 if device_type == "cpu" else 4  # aten's softmax out of place / in place
    else:
        per_logit = 2 * width + 4  # logits, their fp32 copy turned gradient, its cast back
    # The (N, D) gradient of the hidden states and the (V, D) weight gradient summed in fp32.
    return per_logit * chunk + width * tokens * d_model + 4 * vocab * d_model


def output_layer_bytes(m: ModelConfig, cfg: Config, dims: ParallelDims, device_type: str = "cuda") -> float:
    """Peak memory of the final norm, the output layer and the loss for one micro-batch on one
    rank, beyond the weights and the blocks' activations."""
    assert m.vocab_size is not None
    tokens = cfg.training.micro_batch_size * cfg.data.seq_length // dims.sequence  # rows into the head
    width = 4 if cfg.training.precision == "fp32" else 2
    sp = dims.tensor if dims.sequence_parallel else 1
    final_norm = 2 * width * tokens * m.d_model / sp  # its input and output, kept for backward
    compiled = cfg.training.compile and compiles_softmax_pass(device_type)
    return final_norm + loss_bytes(tokens, m.d_model, m.vocab_size, width, dims.tensor, compiled, device_type)


def estimate(cfg: Config, model: ModelConfig, world_size: int, gpus_per_node: int) -> Plan:
    """The plan of ``cfg`` (model resolved) on ``world_size`` ranks, ``gpus_per_node`` per node."""

    dims = ParallelDims.plan(cfg, world_size, local_world_size=gpus_per_node)
    counts = parameter_counts(model)
    stages = stage_layers(counts, dims.pipeline, cfg.parallel.pipeline_partition)
    tied_on_last = model.tie_embeddings and dims.pipeline > 1
    per_rank = []
    for k, (first, end, params) in enumerate(stages):
        last = k == len(stages) - 1
        if tied_on_last and last:
            params += counts.embedding
        norms = (end - first) * counts.block_norms + (counts.head_norm if last else 0)
        per_rank.append(((params - norms) / dims.tensor + norms, end - first))
    # The stage with the most parameters and the one with the most blocks (the first, under
    # 1F1B, holds the most micro-batches): both maxima, to stay on the safe side.
    p = max(x for x, _ in per_rank)
    blocks = max(b for _, b in per_rank)

    mixed = cfg.training.precision != "fp32"
    w_bytes, g_bytes, o_bytes = (2, 2, 12) if mixed else (4, 4, 8)
    stage = cfg.parallel.deepspeed_zero_stage
    shard = dims.hsdp_shard_size or dims.data * dims.sequence
    weights = p * w_bytes / (shard if stage >= 3 else 1)
    grads = p * g_bytes / (shard if stage >= 2 else 1)
    optimizer = p * o_bytes / (shard if stage >= 1 else 1)
    offloaded = {"cpu": 0.0, "nvme": 0.0}
    where = cfg.parallel.offload_optimizer
    if where != "none":
        # fp32 master weights, Adam's two moments and the fp32 gradient: 16 bytes per parameter
        # (in fp32 training too: the host keeps its own fp32 copy to update).
        offloaded[where] += p * 16 / shard
        optimizer = 0.0
        grads = grads if stage == 1 else 0.0
    if cfg.parallel.offload_params != "none":
        offloaded[cfg.parallel.offload_params] += weights
        weights = 0.0
    gathered = 0.0
    if stage == 3:
        gathered = (w_bytes + g_bytes) * largest_gathered(model, dims.tensor, cfg.parallel.tile_factor)

    accum = dims.grad_accumulation(cfg)
    in_flight = min(dims.pipeline, accum) if dims.pipeline > 1 else 1
    recompute = model.activation_checkpointing

    def acts(rc: str) -> float:
        stored = blocks * in_flight * activation_bytes(model, cfg, dims, rc)
        # While a checkpointed block is recomputed its full activations exist once more.
        return stored + (activation_bytes(model, cfg, dims, "none") if rc != "none" else 0.0)

    every = {rc: acts(rc) for rc in ("none", "full", "selective")}

    return Plan(dims, model, counts, int(p), blocks, in_flight, weights, grads, optimizer,
                offloaded["cpu"], offloaded["nvme"],
                every[recompute], every, output_layer_bytes(model, cfg, dims), gathered,
                flops_per_token(model, cfg.data.seq_length),
                dims.global_batch(cfg) * cfg.data.seq_length, accum)


def step_time(plan: Plan, spec: DeviceSpec, precision: str, mfu: float) -> tuple[float, float]:
    """(seconds per step, tokens per second) at the stated MFU."""
    peak = spec.fp32 if precision == "fp32" else spec.bf16
    seconds = plan.flops_per_token * plan.tokens_per_step / (plan.dims.world_size * peak * mfu)
    return seconds, plan.tokens_per_step / seconds


def fits(plan: Plan, spec: DeviceSpec) -> bool:
    return plan.total <= spec.memory_gb * GB


def host_per_node(plan: Plan, gpus_per_node: int) -> float:
    """Offloaded host memory of one node (its ranks' shares)."""
    return plan.host * min(gpus_per_node, plan.dims.world_size)


def round_gb(x: float) -> float:
    return math.floor(x / GB * 100 + 0.5) / 100
