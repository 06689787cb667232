import pytest
import torch
import torch.nn.functional as F

import megatron_lite.model.loss as loss_module
from megatron_lite.model.loss import (
    _softmax_xent_grad_cpu,
    _softmax_xent_grad_inplace,
    linear_cross_entropy,
    softmax_xent_grad,
)


@pytest.fixture
def fused(monkeypatch):
    """The fused pass at every size (these tests' shapes are small enough for the plain loss)."""
    monkeypatch.setattr(loss_module, "SMALL_LOGITS", 0)


@pytest.mark.parametrize("chunk_rows", [None, 256], ids=["default-chunks", "chunks-of-256"])
@pytest.mark.parametrize("n, vocab", [(700, 4096), (37, 65), (1000, 50)])
def test_matches_plain_cross_entropy_and_gradients(n, vocab, chunk_rows, fused, monkeypatch):
    if chunk_rows is not None:  # several chunks, the last one partial
        monkeypatch.setattr(loss_module, "chunk_rows", lambda vocab, device_type: chunk_rows)
    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(n, 32, generator=g)
    w0 = torch.randn(vocab, 32, generator=g) * 0.1
    t = torch.randint(0, vocab, (n,), generator=g)
    results = []
    for fn in (lambda h, w: F.cross_entropy(h @ w.t(), t), lambda h, w: linear_cross_entropy(h, w, t)):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = fn(h, w)
        (3.0 * loss).backward()  # a scaled loss, as with gradient accumulation
        results.append((loss.detach(), h.grad, w.grad))
    for ref, got in zip(*results, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h0, w0, t), results[0][0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_logits_take_the_plain_loss_with_the_fused_results(dtype, monkeypatch):
    """768 tokens × 65 ids (shakespeare-char's step) is under SMALL_LOGITS: the plain loss runs
    (the fused Function is not there to call) and gives the fused pass's loss and gradients."""
    g = torch.Generator().manual_seed(2)
    h0, w0 = torch.randn(768, 128, generator=g).to(dtype), (torch.randn(65, 128, generator=g) * 0.1).to(dtype)
    t = torch.randint(0, 65, (768,), generator=g)
    assert 768 * 65 <= loss_module.SMALL_LOGITS
    results = []
    for small, function in ((0, loss_module._LinearCrossEntropy), (loss_module.SMALL_LOGITS, None)):
        monkeypatch.setattr(loss_module, "SMALL_LOGITS", small)
        monkeypatch.setattr(loss_module, "_LinearCrossEntropy", function)
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = linear_cross_entropy(h, w, t)
        (3.0 * loss).backward()
        results.append((loss.detach().float(), h.grad.float(), w.grad.float()))
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-3}
    for fused, plain in zip(*results, strict=True):
        torch.testing.assert_close(plain, fused, **tol)


def test_bf16_is_close_to_fp32(fused):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(300, 64, generator=g)
    w = torch.randn(1000, 64, generator=g) * 0.05
    t = torch.randint(0, 1000, (300,), generator=g)
    hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    loss = linear_cross_entropy(hb, wb, t)
    loss.backward()
    assert hb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss.float(), F.cross_entropy(h @ w.t(), t), rtol=1e-2, atol=1e-2)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_softmax_pass_matches_eager(device, dtype):
    """The eager softmax-gradient passes (the device's default, the generic in-place one) and
    the compiled out-of-place one (training.compile on accelerators) give the same loss and
    gradients (bf16: within one rounding)."""
    g = torch.Generator().manual_seed(2)
    h0 = torch.randn(600, 64, generator=g).to(device, dtype)
    w0 = (torch.randn(3000, 64, generator=g) * 0.05).to(device, dtype)
    t = torch.randint(0, 3000, (600,), generator=g).to(device)
    results = []
    passes = (None, _softmax_xent_grad_inplace, softmax_xent_grad, torch.compile(softmax_xent_grad))
    for softmax_grad in passes:
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = linear_cross_entropy(h, w, t, softmax_grad)
        (2.0 * loss).backward()
        results.append((loss.detach(), h.grad, w.grad))
    tol = {} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-4}
    for other in results[1:]:
        for ref, got in zip(results[0], other, strict=True):
            torch.testing.assert_close(got, ref, **tol)
    ref = F.cross_entropy(h0.double() @ w0.double().t(), t)
    torch.testing.assert_close(results[-1][0].double(), ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=0)


def test_cpu_pass_recomputes_underflowing_rows_exactly():
    """The CPU pass reads a row's loss off its softmax; where the target's probability
    underflows (loss > ~69 nats) it must still give logsumexp - logit, not inf."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 500, generator=g)
    targets = torch.randint(0, 500, (8,), generator=g)
    logits[2, targets[2]] = -300.0  # probability e^-300: 0 in fp32
    loss, grad = _softmax_xent_grad_cpu(logits.clone(), targets)
    ref_loss, ref_grad = _softmax_xent_grad_inplace(logits.clone(), targets)
    assert torch.isfinite(loss) and loss.item() > 300
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)
