"""The parallelize step: turns the plain model (built on the meta device, every parameter tagged
with its ``ShardSpec``) into this rank's part, and ``materialize``, which gives
it its weights (the order of a build: ``build.py``).

``parallelize`` swaps in tensor-parallel slices, sequence-parallel communication and the
Ulysses attention; every swapped parameter records which slice of which plain one it is. At
size 1 every step leaves the layer as it is.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import torch
from torch import nn

import megatron_lite.parallel.comm as comm
from megatron_lite.config.schema import ModelConfig
from megatron_lite.distributed.device import DeviceKernels
from megatron_lite.distributed.parallel_dims import ParallelDims, TopologyError
from megatron_lite.distributed.shard_spec import spec
from megatron_lite.engine.internals import KEPT_BY_SELECTIVE
from megatron_lite.engine.versions import ulysses_head_problems
from megatron_lite.model.loss import compiles_softmax_pass, linear_cross_entropy, softmax_xent_grad
from megatron_lite.model.transformer import (
    Block,
    CausalAttention,
    LMHead,
    RMSNorm,
    Transformer,
    initial_value,
)
from megatron_lite.parallel.random import TensorParallelRNG
from megatron_lite.parallel.ring import RingAttention
from megatron_lite.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelRegion,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    slice_of,
)
from megatron_lite.parallel.ulysses import HeldPositions, SequenceMeanLoss, UlyssesAttention

InitialValue = Callable[[str, tuple[int, ...]], torch.Tensor]
"""A parameter's full value in the plain model from its name and full shape."""


class ScatterSequence(nn.Module):
    """Keeps this tensor rank's slice of the sequence (entering the sequence-parallel region)."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return comm.scatter_sequence(x, self.group)


def sum_grads_over_tensor_ranks(module: nn.Module, dims: ParallelDims) -> None:
    for param in module.parameters():
        comm.sum_gradient_over(param, dims.group("tensor"))


def parallelize_block(block: Block, dims: ParallelDims) -> None:
    if dims.tensor > 1:
        group, rank, size, sp = dims.group("tensor"), dims.tp_rank, dims.tensor, dims.sequence_parallel
        attn, mlp = block.attn, block.mlp
        # Whole key/value groups per rank (q|k|v is grouped by key/value head: model/fused.py),
        # so each rank's query heads share its key/value heads.
        attn.qkv_proj = ColumnParallelLinear(attn.qkv_proj, rank, size)
        attn.o_proj = RowParallelLinear(attn.o_proj, rank, size)
        if attn.core.dropout > 0:
            attn.core = TensorParallelRNG(attn.core, rank)
        # SwiGLU's gate and up rows are interleaved, so each rank's slice holds matching pairs.
        name = "gate_up_proj" if mlp.swiglu else "up_proj"
        setattr(mlp, name, ColumnParallelLinear(getattr(mlp, name), rank, size))
        mlp.down_proj = RowParallelLinear(mlp.down_proj, rank, size)
        block.attn = TensorParallelRegion(attn, "o_proj", group, sp)
        block.mlp = TensorParallelRegion(mlp, "down_proj", group, sp)
        # A parameter inside a region that is not sliced (a per-head norm, say) sees only this
        # rank's heads or columns: its gradient is the sum over the tensor ranks. (The row-
        # parallel bias is added after the region, to the reduced output.)
        for inner, out in ((attn, attn.o_proj), (mlp, mlp.down_proj)):
            for param in inner.parameters():
                if not spec(param).sharded and param is not out.bias:
                    comm.sum_gradient_over(param, group)
        if sp:
            # Norms and the row-parallel biases see a slice of the sequence on each rank.
            for module in (block.attn_norm, block.mlp_norm):
                sum_grads_over_tensor_ranks(module, dims)
            for bias in (attn.o_proj.bias, mlp.down_proj.bias):
                if bias is not None:
                    comm.sum_gradient_over(bias, group)
    attn = block.attn.inner if isinstance(block.attn, TensorParallelRegion) else block.attn
    if dims.context > 1:
        # The ring runs on the heads this rank attends: after the Ulysses all-to-all (USP), which
        # wraps it below.
        attn.core = RingAttention(attn.core, dims.group("context"), dims.context_rank, dims.context)
    if dims.ulysses > 1:
        # With tensor parallelism this rank's heads are its tensor slice's: the all-to-all
        # splits those over the Ulysses ranks.
        problems = ulysses_head_problems(attn.n_heads, attn.n_kv_heads, dims.ulysses, dims.tensor)
        if problems:  # the same on every rank: said once
            raise TopologyError("; ".join(problems))
        attn.core = UlyssesAttention(attn.core, dims.group("ulysses"))


def parallelize_embedding(owner: nn.Module, dims: ParallelDims) -> None:
    """``owner`` holds ``tok_emb``, ``pos_emb`` and ``drop`` (the model, or the first stage)."""
    if dims.tensor > 1:
        owner.tok_emb = VocabParallelEmbedding(owner.tok_emb, dims.tp_rank, dims.tensor,
                                               dims.group("tensor"))
        if dims.sequence_parallel:
            # Dropout after the scatter: each rank drops on its own slice.
            owner.drop = nn.Sequential(ScatterSequence(dims.group("tensor")), owner.drop)
    if dims.sequence > 1 and owner.pos_emb is not None:
        owner.pos_emb = HeldPositions(owner.pos_emb, dims.ulysses, dims.ulysses_rank, dims.context,
                                      dims.context_rank)


def parallelize_head(owner: nn.Module, dims: ParallelDims, tied_weight: nn.Parameter | None) -> None:
    """``owner`` holds ``norm`` and ``lm_head``; ``tied_weight`` is the (sliced) embedding when
    the model ties them."""
    if dims.tensor > 1:
        weight = tied_weight
        if weight is None:
            weight = slice_of(owner.lm_head.weight, 0, dims.tp_rank, dims.tensor)
        owner.lm_head = VocabParallelLMHead(weight, dims.tp_rank, dims.group("tensor"),
                                            dims.sequence_parallel, owner.lm_head.used)
        if dims.sequence_parallel:
            sum_grads_over_tensor_ranks(owner.norm, dims)
    if dims.sequence > 1:
        owner.lm_head = SequenceMeanLoss(owner.lm_head, dims.group("sequence"), dims.sequence)


def parallelize(model: Transformer, dims: ParallelDims) -> Transformer:
    """Apply tensor, Megatron-sequence, Ulysses and context parallelism to a tagged meta model
    in place."""
    for block in model.blocks.values():
        parallelize_block(block, dims)
    parallelize_embedding(model, dims)
    parallelize_head(model, dims, model.tok_emb.weight if model.cfg.tie_embeddings else None)
    return model


@torch.no_grad()
def materialize(module: nn.Module, cfg: ModelConfig, device: torch.device | str, seed: int,
                partition: Callable[[nn.Parameter], None] | None = None,
                dtype: torch.dtype | None = None, initial: InitialValue | None = None) -> nn.Module:
    """Replace ``module``'s meta parameters by ones on ``device``, each filled with its slice of
    the plain model's initial value (``initial(name, full_shape)`` where given: weights read from
    another model, ``checkpoint.init_from``). (``Module.to_empty`` would make a tied weight two
    parameters and drop the attributes set by ``parallelize``.) ``partition``: called on each
    parameter once it is filled (ZeRO-3's partitioned initialisation keeps only this rank's
    part, so the rank never holds more than its parts and one whole parameter); ``dtype``: the
    parameters' type on the device (default: the model's)."""
    done: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for key, old in list(sub.named_parameters(recurse=False)):
            if id(old) not in done:
                new = nn.Parameter(torch.empty(old.shape, dtype=dtype or old.dtype, device=device),
                                   requires_grad=old.requires_grad)
                new.__dict__.update(old.__dict__)  # the ShardSpec and DeepSpeed's marks
                where = spec(new)
                # Drawn whole on the host; only this rank's slice goes to the device.
                full = (initial(where.name, where.full_shape) if initial is not None
                        else initial_value(cfg, where.name, where.full_shape, seed))
                new.copy_(where.local(full))
                comm.register_gradient_sum(new)
                if partition is not None:
                    partition(new)
                done[id(old)] = new
            setattr(sub, key, done[id(old)])
        for key, buf in list(sub.named_buffers(recurse=False)):
            if buf.device.type == "meta":
                setattr(sub, key, torch.empty_like(buf, device=device))
    for sub in module.modules():
        if hasattr(sub, "reset_buffers"):
            sub.reset_buffers()
    return module


def use_selective_recompute(module: nn.Module) -> None:
    """Give every ``Transformer`` in ``module`` (a pipeline stage's too) the ops selective
    recomputation keeps (``engine.internals.KEPT_BY_SELECTIVE``)."""
    for m in module.modules():
        if isinstance(m, Transformer):
            m.kept_ops = KEPT_BY_SELECTIVE


def use_loss_mask(module: nn.Module) -> None:
    """``data.eod_mask_loss``: the output layers leave targets marked ``IGNORED`` out of the
    loss and its mean (the sequence-parallel loss weights each slice by what it counts)."""
    for m in module.modules():
        if isinstance(m, (LMHead, VocabParallelLMHead, SequenceMeanLoss)):
            m.skips_ignored = True


def compile_blocks(module: nn.Module, backend: str) -> int:
    """``torch.compile`` every transformer block in place (parameter names unchanged), and on
    accelerators the softmax-gradient pass of the output layer's fused loss; returns how many
    blocks. Blocks,
    not the whole model: every block has the same graph, so one compilation serves all, and the
    loss's chunk loop and the pipeline's stage boundaries stay eager."""
    blocks = [m for m in module.modules() if isinstance(m, Block)]
    for block in blocks:
        block.compile(backend=backend)
    if not compiles_softmax_pass(next(module.parameters()).device.type):
        return len(blocks)
    compiled = functools.partial(linear_cross_entropy,
                                 softmax_grad=torch.compile(softmax_xent_grad, backend=backend))
    for m in module.modules():
        if isinstance(m, LMHead) and m.loss_fn is linear_cross_entropy:
            m.loss_fn = compiled
    return len(blocks)


def loss_kernel_problem(kernels: str, device_type: str) -> str | None:
    """Why ``training.kernels`` cannot run on this device with this machine's libraries, or None."""
    if kernels == "torch":
        return None
    if device_type != "cuda":
        return (f"training.kernels=liger runs Liger Kernel's Triton kernels, which need a CUDA GPU; "
                f"this run is on '{device_type}': use training.kernels=torch")
    if importlib.util.find_spec("liger_kernel") is None:
        return ("training.kernels=liger needs the liger-kernel package: pip install liger-kernel (or use "
                "training.kernels=torch)")
    return None


def use_loss_kernel(module: nn.Module, kernels: str, device_type: str) -> int:
    """``training.kernels``: put a library's fused output layer + loss into every single-device
    output layer; returns how many. ``torch`` keeps ``model/loss.py``."""
    if kernels == "torch":
        return 0
    problem = loss_kernel_problem(kernels, device_type)
    if problem:
        raise RuntimeError(problem)
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError as e:  # installed, but its own dependencies (Triton) are not
        raise RuntimeError(f"training.kernels=liger: liger-kernel does not import ({e}); fix its "
                           "installation or use training.kernels=torch") from e
    heads = [m for m in module.modules() if isinstance(m, LMHead)]
    for head in heads:
        head.loss_fn = liger_fused_linear_cross_entropy
    return len(heads)


def use_device_kernels(module: nn.Module, kernels: DeviceKernels) -> list[str]:
    """Plug a device's fused kernels (Gaudi's) into the model's seams: every attention core's
    attention and RoPE, every RMSNorm. A kernel that is None leaves the reference in place.
    Returns the names of the kernels plugged in."""
    used = []
    for m in module.modules():
        if isinstance(m, CausalAttention):
            if kernels.attention is not None:
                m.sdpa = kernels.attention
                used.append("attention")
            if kernels.rope is not None:
                m.rotate = kernels.rope
                used.append("rope")
        elif isinstance(m, RMSNorm) and kernels.rms_norm is not None:
            m.kernel = kernels.rms_norm
            used.append("rms_norm")
    return sorted(set(used))


def local_shards(module: nn.Module) -> list[tuple[str, tuple, torch.Tensor]]:
    """This rank's parameters as (plain-model name, cuts (``ShardSpec.cuts``), value)."""
    return [(spec(p).name, spec(p).cuts, p.detach().cpu().clone()) for p in module.parameters()]
