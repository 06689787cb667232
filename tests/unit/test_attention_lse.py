"""The block attention ring attention is made of (engine/internals.py): the CPU's flash kernel
and the any-device scores path give SDPA's output, the log-sum-exp of each query's scores, and,
given the whole attention's output and log-sum-exp, SDPA's gradients."""

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.engine import internals
from megatron_lite.model.attention_math import math_attention, math_attention_backward


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("path", ["kernel", "scores"])
def test_attention_with_lse_equals_sdpa_forward_and_backward(path, causal):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 12, 8, generator=gen) for _ in range(3))
    upstream = torch.randn(2, 4, 12, 8, generator=gen)
    if path == "kernel":
        out, lse, extras = internals.attention_with_lse(q, k, v, causal)
        grads = internals.attention_with_lse_backward(upstream, q, k, v, out, lse, causal, extras)
    else:
        out, lse = math_attention(q, k, v, causal)
        grads = math_attention_backward(upstream, q, k, v, out, lse, causal)

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    expected.backward(upstream)
    scores = q @ k.transpose(-1, -2) / 8**0.5
    if causal:
        scores = scores.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(out, expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-6)
    for name, got, leaf in zip("qkv", grads, leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-5, atol=1e-6, msg=f"d{name}")


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA's flash kernel needs a CUDA GPU"))]


@pytest.mark.parametrize("device", DEVICES)
def test_key_blocks_merged_by_lse_give_whole_attention(device):
    """What ring attention does on one rank, without the ring: the keys in two blocks (the first
    causal, the second wholly visible), the blocks' outputs merged by their log-sum-exp, each
    block's backward given the merged output and log-sum-exp; the merged output and the summed
    gradients equal SDPA over all keys. On CUDA in bf16 this runs its flash kernel, whose extras
    (random state, sequence lengths) the backward must be handed back."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(1)
    q, k, v, upstream = (torch.randn(2, 4, 64, 64, generator=gen).to(device, dtype) for _ in range(4))
    # Keys 0..63 are "later" (causal with the queries), 64..127 "earlier" (all visible).
    k_all, v_all = torch.cat([k, k.flip(2)], 2), torch.cat([v, v.flip(2)], 2)
    blocks = [(k, v, True), (k.flip(2), v.flip(2), False)]
    outs = [internals.attention_with_lse(q, kb, vb, causal) for kb, vb, causal in blocks]
    lse = torch.logaddexp(outs[0][1], outs[1][1])  # (B, H, T)
    out = sum(o.float() * torch.exp(b_lse - lse).unsqueeze(-1) for o, b_lse, _ in outs).to(dtype)
    grads = [internals.attention_with_lse_backward(upstream, q, kb, vb, out, lse, causal, extras)
             for (kb, vb, causal), (_, _, extras) in zip(blocks, outs, strict=True)]

    mask = torch.ones(64, 128, dtype=torch.bool, device=device)
    mask[:, :64] = torch.ones(64, 64, dtype=torch.bool, device=device).tril()
    leaves = [x.float().clone().requires_grad_() for x in (q, k_all, v_all)]
    expected = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
    expected.backward(upstream.float())
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.float(), expected.detach(), **tol)
    dq = grads[0][0].float() + grads[1][0].float()
    dk = torch.cat([grads[0][1], grads[1][1]], 2).float()
    dv = torch.cat([grads[0][2], grads[1][2]], 2).float()
    for name, got, leaf in zip("qkv", (dq, dk, dv), leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad, **tol, msg=f"d{name}")
