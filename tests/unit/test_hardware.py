"""Device independence: CUDA is reached only through the device module; the HPU hooks are
no-ops elsewhere and plug into the same seams the CPU path uses."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.config.schema import ModelConfig
from megatron_lite.distributed import device as devmod
from megatron_lite.model import build_model
from megatron_lite.parallel.apply import use_attention_kernel
from tests.conftest import REPO

DIRECT_CUDA = re.compile(r"torch\.cuda\b|\.cuda\(")


def test_no_direct_cuda_outside_the_device_module():
    device_module = REPO / "megatron_lite/distributed/device.py"
    files = [*REPO.glob("megatron_lite/**/*.py"), *REPO.glob("tools/*.py"), *REPO.glob("bench/*.py"),
             REPO / "pretrain.py"]
    offenders = [f"{f.relative_to(REPO)}:{n}: {line.strip()}"
                 for f in files if f != device_module
                 for n, line in enumerate(f.read_text().splitlines(), 1) if DIRECT_CUDA.search(line)]
    assert offenders == [], "torch.cuda belongs in distributed/device.py:\n" + "\n".join(offenders)
    assert DIRECT_CUDA.search(device_module.read_text())  # the pattern does match real uses


class _CpuAccelerator:
    def device_name(self) -> str:
        return "cpu"


def test_hpu_hooks_are_no_ops_off_hpu():
    acc = _CpuAccelerator()
    assert devmod.fused_attention(acc) is None
    assert devmod.graph_break(acc, "lazy")() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="names a CUDA GPU; none here")
def test_a_cuda_gpu_is_named_and_its_peak_known():
    acc = devmod.select_accelerator("auto")
    name = devmod.device_name(acc)
    assert name == torch.cuda.get_device_name(torch.cuda.current_device())
    if any(model in name for model in ("A100", "H100", "H200")):
        assert devmod.peak_flops(name, "bf16") in (312e12, 989e12)


def test_an_attention_kernel_plugs_into_every_attention_core():
    cfg = ModelConfig(vocab_size=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, max_seq_len=16)
    model = build_model(cfg, "cpu", seed=0)
    x = torch.randint(0, 64, (2, 16))
    want = model(x, x)
    calls = []

    def kernel(q, k, v, **kwargs):  # what a device's fused SDPA is called with
        calls.append((q.shape, k.shape, kwargs["is_causal"], kwargs["enable_gqa"]))
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

    use_attention_kernel(model, kernel)
    got = model(x, x)
    assert len(calls) == 2 and calls[0] == ((2, 4, 16, 8), (2, 2, 16, 8), True, True)
    torch.testing.assert_close(got, want)
