"""Device independence: CUDA is reached only through the device module; the HPU hooks are
no-ops elsewhere and plug into the same seams the CPU path uses."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.config.schema import ModelConfig
from megatron_lite.distributed import device as devmod
from megatron_lite.model import build_model
from megatron_lite.parallel.apply import use_device_kernels
from tests.conftest import INHERITED_PYTHONPATH, REPO, cpu_env

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
    assert devmod.device_kernels(acc) == devmod.DeviceKernels()  # every reference path stays
    assert devmod.graph_break(acc, "lazy")() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="names a CUDA GPU; none here")
def test_a_cuda_gpu_is_named_and_its_peak_known(monkeypatch):
    from deepspeed.accelerator import set_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    try:
        acc = devmod.select_accelerator("auto")
        name = devmod.device_name(acc)
        assert name == torch.cuda.get_device_name(torch.cuda.current_device())
        if any(model in name for model in ("A100", "H100", "H200")):
            assert devmod.peak_flops(name, "bf16") in (312e12, 989e12)
    finally:
        # DeepSpeed keeps the accelerator it selected for the whole process: the later tests'
        # select_accelerator("cpu") would find this CUDA one and be refused.
        set_accelerator(CPU_Accelerator())


def test_an_attention_kernel_plugs_into_every_attention_core():
    cfg = ModelConfig(vocab_size=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, max_seq_len=16)
    model = build_model(cfg, "cpu", seed=0)
    x = torch.randint(0, 64, (2, 16))
    want = model(x, x)
    calls = []

    def kernel(q, k, v, **kwargs):  # what a device's fused SDPA is called with
        calls.append((q.shape, k.shape, kwargs["is_causal"], kwargs["enable_gqa"]))
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

    assert use_device_kernels(model, devmod.DeviceKernels(attention=kernel)) == ["attention"]
    got = model(x, x)
    assert len(calls) == 2 and calls[0] == ((2, 4, 16, 8), (2, 2, 16, 8), True, True)
    torch.testing.assert_close(got, want)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class _FakeHabana:
    """Habana's fused kernels as their callers use them (optimum-habana, Megatron-DeepSpeed for
    Gaudi), computed with plain torch: checks our adapters' conventions (argument order, table
    shapes, positions, no grouped-query heads in FusedSDPA) on CPU."""

    calls: list[str] = []

    class FusedSDPA:
        @staticmethod
        def apply(q, k, v, mask, dropout_p, is_causal):
            assert k.size(1) == q.size(1), "FusedSDPA takes as many key heads as query heads"
            _FakeHabana.calls.append("sdpa")
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                  is_causal=is_causal)

    class FusedRMSNorm:
        @staticmethod
        def apply(x, weight, eps):
            _FakeHabana.calls.append("rms_norm")
            xf = x.float()
            return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    class RotaryPosEmbeddingHelperV2:
        @staticmethod
        def apply(x, cos, sin, position_ids):
            assert cos.dim() == 4 and cos.shape[:2] == (1, 1) and position_ids.shape == (x.size(0), x.size(2))
            _FakeHabana.calls.append("rope")
            # (B, 1, T, hd) tables for the rows' positions
            cos, sin = cos[0, 0][position_ids].unsqueeze(1), sin[0, 0][position_ids].unsqueeze(1)
            return x * cos + _rotate_half(x) * sin

    class FusedAdamW(torch.optim.AdamW):
        pass

    class FusedClipNorm:
        def __init__(self, parameters, max_norm):
            self.max_norm = max_norm

        def clip_norm(self, parameters):
            _FakeHabana.calls.append("clip_norm")
            return torch.nn.utils.clip_grad_norm_(parameters, self.max_norm)


def test_habana_kernels_plug_into_the_seams_and_compute_the_same(monkeypatch):
    import sys
    import types

    from megatron_lite.config.schema import OptimizerConfig
    from megatron_lite.distributed.parallel_dims import ParallelDims
    from megatron_lite.optim.optimizer import build_optimizer
    from megatron_lite.training.step import clip_grad_norm

    fake = _FakeHabana
    hpex = "habana_frameworks.torch.hpex"
    modules = {"habana_frameworks": {}, "habana_frameworks.torch": {}, hpex: {},
               f"{hpex}.kernels": {"FusedSDPA": fake.FusedSDPA,
                                   "RotaryPosEmbeddingHelperV2": fake.RotaryPosEmbeddingHelperV2},
               f"{hpex}.normalization": {"FusedRMSNorm": fake.FusedRMSNorm,
                                         "FusedClipNorm": fake.FusedClipNorm},
               f"{hpex}.optimizers": {"FusedAdamW": fake.FusedAdamW}}
    for name, attrs in modules.items():
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs))

    class Hpu:
        def device_name(self) -> str:
            return "hpu"

    kernels = devmod.device_kernels(Hpu())
    for kind in ("attention", "rms_norm", "rope", "adamw", "clip_norm"):
        assert getattr(kernels, kind) is not None, kind

    cfg = ModelConfig(vocab_size=64, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, max_seq_len=16,
                      position="rope", norm="rmsnorm", activation="swiglu", bias=False)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    reference, fused = build_model(cfg, "cpu", seed=0), build_model(cfg, "cpu", seed=0)
    assert use_device_kernels(fused, kernels) == ["attention", "rms_norm", "rope"]
    fake.calls.clear()
    want, got = reference(x, x), fused(x, x)
    assert {"sdpa", "rms_norm", "rope"} <= set(fake.calls)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    want.backward()
    got.backward()
    for (name, a), b in zip(reference.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)

    opt = build_optimizer(fused, OptimizerConfig(), "hpu", kernels.adamw)
    assert isinstance(opt, fake.FusedAdamW) and opt.defaults["lr"] == OptimizerConfig().lr

    dims = ParallelDims(world_size=1, rank=0, local_rank=0, tensor=1, pipeline=1, data=1)
    params = list(fused.parameters())
    norm_ref = clip_grad_norm(list(reference.parameters()), 0.01, dims)
    norm = clip_grad_norm(params, 0.01, dims, kernels.clip_norm)
    assert fake.calls[-1] == "clip_norm"
    torch.testing.assert_close(norm, norm_ref, rtol=1e-4, atol=0)
    for a, b in zip(reference.parameters(), params, strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-7)


def test_the_recipes_hpu_mode_is_in_the_environment_before_torch_is_imported(tmp_path):
    """torch >= 2.5 imports Habana's bridge with torch itself, and the bridge reads
    PT_HPU_LAZY_MODE then: pretrain.py must export the recipe's mode before the first torch
    import. The probe records the variable at that import and stops the run there."""
    probe = (
        "import builtins, os, sys\n"
        "real = builtins.__import__\n"
        "def hook(name, *a, **k):\n"
        "    if name == 'torch' or name.startswith('torch.'):\n"
        "        print('MODE', os.environ.get('PT_HPU_LAZY_MODE'), flush=True)\n"
        "        os._exit(0)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = hook\n"
        "sys.argv = ['pretrain.py', 'recipes/shakespeare-char.yaml', 'training.hpu_mode=eager']\n"
        "import runpy; runpy.run_path('pretrain.py', run_name='__main__')\n"
    )
    # Without the test harness's sitecustomize (it imports torch at start-up).
    env = {k: v for k, v in cpu_env().items() if k != "PT_HPU_LAZY_MODE"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *INHERITED_PYTHONPATH])
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert "MODE 0" in out.stdout, out.stdout + out.stderr


def test_a_bridge_loaded_in_another_mode_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "habana_frameworks", types.ModuleType("habana_frameworks"))
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    with pytest.raises(RuntimeError, match="training.hpu_mode=eager needs PT_HPU_LAZY_MODE=0.*export"):
        devmod.select_accelerator("hpu", "eager")


@pytest.mark.parametrize("cuda_build, says", [(None, "this torch is built without CUDA"),
                                               ("12.8", "this process sees no GPU")])
def test_cuda_asked_for_where_there_is_none_is_a_device_error(monkeypatch, cuda_build, says):
    """Not DeepSpeed's set_device traceback (AttributeError: torch._C has no _cuda_setDevice)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", cuda_build)
    with pytest.raises(devmod.DeviceError, match=f"training.device=cuda, but {says} .*training.device=cpu"):
        devmod.select_accelerator("cuda")


def test_hpu_asked_for_without_habanas_bridge_is_a_device_error(monkeypatch):
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    monkeypatch.delitem(sys.modules, "habana_frameworks", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(devmod.DeviceError, match="training.device=hpu, but Habana's PyTorch bridge"):
        devmod.select_accelerator("hpu")


def test_sampling_on_a_device_that_compiles_per_shape_feeds_one_shape():
    """Gaudi compiles a graph per input shape: token-by-token sampling must feed one padded
    shape (and cut the lazy graph after each token), with the tokens of the unpadded run."""
    from megatron_lite.training.generate import sample

    cfg = ModelConfig(vocab_size=64, n_layers=2, n_heads=2, d_model=32, ffn_hidden=64, max_seq_len=24,
                      position="rope", norm="rmsnorm", activation="swiglu", bias=False)
    model = build_model(cfg, seed=1).eval()
    shapes: list[tuple[int, ...]] = []
    model.register_forward_pre_hook(lambda _, args: shapes.append(tuple(args[0].shape)))
    cuts = []
    args = dict(prompt=[3, 5, 7], max_new_tokens=30, max_len=24, temperature=0.0, top_k=0, seed=0,
                device=torch.device("cpu"))
    plain = sample(model, **args)
    assert len(set(shapes)) > 1  # the unpadded run grows its input
    shapes.clear()
    padded = sample(model, **args, fixed_shape=True, after_token=lambda: cuts.append(1))
    assert set(shapes) == {(1, 24)} and len(cuts) == 30
    assert padded == plain
    assert devmod.compiles_per_shape(devmod.select_accelerator("cpu")) is False


def test_evaluation_cuts_the_lazy_graph_after_every_forward():
    from megatron_lite.config import load_config
    from megatron_lite.distributed.parallel_dims import ParallelDims
    from megatron_lite.training.step import StepRunner

    class Engine:
        module = torch.nn.Linear(2, 2)

        def __call__(self, inputs, targets):
            return inputs.float().mean()

    cfg = load_config(REPO / "recipes/shakespeare-char.yaml", [])
    dims = ParallelDims(world_size=1, rank=0, local_rank=0, tensor=1, pipeline=1, data=1)
    cuts = []
    runner = StepRunner(cfg, dims, Engine(), grad_accum=3, graph_break=lambda: cuts.append(1))
    runner.eval_loss(iter([torch.ones(2, 9, dtype=torch.long)] * 3), torch.device("cpu"))
    assert len(cuts) == 3
