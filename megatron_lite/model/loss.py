"""Output layer + cross-entropy in one chunked pass (the loss of ``Transformer.forward``).

Why by hand: the usual ``F.cross_entropy(h @ W.T, t)`` materialises all logits (tokens × vocab,
in fp32: 4 GiB for 8K tokens of a 128K vocabulary) and then a gradient of the same size, and
runs a separate log-softmax backward. Here rows are processed in chunks: each chunk's logits
become its softmax gradient in place, which is immediately multiplied into the gradients of the
hidden states and the weight. Peak memory is one chunk of logits, and the step is faster too
(bench/loss_speed.py; docs/benchmarks-history.md). Fused kernels of this (Liger's) exist only for
Triton GPUs.

The gradients are computed in the forward pass, so this path is taken only when a backward
will follow (grad mode on); evaluation uses the chunked loss alone.
"""

from __future__ import annotations

import torch


def chunk_rows(vocab: int, device_type: str) -> int:
    """Rows of logits the loss computes at once for a ``vocab``-wide output layer."""
    # Few chunks of large matmuls. CPU: about 16M logits (64 MiB in fp32, plus the gradient): a
    # 2048 x 256 -> 32,000 loss with its gradients took 0.67 s against 0.97 s in 2M-logit chunks
    # (with training.cpu_retain_freed_memory; fresh pages per chunk used to favour small ones).
    # Accelerators: about 256M (512 MiB of bf16 logits, as much again for their gradient).
    budget = 1 << 24 if device_type == "cpu" else 1 << 28
    return max(256, budget // vocab)


def compiles_softmax_pass(device_type: str) -> bool:
    """Whether ``training.compile`` also compiles ``softmax_xent_grad`` on this device: not on
    CPU, where aten's softmax kernel (``_softmax_xent_grad_cpu``) beats the compiled pass."""
    return device_type != "cpu"


def softmax_xent_grad(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(c, V) logits, (c,) targets -> (summed loss of the rows, softmax - onehot in the logits'
    dtype: the gradient of the summed loss). Written out of place so that ``torch.compile`` makes
    it one pass over the logits (``parallel.apply.compile_blocks`` does on accelerators, with
    ``training.compile``); ``_softmax_xent_grad_inplace`` and ``_softmax_xent_grad_cpu`` are the
    eager paths."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)  # (c, 1)
    picked = x.gather(1, targets.unsqueeze(1))  # (c, 1)
    hit = torch.arange(x.size(1), device=x.device) == targets.unsqueeze(1)  # (c, V)
    grad = torch.exp(x - lse) - hit.to(x.dtype)
    return (lse - picked).sum(), grad.to(logits.dtype)


def _softmax_xent_grad_inplace(logits: torch.Tensor,
                               targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax_xent_grad`` eagerly, reusing one fp32 buffer for the logits and the gradient."""
    x = logits.float()
    rows = torch.arange(x.size(0), device=x.device)
    # Max-shifted exponentials built in the one fp32 buffer (logsumexp would allocate another
    # chunk-sized temporary).
    x.sub_(x.amax(dim=-1, keepdim=True))
    picked = x[rows, targets]  # (c,) shifted target logits
    sums = x.exp_().sum(dim=-1)  # (c,)
    loss = (sums.log() - picked).sum()
    grad = x.div_(sums.unsqueeze(1))  # softmax
    grad[rows, targets] -= 1.0
    return loss, grad.to(logits.dtype)


def _softmax_xent_grad_cpu(logits: torch.Tensor,
                           targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax_xent_grad`` for fp32 logits on CPU: aten's softmax kernel (one read, one write,
    a faster exp than inductor's) beats the compiled pass there (bench/loss_speed.py). A row's
    loss is -log of its target's probability, exact unless that underflows (a loss above ~69
    nats): such rows are recomputed from their logsumexp."""
    grad = torch.softmax(logits, dim=-1)
    rows = torch.arange(logits.size(0))
    picked = grad[rows, targets]  # (c,)
    losses = -torch.log(picked)
    tiny = picked < 1e-30
    if tiny.any():  # a host read: free on CPU
        r = tiny.nonzero().squeeze(1)
        losses[r] = torch.logsumexp(logits[r], dim=-1) - logits[r, targets[r]]
    grad[rows, targets] -= 1.0
    return losses.sum(), grad


def _default_softmax_grad(h: torch.Tensor, weight: torch.Tensor):
    if h.device.type == "cpu" and weight.dtype == torch.float32:
        return _softmax_xent_grad_cpu
    return _softmax_xent_grad_inplace


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                softmax_grad) -> torch.Tensor:
        n = h.shape[0]
        chunk = chunk_rows(weight.shape[0], h.device.type)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, n, chunk):
            hc, tc = h[start:start + chunk], targets[start:start + chunk]
            loss, grad = softmax_grad(hc @ weight.t(), tc)  # grad: (c, V) in the weights' dtype
            total += loss
            grad_h[start:start + chunk] = grad @ weight
            if grad.dtype == torch.float32:
                grad_w.addmm_(grad.t(), hc)
            else:
                # A bf16/fp16 product (accumulated in fp32 inside the matmul), as a plain
                # low-precision output layer's weight gradient; the chunks are summed in fp32.
                grad_w += grad.t() @ hc
            del grad  # not alive while the next chunk's logits and gradient are formed
        # The mean's 1/n, applied once to the (N, D) and (V, D) results, not to every logit.
        ctx.save_for_backward(grad_h.div_(n), grad_w.div_(n).to(weight.dtype))
        return total / n

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out, grad_w * grad_out, None, None


@torch.no_grad()
def _chunked_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    chunk = chunk_rows(weight.shape[0], h.device.type)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, h.shape[0], chunk):
        logits = (h[start:start + chunk] @ weight.t()).float()
        total += torch.nn.functional.cross_entropy(logits, targets[start:start + chunk], reduction="sum")
    return total / h.shape[0]


IGNORED = -100
"""A target the output layers leave out of the loss and its mean when told to
(``skips_ignored``, set for ``data.eod_mask_loss``)."""

SMALL_LOGITS = 1 << 20
"""Up to this many logits (tokens × vocabulary), the eager loss is the plain
``F.cross_entropy(h @ weight.T)``: all of it is a few MiB, and the fused pass's extra kernels
cost more than they save; the two are even around 1M logits and the fused pass wins above
(``bench/loss_speed.py``; the figures are in docs/benchmarks-history.md)."""


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         softmax_grad=None) -> torch.Tensor:
    """Mean cross-entropy of ``h @ weight.T`` against ``targets``; h (N, D), weight (V, D),
    targets (N,). Equal to ``F.cross_entropy(h @ weight.T, targets)`` and its gradients.
    ``softmax_grad``: a compiled ``softmax_xent_grad``, or None for the device's eager pass."""
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        if softmax_grad is None and h.shape[0] * weight.shape[0] <= SMALL_LOGITS:
            return torch.nn.functional.cross_entropy((h @ weight.t()).float(), targets)
        return _LinearCrossEntropy.apply(h, weight, targets, softmax_grad or _default_softmax_grad(h, weight))
    return _chunked_loss(h, weight, targets)
