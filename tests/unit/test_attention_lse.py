"""The block attention ring attention is made of (engine/internals.py): the CPU's flash kernel
and the any-device scores path give SDPA's output, the log-sum-exp of each query's scores, and,
given the whole attention's output and log-sum-exp, SDPA's gradients."""

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.engine import internals


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
        out, lse = internals._math_attention(q, k, v, causal)
        grads = internals._math_attention_backward(upstream, q, k, v, out, lse, causal)

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
