"""training.kernels: a library's fused output layer + loss behind a switch, with the plain path
as the reference."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_lite.config import ConfigError, load_config
from megatron_lite.config.schema import ModelConfig
from megatron_lite.model import build_model
from megatron_lite.model.loss import linear_cross_entropy
from megatron_lite.parallel.apply import use_loss_kernel
from tests.conftest import REPO

CFG = ModelConfig(vocab_size=1000, n_layers=2, n_heads=4, n_kv_heads=2, d_model=64, max_seq_len=64,
                  position="rope", norm="rmsnorm", activation="swiglu", tie_embeddings=True)


def test_torch_keeps_the_plain_loss():
    model = build_model(CFG, "cpu", seed=0)
    assert use_loss_kernel(model, "torch", "cpu") == 0
    assert model.lm_head.loss_fn is linear_cross_entropy


def test_liger_off_cuda_names_the_setting_and_the_fix():
    model = build_model(CFG, "cpu", seed=0)
    with pytest.raises(RuntimeError, match=r"training.kernels=liger.*CUDA.*training.kernels=torch"):
        use_loss_kernel(model, "liger", "cpu")
    assert model.lm_head.loss_fn is linear_cross_entropy  # left as it was


def test_liger_with_a_vocabulary_parallel_head_is_a_config_error():
    with pytest.raises(ConfigError, match=r"'training.kernels' = 'liger'.*'parallel.tensor' = 2"):
        load_config(REPO / "recipes/shakespeare-char.yaml", ["training.kernels=liger", "parallel.tensor=2"])


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("liger_kernel") is None,
                    reason="Liger Kernel's Triton kernels need a CUDA GPU and the liger-kernel package")
def test_liger_loss_matches_the_plain_loss_on_cuda():
    """Same bf16 model and batch through both kernels: loss and every gradient agree to bf16
    rounding."""
    results = []
    x = torch.randint(0, CFG.vocab_size, (4, 65), generator=torch.Generator().manual_seed(3)).cuda()
    for kernels in ("torch", "liger"):
        model = build_model(CFG, "cuda", seed=0).to(torch.bfloat16)
        assert use_loss_kernel(model, kernels, "cuda") == (kernels == "liger")
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        results.append((loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        ref = ref_grads[name]
        assert torch.linalg.norm(g - ref) <= 2e-2 * torch.linalg.norm(ref), name
