"""One decoder-only transformer; GPT-2 and Llama are configurations of it.

Plain single-device PyTorch: no process groups, no DeepSpeed. Parallelism is applied to this
model by separate steps (``megatron_lite.parallel``), never inside it.

Switches (``ModelConfig``): learned positions or RoPE; LayerNorm or RMSNorm; GELU or SwiGLU;
biases; tied embeddings; grouped-query attention (``n_kv_heads < n_heads``); per-head
query/key norms (``qk_norm``, Qwen3); attention within documents (``attention_mask:
document``: the forward pass is given each token's document, ``document_ids``).
"""

from __future__ import annotations

import functools
import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from megatron_lite.config.schema import ModelConfig
from megatron_lite.model.document_attention import document_attention
from megatron_lite.model.fused import fuse_gate_up, fuse_qkv
from megatron_lite.model.kv_cache import KVCache, LayerCache, causal_mask
from megatron_lite.model.loss import IGNORED, linear_cross_entropy

VOCAB_PARAMETERS = ("tok_emb.weight", "lm_head.weight")
"""Parameters with one row per vocabulary id (rows past ``tokenizer_vocab_size`` are padding)."""


def initial_value(cfg: ModelConfig, name: str, shape: torch.Size | tuple[int, ...],
                  seed: int) -> torch.Tensor:
    """The initial value of the parameter called ``name`` (its name in ``Transformer``).

    GPT-2/Megatron init: N(0, init_std) for weights, the output projections of the residual
    branches N(0, init_std/sqrt(2·n_layers)) so the residual stream's variance does not grow with
    depth, norms 1, biases 0. Drawn from a generator seeded by (seed, name) alone; padding rows
    of the vocabulary are zero, so the real rows are the same however far the vocabulary is
    padded. Always drawn on the CPU, and copied to the device by the caller: a CUDA generator
    draws other numbers than the CPU one, and Gaudi's bridge refuses device generators, while
    every device and layout must start from the same weights.
    """
    used = cfg.tokenizer_vocab_size or shape[0]
    if ".qkv_proj." in name or ".gate_up_proj." in name:
        # Drawn as the separate projections they fuse, under those names: the same model as
        # before fusing, whatever the layout.
        return fused_initial_value(cfg, name, shape, seed)
    if name in VOCAB_PARAMETERS and used < shape[0]:
        real = initial_value(cfg, name, (used, *shape[1:]), seed)
        return torch.cat([real, real.new_zeros(shape[0] - used, *shape[1:])])
    if name.endswith("bias"):
        return torch.zeros(shape)
    if "norm." in name:
        return torch.ones(shape)
    std = cfg.init_std
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        std /= math.sqrt(2 * cfg.n_layers)
    gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def fused_initial_value(cfg: ModelConfig, name: str, shape: torch.Size | tuple[int, ...],
                        seed: int) -> torch.Tensor:
    """``initial_value`` of a fused projection: its parts' values, fused."""
    rest = tuple(shape[1:])
    if ".qkv_proj." in name:
        q_rows, kv_rows = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        q, k, v = (initial_value(cfg, name.replace("qkv_proj", part), (rows, *rest), seed)
                   for part, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)))
        return fuse_qkv(q, k, v, cfg.n_heads, cfg.kv_heads)
    gate, up = (initial_value(cfg, name.replace("gate_up_proj", part), (shape[0] // 2, *rest), seed)
                for part in ("gate_proj", "up_proj"))
    return fuse_gate_up(gate, up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(..., D) -> (..., D). Normalised in fp32 (bf16 sums of squares lose too much), scaled in
    the input dtype: Llama's numerics, in torch's fused kernel."""
    return weight * F.rms_norm(x.float(), (x.size(-1),), eps=eps).to(x.dtype)


class Embedding(nn.Embedding):
    """``nn.Embedding`` without its default fill: ``Transformer.reset_parameters`` draws the
    weights. (The fill would be drawn only to be replaced; on the meta device ``normal_`` runs
    as a Python reference whose first call imports torch._dynamo, a second of ``--dry-run``,
    ``--plan`` and conversions, which build no optimizer.)"""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # The kernel, with rms_norm's signature; a device may supply a fused one
        # (distributed/device.py: device_kernels).
        self.kernel = rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.eps)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def document_ids(ends: torch.Tensor) -> torch.Tensor:
    """(B, T) bool, True at each end-of-document token -> (B, T) the document of each token,
    counted from 0 in each row. The end-of-document token belongs to the document it ends
    (Megatron's ``reset_attention_mask``)."""
    ends = ends.long()
    return ends.cumsum(1) - ends


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) document of each token -> (B, T) its position in its document (Megatron's
    ``reset_position_ids``)."""
    t = torch.arange(documents.size(1), device=documents.device).expand_as(documents)
    first = torch.ones_like(documents[:, :1], dtype=torch.bool)
    starts = torch.cat([first, documents[:, 1:] != documents[:, :-1]], dim=1)
    return t - torch.where(starts, t, 0).cummax(dim=1).values


def llama3_frequencies(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.1's RoPE scaling (``model.rope_scaling: llama3``): low frequencies divided by the
    factor, high ones kept, those between blended by where their wavelength falls."""
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    original = cfg.rope_original_max_len
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    blend = (original / wavelength - low) / (high - low)
    between = (wavelength <= original / low) & (wavelength >= original / high)
    return torch.where(between, (1 - blend) * scaled / factor + blend * scaled, scaled)


def rope_tables(head_dim: int, max_len: int, theta: float,
                cfg: ModelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (max_len, head_dim) in the half-split layout (Llama / HF ``rotate_half``);
    ``cfg``: its ``rope_scaling``, if any."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if cfg is not None and cfg.rope_scaling == "llama3":
        inv_freq = llama3_frequencies(inv_freq, cfg)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # (T, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, hd)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, hd) queries or keys by position."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class CausalAttention(nn.Module):
    """Causal scaled-dot-product attention of (B, T, H, hd) queries over (B, T, Hkv, hd) keys
    and values, RoPE applied first; given ``documents``, each token attends only within its
    document and RoPE counts positions from the document's start. A module of its own so that
    sequence parallelism can wrap it (the all-to-all of DeepSpeed-Ulysses goes around exactly
    this)."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout
        # The kernels, with F.scaled_dot_product_attention's and apply_rope's signatures; a device
        # may supply fused ones (distributed/device.py: device_kernels).
        self.sdpa = F.scaled_dot_product_attention
        self.rotate = apply_rope

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None,
                documents: torch.Tensor | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        """``documents``: (B, T) the document of each token, or None (one causal sequence).
        ``cache``: the keys and values of earlier positions (sampling); these T come after them."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, hd)
        T = q.size(2)
        start = cache.length if cache is not None else 0
        if rope is not None:
            if documents is None:
                cos, sin = rope[0][start:start + T], rope[1][start:start + T]  # (T, hd)
            else:
                positions = document_positions(documents)
                cos, sin = rope[0][positions].unsqueeze(1), rope[1][positions].unsqueeze(1)  # (B, 1, T, hd)
            q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        dropout = self.dropout if self.training else 0.0
        gqa = k.size(1) != q.size(1)
        if cache is not None:
            k, v = cache.extend(k, v)  # (B, Hkv, start+T, hd)
        if documents is not None:
            y = document_attention(q, k, v, documents, dropout, self.sdpa)  # (B, H, T, hd)
        elif start:  # after cached positions: the last T rows of the causal mask
            y = self.sdpa(q, k, v, attn_mask=causal_mask(T, k.size(2), q.device), enable_gqa=gqa)
        else:
            y = self.sdpa(q, k, v, is_causal=True, dropout_p=dropout, enable_gqa=gqa)
        return y.transpose(1, 2)  # (B, T, H, hd)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.group = self.n_heads // self.n_kv_heads  # query heads per key/value head
        # Queries, keys and values in one product, grouped by key/value head (model/fused.py).
        rows = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(cfg.d_model, rows, bias=cfg.bias or cfg.qkv_bias)
        # Qwen3's per-head RMSNorm of queries and keys, before RoPE: bounds the attention logits.
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.core = CausalAttention(cfg.dropout)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                documents: torch.Tensor | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        # Head counts are read off the projection: tensor parallelism gives each rank some groups.
        qkv = self.qkv_proj(x).view(B, T, -1, self.group + 2, self.head_dim)  # (B, T, Hkv, g+2, hd)
        q, k, v = qkv.split([self.group, 1, 1], dim=3)
        q = q.reshape(B, T, -1, self.head_dim)  # (B, T, H, hd)
        k, v = k.squeeze(3), v.squeeze(3)  # (B, T, Hkv, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # (The sequence-parallel wrappers of ``core`` take no cache: nothing samples under them.)
        y = self.core(q, k, v, rope, documents, *([cache] if cache is not None else []))  # (B, T, H, hd)
        return self.o_proj(y.reshape(B, T, -1))  # (B, T, D)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = cfg.mlp_hidden
        self.swiglu = cfg.activation == "swiglu"
        if self.swiglu:  # gate and up in one product, their rows interleaved (model/fused.py)
            self.gate_up_proj = nn.Linear(cfg.d_model, 2 * hidden, bias=cfg.bias)
        else:
            self.up_proj = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)
        self.down_proj = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)
        self.approximate = "tanh" if cfg.activation == "gelu" else "none"  # GELU's form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = self.gate_up_proj(x).unflatten(-1, (-1, 2)).unbind(-1)  # (B, T, F) each
            h = F.silu(gate) * up  # (B, T, F)
        else:
            h = F.gelu(self.up_proj(x), approximate=self.approximate)  # (B, T, F)
        return self.down_proj(h)  # (B, T, D)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                documents: torch.Tensor | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), rope, documents, cache))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


def keep_outputs_of(ops: frozenset):
    """Selective recomputation (torchtitan's op-level policy): a checkpointed block keeps the
    outputs of ``ops`` and recomputes every other op in backward."""

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class LMHead(nn.Module):
    """Output layer: (B, T, D) hidden states -> (B, T, V) logits over the tokenizer's ``used``
    ids (padding rows of the weight take no part), or with targets the mean next-token loss,
    fused with the output matmul so the full logits never exist."""

    def __init__(self, d_model: int, vocab_size: int, used: int | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model))
        self.used = used or vocab_size
        # (h (N, D), weight (V, D), targets (N,)) -> mean loss. The parallelize steps may put a
        # compiled or a library kernel here (parallel/apply.py).
        self.loss_fn = linear_cross_entropy
        # Targets may be IGNORED (data.eod_mask_loss; set by parallel.apply.use_loss_mask).
        self.skips_ignored = False

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight[:self.used]  # (V, D) without the padding rows
        if targets is None:
            return F.linear(x, weight)  # (B, T, V)
        h, targets = x.reshape(-1, x.size(-1)), targets.reshape(-1)  # (N, D), (N,)
        if self.skips_ignored:
            kept = targets != IGNORED
            h, targets = h[kept], targets[kept]  # (kept, D): the count is read to the host
            if targets.numel() == 0:
                return h.sum()  # zero, and no gradient
        return self.loss_fn(h, weight, targets)


class Transformer(nn.Module):
    """Token ids (B, T) -> logits (B, T, V), or the mean next-token loss when targets are given.
    Parts set to None (a pipeline stage's) are skipped."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        if cfg.vocab_size is None or cfg.max_seq_len is None:
            raise ValueError("ModelConfig needs vocab_size and max_seq_len resolved (see resolve_model)")
        self.cfg = cfg
        self.tok_emb = Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = Embedding(cfg.max_seq_len, cfg.d_model) if cfg.position == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        # Keyed by index: a pipeline stage keeps some blocks under their own names.
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = make_norm(cfg)
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size, cfg.tokenizer_vocab_size)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        if cfg.position == "rope":  # filled by reset_buffers (not on the meta device: as above)
            self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
            self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
        else:
            self.rope_cos = self.rope_sin = None
        self.activation_checkpointing = cfg.activation_checkpointing  # none | full | selective
        # The ops whose outputs selective recomputation keeps: torch's matrix-product and
        # attention kernels, named by the build (parallel.apply.use_selective_recompute).
        self.kept_ops: frozenset | None = None
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Every parameter from its own name and ``seed`` (``initial_value``), so that a model
        split over ranks or pipeline stages starts from exactly the same weights."""
        for name, param in self.named_parameters():
            if param.device.type != "meta":
                param.copy_(initial_value(self.cfg, name, param.shape, seed))
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        if self.rope_cos is not None and self.rope_cos.device.type != "meta":
            cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len,
                                   self.cfg.rope_theta, self.cfg)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                documents: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """Token ids ``x`` (B, T) -> logits (B, T, V), or the mean loss with targets.
        ``documents`` (B, T): the document of each token (``document_ids``) when attention stays
        within documents; under sequence parallelism those of the whole sequence, of which ``x``
        is this rank's part. ``cache`` (sampling): ``x`` follows the positions it holds; it keeps theirs.

        A pipeline stage is this model with some parts removed (``parallel/stages.py``), and
        runs the parts it has: after the first stage ``x`` is the hidden states (B, T, D) of the
        one before; a stage before the last returns its hidden states, the last its normed ones
        (its output layer is the pipeline's loss)."""
        recompute = self.activation_checkpointing if self.training else "none"
        if cache is not None and (documents is not None or recompute != "none"):
            raise ValueError("a KV cache is for sampling: eval mode (no recomputation), no documents")
        if self.tok_emb is not None:
            if documents is None:
                start = cache.start_of(x.size(1)) if cache is not None else 0
                positions = torch.arange(start, start + x.size(1), device=x.device)  # (T,)
            else:
                positions = document_positions(documents)  # (B, T) of the whole sequence
            x = self.tok_emb(x)  # (B, T, D)
            if self.pos_emb is not None:
                x = x + self.pos_emb(positions)
            x = self.drop(x)
        rope = (self.rope_cos, self.rope_sin) if self.rope_cos is not None else None
        for name, block in self.blocks.items():
            if recompute == "full":
                x = checkpoint(block, x, rope, documents, use_reentrant=False)
            elif recompute == "selective":
                if self.kept_ops is None:
                    raise RuntimeError("model.activation_checkpointing=selective: no ops to keep were given "
                                       "(parallel.apply.use_selective_recompute)")
                x = checkpoint(block, x, rope, documents, use_reentrant=False,
                               context_fn=functools.partial(keep_outputs_of, self.kept_ops))
            else:
                x = block(x, rope, documents, cache.layer(name) if cache is not None else None)
        if cache is not None:
            cache.length += x.size(1)
        if self.norm is None:
            return x  # (B, T, D) for the next pipeline stage
        x = self.norm(x)  # (B, T, D)
        if self.lm_head is None:
            return x
        return self.lm_head(x, targets)  # (B, T, V) logits, or the mean loss
