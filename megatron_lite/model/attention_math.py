"""Attention with its log-sum-exp, the scores formed in full: the fallback of
``engine.internals.attention_with_lse`` (ring attention's blocks) where no flash kernel applies,
and the CPU kernel's additive mask."""

from __future__ import annotations

import math

import torch


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: may attend) as the additive one the CPU flash kernel takes."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -math.inf)


def scores(q: torch.Tensor, k: torch.Tensor, causal: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.size(-1))  # (B, H, Tq, Tk)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s if bias is None else s + bias.float()


def math_attention(q, k, v, causal, bias=None):
    """(out, log-sum-exp) with the scores formed in full: any device, memory quadratic in the block."""
    s = scores(q, k, causal, bias)
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Tq)
    return (torch.exp(s - lse.unsqueeze(-1)) @ v.float()).to(q.dtype), lse


def math_attention_backward(dout, q, k, v, out, lse, causal, bias=None):
    """(dq, dk, dv) of ``math_attention`` given the whole attention's ``out`` and ``lse``."""
    # A row that sees no key has lse −inf: its probabilities are 0, not exp(−inf + inf).
    p = torch.exp(scores(q, k, causal, bias) - lse.unsqueeze(-1)).nan_to_num(0.0)  # (B, H, Tq, Tk)
    do = dout.float()
    dv = p.transpose(-1, -2) @ do
    dp = do @ v.float().transpose(-1, -2)
    ds = p * (dp - (do * out.float()).sum(-1, keepdim=True)) / math.sqrt(q.size(-1))
    return (ds @ k.float()).to(q.dtype), (ds.transpose(-1, -2) @ q.float()).to(k.dtype), dv.to(v.dtype)
