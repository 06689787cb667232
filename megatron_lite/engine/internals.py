"""Everything this project relies on that DeepSpeed or torch does not document as public.

One place, so that an upgrade that renames any of it fails a test, by name (``RELIED_ON``,
checked by tests/unit/test_deepspeed_internals.py and tests/distributed/test_relied_on.py),
instead of silently changing a gradient norm or a skipped update somewhere else; the same tests
refuse a private name used anywhere else in the package.

Parameter attributes DeepSpeed reads:
- ``tensor_model_parallel``: a tensor-parallel slice, counted in the gradient norm on every
  tensor rank;
- ``model_parallel``: counted on every rank it appears on (a replicated parameter is otherwise
  counted only on model-parallel rank 0, which under pipelining is the first stage alone);
- ``ds_pipe_replicated``: a second copy (a tied weight on a later stage), counted once.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.distributed.cpu_extensions import OP_BUILD_CALL
from megatron_lite.model.attention_math import additive_mask, math_attention, math_attention_backward

# Every name of DeepSpeed or torch relied on that is not their documented API: (where, name).
# ``where`` says how the installed release is checked, always on the real thing:
#   "built ROOT.path"   an attribute of a real object: tests/distributed/relied_on_worker.py builds
#                       DeepSpeed engines of each kind (ROOT: fp32, bf16, zero1, zero3, pipe,
#                       pipe_bf16; each with .engine, .param, .init, .scheduler) and steps them;
#                       ``pipe_bf16_prologue`` is pipe_bf16 where its optimizer has a backward_prologue;
#                       ``unfused`` is the bf16 one where the release wraps it in
#                       FP16_UnfusedOptimizer (0.16 does not: BF16_Optimizer)
#   "attr MODULE:QUAL"  an attribute of a module, class or function
#   "body MODULE:QUAL"  the source of that function or class uses the name (an attribute, a
#                       name, a string, an import), parsed, not searched as text
#   "value MODULE:QUAL" that constant equals the name
RELIED_ON = (
    # torch: the LR scheduler's marks on the optimizer step it wraps (install_update_gate,
    # count_declined_update); the fused Adam's skip flag (StepRunner.gate); the default timeout
    # of groups made without one (collectives.set_default_timeout).
    ("built fp32.scheduler.optimizer.step", "_wrapped_by_lr_sched"),
    ("built fp32.scheduler.optimizer", "_opt_called"),
    ("body torch.optim:AdamW.step", "found_inf"),
    ("attr torch.distributed.distributed_c10d", "default_pg_timeout"),
    ("attr torch.distributed.distributed_c10d", "default_pg_nccl_timeout"),
    ("body torch.distributed.distributed_c10d:_get_default_timeout", "default_pg_timeout"),
    # DeepSpeed: the parameter marks its gradient norm reads.
    ("value deepspeed.runtime.constants:PIPE_REPLICATED", "ds_pipe_replicated"),
    ("body deepspeed.runtime.utils:is_model_parallel_parameter", "model_parallel"),
    ("body deepspeed.runtime.utils:is_model_parallel_parameter", "tensor_model_parallel"),
    # The engine.
    ("built fp32.engine", "clip_fp32_gradients"),
    ("built fp32.engine", "enable_backward_allreduce"),
    ("built fp32.engine", "zero_grad"),
    ("built fp32.engine", "mpu"),
    ("built fp32.engine", "global_steps"),
    ("built fp32.engine", "global_samples"),
    ("built pipe.engine", "total_loss"),
    ("built pipe.engine", "is_last_stage"),
    # (Read back by the public get_global_grad_norm; keep_clipped_norm sets it on the pipeline.)
    ("body deepspeed.runtime.engine:DeepSpeedEngine.get_global_grad_norm", "_global_grad_norm"),
    ("attr deepspeed.runtime.pipe.module:PipelineModule", "get_tied_weights_and_groups"),
    ("body deepspeed.runtime.pipe.engine:PipelineEngine", "loss_fn"),  # the last stage's loss
    # Its partitioners of layers over stages (parallel/stages.py).
    ("attr deepspeed.runtime.utils", "partition_balanced"),
    ("attr deepspeed.runtime.utils", "partition_uniform"),
    ("body deepspeed.runtime.pipe.engine:PipelineEngine", "get_tied_weights_and_groups"),
    # Its optimizers: the gradient norm, the fp32 copies, the lazily linked optimizer state.
    ("built zero1.engine.optimizer", "_global_grad_norm"),
    ("built zero1.engine.optimizer", "_lazy_init_hp_params_optimizer_state"),
    ("built zero1.engine.optimizer", "_hp_optimizer_states_linked"),
    ("built pipe_bf16.engine.optimizer", "_global_grad_norm"),
    ("built pipe_bf16.engine.optimizer", "_lazy_init_hp_params_optimizer_state"),
    # Where the bf16 optimizer clears its gradients when a backward starts (from 0.18.3; ROOT
    # pipe_bf16_prologue): engine/pipeline.py, keep_output_layer_gradient.
    ("built pipe_bf16_prologue.engine.optimizer", "backward_epilogue"),
    ("built pipe_bf16_prologue.engine.optimizer", "clear_lp_grads"),
    ("built unfused.engine.optimizer", "fp16_groups"),
    ("built unfused.engine.optimizer", "fp32_groups"),
    # (Also where no release here builds it for bf16 on a CPU: fp16 at ZeRO 0 gets it too.)
    ("body deepspeed.runtime.fp16.unfused_optimizer:FP16_UnfusedOptimizer.__init__", "fp16_groups"),
    ("body deepspeed.runtime.fp16.unfused_optimizer:FP16_UnfusedOptimizer.__init__", "fp32_groups"),
    ("built zero3.engine.optimizer", "_global_grad_norm"),
    ("built zero3.engine.optimizer", "fp32_partitioned_groups_flat"),
    ("built zero3.engine.optimizer", "grad_partitions_flat_buffer"),
    # ZeRO-3's per-bucket hand-over of reduce-scattered gradients (after_each_zero3_bucket).
    ("built zero3.engine.optimizer", "partition_grads"),
    ("body deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3", "partition_grads"),
    # ZeRO's view of a parameter (the layout-free checkpoints).
    ("built zero1.param", "_hp_mapping"),
    ("built zero1.param._hp_mapping", "lp_fragment_address"),
    ("built zero1.param._hp_mapping.lp_fragment_address", "start"),
    ("built zero1.param._hp_mapping.lp_fragment_address", "numel"),
    ("built zero3.init", "_convert_to_zero_parameters"),
    ("built zero3.param", "ds_tensor"),
    ("built zero3.param", "ds_numel"),
    ("built zero3.param", "ds_shape"),
    ("built zero3.param", "ds_id"),
    ("built zero3.param", "ds_process_group"),
    ("built zero3.param.ds_tensor", "ds_numel"),
    # How every op builder builds (distributed/cpu_extensions.py).
    ("body deepspeed.ops.op_builder.builder:OpBuilder.jit_load", OP_BUILD_CALL),
    # torch's attention kernels that return (and take back) the softmax's log-sum-exp, which
    # ring attention merges its blocks with (attention_with_lse, parallel/ring.py).
    ("attr torch:ops.aten", "_scaled_dot_product_flash_attention_for_cpu"),
    ("attr torch:ops.aten", "_scaled_dot_product_flash_attention_for_cpu_backward"),
    ("attr torch:ops.aten", "_scaled_dot_product_flash_attention"),
    ("attr torch:ops.aten", "_scaled_dot_product_flash_attention_backward"),
    # The kernels whose outputs selective recomputation keeps (KEPT_BY_SELECTIVE).
    ("attr torch:ops.aten", "_scaled_dot_product_efficient_attention"),
    ("attr torch:ops.aten", "_scaled_dot_product_cudnn_attention"),
    ("attr torch:ops.aten", "_scaled_mm"),
)

TENSOR_PARALLEL = "tensor_model_parallel"
MODEL_PARALLEL = "model_parallel"
PIPE_REPLICATED = "ds_pipe_replicated"


def mark_tensor_parallel(param: nn.Parameter) -> None:
    """``param`` is a slice of a tensor-parallel layer."""
    setattr(param, TENSOR_PARALLEL, True)


def is_pipe_replicated(param: nn.Parameter) -> bool:
    """Whether ``param`` is a later pipeline stage's copy of a tied weight."""
    return bool(getattr(param, PIPE_REPLICATED, False))


def mark_pipeline_parameters(pipe: nn.Module, tp_rank: int, tied_copy: nn.Parameter | None) -> None:
    """DeepSpeed's pipeline gradient norm counts a parameter that is not tensor-parallel only on
    model-parallel rank 0, which under pipelining is one stage: count each stage's replicated
    parameters on its tensor rank 0 instead; ``tied_copy`` (the last stage's copy of the tied
    embedding) is counted on the first stage only."""
    for p in pipe.parameters():
        setattr(p, PIPE_REPLICATED, p is tied_copy)
        if tp_rank == 0:
            setattr(p, MODEL_PARALLEL, True)


# ---------------------------------------------------------------- the optimizer and its update
def torch_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer inside DeepSpeed's wrappers (ZeRO, bf16): each keeps the one it wraps
    as ``.optimizer``."""
    opt = engine.optimizer
    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return opt


def install_update_gate(opt: torch.optim.Optimizer, gated: Callable) -> None:
    """Replace ``opt.step`` by ``gated`` (which calls the original or declines). torch's LR
    scheduler checks that the ``step`` it wrapped is still in place (``_wrapped_by_lr_sched``);
    it is, inside ``gated``."""
    gated._wrapped_by_lr_sched = True
    opt.step = gated


def count_declined_update(opt: torch.optim.Optimizer) -> None:
    """A declined update still counts as the step for torch's LR scheduler, which otherwise
    warns that the scheduler stepped before the optimizer (``_opt_called``)."""
    opt._opt_called = True


def partition_one(init, param: nn.Parameter) -> None:
    """ZeRO-3: partition one filled parameter with ``init`` (a ``deepspeed.zero.Init``, made once
    for the whole build). Its public form, ``zero.Init(module=...)``, converts a whole module per
    call and makes its groups and NVMe swapper again each time: ZeRO++'s hpZ group refuses the
    second creation, and each swapper pins its own host buffers (about 1 GB by default)."""
    init._convert_to_zero_parameters([param])


def pipeline_step_loss(engine) -> torch.Tensor | None:
    """The pipeline engine's sum of the last step's micro-batch losses (``total_loss``, as
    trained: scaled), on the last stage; None on the others."""
    return engine.total_loss if engine.is_last_stage() else None


def step_counters(engine) -> tuple[int, int]:
    """DeepSpeed's own step and sample counters (``global_steps``, ``global_samples``)."""
    return engine.global_steps, engine.global_samples


def set_step_counters(engine, steps: int, samples: int) -> None:
    engine.global_steps, engine.global_samples = steps, samples


def skip_backward_allreduce(engine) -> None:
    """DeepSpeed's engine all-reduces every gradient after the backward pass unless
    ``enable_backward_allreduce`` is off (the attribute it reads there)."""
    engine.enable_backward_allreduce = False


def drop_gradients_from_a_list(engine) -> None:
    """DeepSpeed's ZeRO-0 update drops the gradients with ``DeepSpeedEngine.zero_grad``, which
    walks ``module.named_parameters()`` every step; the same over the (fixed) list, taken once."""
    params = list(engine.module.parameters())

    def zero_grad() -> None:
        for p in params:
            p.grad = None

    engine.zero_grad = zero_grad


def reported_grad_norm(engine):
    """The global gradient norm DeepSpeed computed in this step, or None: its ZeRO and bf16
    optimizers keep it as ``_global_grad_norm``, the engine too on our pipeline ZeRO-0 path
    (``keep_clipped_norm``)."""
    norm = getattr(engine.optimizer, "_global_grad_norm", None)
    return norm if norm is not None else getattr(engine, "_global_grad_norm", None)


def keep_clipped_norm(engine) -> None:
    """DeepSpeed's pipeline engine without ZeRO clips fp32 gradients (``clip_fp32_gradients``)
    but discards the norm; the same clipping, keeping the norm for ``reported_grad_norm``, and
    counting a weight tied across stages once, as DeepSpeed's ZeRO path does."""
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip() -> None:
        params = list(engine.module.parameters())
        once = [p for p in params if not is_pipe_replicated(p)]
        norm = clip_grad_norm_(parameters=once, max_norm=engine.gradient_clipping(), mpu=engine.mpu)
        coef = min(engine.gradient_clipping() / (float(norm) + 1e-6), 1.0)
        for p in params:
            if is_pipe_replicated(p) and p.grad is not None:
                p.grad.mul_(coef)
        engine._global_grad_norm = norm

    engine.clip_fp32_gradients = clip


# ---------------------------------------------------------------- ZeRO's view of a parameter
def hp_mapping(param: nn.Parameter):
    """ZeRO 1/2 and the bf16 optimizer: the link of a parameter to this rank's fp32 fragment
    and its optimizer state (``_hp_mapping``; None where this rank owns none of it)."""
    return param._hp_mapping


def has_hp_mapping(param: nn.Parameter) -> bool:
    return hasattr(param, "_hp_mapping")


def hp_range(mapping) -> tuple[int, int]:
    """(first element, count) of the flattened parameter an ``hp_mapping`` covers."""
    address = mapping.lp_fragment_address
    return address.start, address.numel


def is_zero3(param: nn.Parameter) -> bool:
    return hasattr(param, "ds_id")


def zero3_partition(param: nn.Parameter) -> torch.Tensor:
    """ZeRO-3: this rank's partition of ``param`` (``ds_tensor``, padded to ``ds_numel``)."""
    return param.ds_tensor


def zero3_padded_numel(param: nn.Parameter) -> int:
    """ZeRO-3: the length of each rank's partition (the last one padded)."""
    return param.ds_tensor.ds_numel


def zero3_range(param: nn.Parameter) -> tuple[int, int]:
    """ZeRO-3: (first element, count) of the flattened parameter held by this rank."""
    size = param.ds_tensor.ds_numel
    # The rank in the parameter's partition group, as DeepSpeed computes it (newer releases also
    # store it as ds_zero_partition_rank; 0.16 does not, and reading that with a default of 0
    # put every rank's shard at the start).
    start = size * dist.get_rank(group=param.ds_process_group)
    return start, max(0, min(size, param.ds_numel - start))


def full_shape(param: nn.Parameter) -> tuple[int, ...]:
    """The parameter's shape, also under ZeRO-3 (which empties it and keeps ``ds_shape``)."""
    return tuple(param.ds_shape) if hasattr(param, "ds_shape") else tuple(param.shape)


def zero3_gradient_shard(engine) -> torch.Tensor:
    """ZeRO-3 with the optimizer state on the device: this rank's gradient partitions of every
    parameter as one flat tensor (``grad_partitions_flat_buffer``), complete once the backward
    pass that ends a step returns, and what the optimizer step reads (and clips, and takes the
    norm of)."""
    return engine.optimizer.grad_partitions_flat_buffer


def after_each_zero3_bucket(engine, fn: Callable[[list[torch.Tensor]], None]) -> None:
    """ZeRO-3 reduce-scatters the gradients bucket by bucket during the backward pass and hands
    each bucket's partitions to ``partition_grads``, which adds them into this rank's gradient
    shard and returns the views of the shard it wrote: ``fn`` gets those, right after."""
    inner = engine.optimizer.partition_grads

    def partition_grads(params, grad_partitions):
        buffers = inner(params, grad_partitions)
        fn(buffers)
        return buffers

    engine.optimizer.partition_grads = partition_grads


def zero3_flat_groups(engine) -> list[torch.Tensor]:
    """ZeRO-3 steps its flat fp32 partitions one sub-group at a time, outside the torch
    optimizer's param_groups (``fp32_partitioned_groups_flat``)."""
    return list(getattr(engine.optimizer, "fp32_partitioned_groups_flat", []))


def master_weights(engine) -> dict[nn.Parameter, torch.Tensor]:
    """{model parameter: its fp32 master copy} where DeepSpeed keeps one outside ZeRO: bf16 and
    fp16 at ZeRO stage 0 with a torch optimizer get ``FP16_UnfusedOptimizer``, which steps fp32
    clones of the parameters (``fp32_groups``, parallel to ``fp16_groups``), so the torch
    optimizer's state is keyed by the clones. Empty for every other optimizer (ZeRO and the
    pipeline's bf16 optimizer link theirs through ``hp_mapping``; fp32 has none)."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    opt = engine.optimizer
    if not isinstance(opt, FP16_UnfusedOptimizer):
        return {}
    return {lp: hp for lps, hps in zip(opt.fp16_groups, opt.fp32_groups, strict=True)
            for lp, hp in zip(lps, hps, strict=True)}


def relink_optimizer_state(engine) -> None:
    """Have ZeRO 1/2 (and bf16) link their per-parameter views to an optimizer state that was
    just created: they do it once, lazily (``_lazy_init_hp_params_optimizer_state``)."""
    zero = engine.optimizer
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """Attention of (B, H, Tq, hd) queries over (B, H, Tk, hd) keys and values (heads already
    matched), with what its backward needs: (out (B, H, Tq, hd), the log-sum-exp of each
    query's scores (B, H, Tq) in fp32, the kernel's own extras). Public SDPA returns no
    log-sum-exp. The CPU's and CUDA's flash kernels (CUDA: fp16/bf16) where they apply; else the
    scores in full (``math_attention``: any device, memory quadratic in the block).
    ``mask`` (B, 1, Tq, Tk), True where a query may see a key, replaces ``causal``: a query
    that sees no key of the block gets output 0 and log-sum-exp −inf (the CPU kernel gives 0).
    CUDA's flash kernel takes no mask: a masked block's scores are formed in full there."""
    if mask is not None:
        bias, aten = additive_mask(mask, q.dtype), torch.ops.aten
        out, lse = (aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias)
                    if q.device.type == "cpu" else math_attention(q, k, v, False, bias))
        seen = mask.any(-1)  # (B, 1, Tq)
        return out.masked_fill(~seen.unsqueeze(-1), 0.0), lse.float().masked_fill(~seen, -math.inf), ()
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse.float(), ()
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        out, lse, *rest = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
        return out, lse.float(), tuple(rest)
    out, lse = math_attention(q, k, v, causal)
    return out, lse, ()


def attention_with_lse_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, causal: bool, extras: tuple,
                                mask: torch.Tensor | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block given the whole attention's ``out`` and ``lse`` (not the
    block's): the softmax's probabilities and its row term are then the whole row's, so the
    blocks' gradients sum to the whole attention's. ``extras`` and ``mask``: what
    ``attention_with_lse`` returned and was given for this block."""
    if mask is not None:
        bias, aten = additive_mask(mask, q.dtype), torch.ops.aten
        return (aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, False, attn_mask=bias) if q.device.type == "cpu"
            else math_attention_backward(dout, q, k, v, out, lse, False, bias))
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal)
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        cum_q, cum_k, max_q, max_k, seed, offset, _ = extras
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.to(torch.float32), cum_q, cum_k, max_q, max_k, 0.0, causal,
            seed, offset)
    return math_attention_backward(dout, q, k, v, out, lse, causal)


KEPT_BY_SELECTIVE = frozenset({
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_mm.default,  # float8 (model.fp8)
    torch.ops.aten._scaled_dot_product_flash_attention.default,  # SDPA's kernels, the ring's blocks
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
})
"""The ops whose outputs a block under selective recomputation keeps (torchtitan's choice: the
matrix products and attention, the costly ops); the rest (norms, RoPE, activations, products,
residual adds) is recomputed in backward."""
