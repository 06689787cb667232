"""Parameter and FLOP accounting (documented in docs/performance.md)."""

from __future__ import annotations

from torch import nn

from megatron_lite.config.schema import ModelConfig


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once); works on the meta device."""
    return sum(p.numel() for p in model.parameters())


def matmul_parameters(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul for every token: all blocks, the final norm and the
    output layer. Input embeddings (token, position) are lookups, not matmuls, so they are left
    out; a tied output layer still costs its matmul and is counted."""
    d, kv_heads = cfg.d_model, cfg.kv_heads
    head_dim = d // cfg.n_heads
    ffn = cfg.mlp_hidden
    bias = int(cfg.bias)
    qkv_out = (cfg.n_heads + 2 * kv_heads) * head_dim
    attn = d * qkv_out + bias * qkv_out + cfg.n_heads * head_dim * d + bias * d
    n_in = 2 if cfg.activation == "swiglu" else 1  # gate and up, or up alone
    mlp = n_in * (d * ffn + bias * ffn) + ffn * d + bias * d
    norm = d * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    per_layer = attn + mlp + 2 * norm
    assert cfg.vocab_size is not None
    return cfg.n_layers * per_layer + norm + cfg.vocab_size * d


def flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token (forward + backward), the PaLM/Megatron formula:
    6·N (N = matmul parameters) + 12·n_layers·d_model·seq_length for attention scores and the
    weighted sum of values (2 matmuls × 2 FLOPs × 3 for forward+backward; no causal discount).
    Activation recompute is not model FLOPs and is not counted."""
    return 6.0 * matmul_parameters(cfg) + 12.0 * cfg.n_layers * cfg.d_model * seq_length


def mfu(tokens_per_sec_per_device: float, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s per device over the device's peak (None
    when the peak is unknown, e.g. CPUs)."""
    if not peak:
        return None
    return tokens_per_sec_per_device * flops_per_token / peak
