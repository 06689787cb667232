"""Parameter and FLOP accounting (documented in docs/performance.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatron_lite.config.schema import ModelConfig
from megatron_lite.model.transformer import Block, RMSNorm, make_norm


@dataclass(frozen=True)
class ParameterCounts:
    embedding: int
    """Token (and learned position) embeddings."""
    block: int
    """One transformer block."""
    block_norms: int
    """The norms' share of ``block`` (replicated under tensor parallelism; per-head query/key
    norms included)."""
    head: int
    """Final norm and, when not tied, the output layer."""
    head_norm: int
    """The final norm's share of ``head``."""
    n_layers: int

    @property
    def total(self) -> int:
        return self.embedding + self.n_layers * self.block + self.head


def parameter_counts(m: ModelConfig) -> ParameterCounts:
    """Parameters of a resolved model config (vocabulary known), by part: one block and the
    final norm are built on the meta device and counted, so every switch of the model is
    counted with no formula to keep in step with it."""
    assert m.vocab_size is not None
    with torch.device("meta"):
        block, final_norm = Block(m), make_norm(m)
    norms = sum(count_parameters(x) for x in block.modules() if isinstance(x, (RMSNorm, nn.LayerNorm)))
    norm = count_parameters(final_norm)
    d = m.d_model
    embedding = m.vocab_size * d + (m.max_seq_len or 0) * d * (m.position == "learned")
    head = norm + (0 if m.tie_embeddings else m.vocab_size * d)
    return ParameterCounts(embedding, count_parameters(block), norms, head, norm, m.n_layers)


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once); works on the meta device."""
    return sum(p.numel() for p in model.parameters())


def matmul_parameters(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul for every token: all blocks, the final norm and the
    output layer. Input embeddings (token, position) are lookups, not matmuls, so they are left
    out; a tied output layer still costs its matmul and is counted."""
    counts = parameter_counts(cfg)
    return counts.n_layers * counts.block + counts.head_norm + cfg.vocab_size * cfg.d_model


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
