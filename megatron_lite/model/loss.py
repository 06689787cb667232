"""Output layer + cross-entropy in one chunked pass (the loss of ``Transformer.forward``).

Why by hand: the usual ``F.cross_entropy(h @ W.T, t)`` materialises all logits (tokens × vocab,
in fp32: 4 GiB for 8K tokens of a 128K vocabulary) and then a gradient of the same size, and
runs a separate log-softmax backward. Here rows are processed in chunks: each chunk's logits
become its softmax gradient in place, which is immediately multiplied into the gradients of the
hidden states and the weight. Peak memory is one chunk of logits, and the step measured 8%
faster on CPU (docs/benchmarks.md). Fused kernels of this (Liger's) exist only for Triton GPUs.

The gradients are computed in the forward pass, so this path is taken only when a backward
will follow (grad mode on); evaluation uses the chunked loss alone.
"""

from __future__ import annotations

import torch


def _chunk_rows(vocab: int) -> int:
    # About 2M logits per chunk: cache-sized on CPUs, large enough for full GPU matmuls.
    return max(256, (1 << 21) // vocab)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        n = h.shape[0]
        chunk = _chunk_rows(weight.shape[0])
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, n, chunk):
            hc, tc = h[start:start + chunk], targets[start:start + chunk]
            rows = torch.arange(hc.shape[0], device=h.device)
            logits = (hc @ weight.t()).float()  # (c, V)
            lse = torch.logsumexp(logits, dim=-1)  # (c,)
            total += (lse - logits[rows, tc]).sum()
            # d(mean loss)/d(logits) = (softmax - onehot) / n, built in the logits buffer.
            grad = logits.sub_(lse.unsqueeze(1)).exp_()
            grad[rows, tc] -= 1.0
            grad.div_(n)
            grad_h[start:start + chunk] = grad.to(h.dtype) @ weight
            grad_w.addmm_(grad.t(), hc.float())
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return total / n

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out, grad_w * grad_out, None


@torch.no_grad()
def _chunked_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    chunk = _chunk_rows(weight.shape[0])
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, h.shape[0], chunk):
        logits = (h[start:start + chunk] @ weight.t()).float()
        total += torch.nn.functional.cross_entropy(logits, targets[start:start + chunk], reduction="sum")
    return total / h.shape[0]


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``h @ weight.T`` against ``targets``; h (N, D), weight (V, D),
    targets (N,). Equal to ``F.cross_entropy(h @ weight.T, targets)`` and its gradients."""
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h, weight, targets)
    return _chunked_loss(h, weight, targets)
