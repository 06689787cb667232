"""Intel GPUs (training.device=xpu): DeepSpeed's XPU accelerator is the one reached, the oneCCL
backend is chosen as torch and Intel's bindings allow, and a machine without the software says
so in one line. (No XPU here: the accelerator class itself and the choice are what run.)"""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch.distributed as dist

from megatron_lite.config import load_config
from megatron_lite.distributed import device
from tests.conftest import REPO, cpu_env


def test_deepspeeds_xpu_accelerator_names_the_device_and_its_tile_mask():
    try:
        from deepspeed.accelerator.xpu_accelerator import XPU_Accelerator
    except ImportError as e:  # DeepSpeed before 0.17 imports Intel's extension with the module
        pytest.skip(f"this DeepSpeed's XPU accelerator needs intel_extension_for_pytorch: {e}")

    acc = XPU_Accelerator()
    assert acc.device_name() == "xpu"
    assert acc.visible_devices_envs() == ["ZE_AFFINITY_MASK"]


def test_the_backend_is_xccl_where_torch_has_it_else_intels_bindings(monkeypatch):
    monkeypatch.setattr(dist, "is_xccl_available", lambda: True, raising=False)
    assert device.xpu_backend() == "xccl"
    monkeypatch.setattr(dist, "is_xccl_available", lambda: False, raising=False)
    bindings = "oneccl_bindings_for_pytorch"
    monkeypatch.setitem(sys.modules, bindings, types.ModuleType(bindings))
    assert device.xpu_backend() == "ccl"
    monkeypatch.setitem(sys.modules, bindings, None)  # not installed
    with pytest.raises(device.DeviceError, match="no 'xccl' .* oneccl_bindings_for_pytorch is not installed"):
        device.xpu_backend()


def test_the_recipe_takes_xpu():
    cfg = load_config(REPO / "recipes/shakespeare-char.yaml", ["training.device=xpu"])
    assert cfg.training.device == "xpu"


def test_xpu_without_intels_torch_is_one_line_and_exit_status_2(tmp_path):
    """DS_ACCELERATOR=xpu reaches DeepSpeed's XPU accelerator, which refuses a torch without XPU."""
    proc = subprocess.run([sys.executable, "pretrain.py", "recipes/shakespeare-char.yaml",
                           "training.device=xpu", f"logging.dir={tmp_path}/run"],
                          cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    # (DeepSpeed 0.17 and later: "requires PyTorch with XPU support"; before: Intel's extension.)
    assert "training.device=xpu (DS_ACCELERATOR=xpu): DeepSpeed's XPU accelerator cannot start here: " \
           "XPU_Accelerator requires " in errors[0], errors
    assert "Traceback" not in proc.stderr
