"""The one device module: the only code that touches torch.cuda or Habana specifics.

Everything else reaches the device through DeepSpeed's accelerator abstraction via these helpers,
so CPU, CUDA and HPU share one code path.
"""

from __future__ import annotations

import importlib.util
import os
import resource

import torch

# Dense bf16/fp16 tensor-core peak per device, FLOP/s (vendor data sheets). fp32 uses TF32 peak
# on NVIDIA (what matmuls run at with TF32 enabled); CPUs have no entry and report no MFU.
PEAK_FLOPS = {
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12},
    "GAUDI2": {"bf16": 432e12, "fp16": 432e12, "fp32": 432e12 / 4},
    "GAUDI3": {"bf16": 1835e12, "fp16": 1835e12, "fp32": 1835e12 / 4},
}


def select_accelerator(device: str):
    """DeepSpeed's accelerator for ``device`` ('auto' lets DeepSpeed detect it)."""
    if device != "auto":
        os.environ["DS_ACCELERATOR"] = device
    elif not torch.cuda.is_available() and importlib.util.find_spec("habana_frameworks") is None:
        # No GPU and no Gaudi software: spare DeepSpeed's probing (and its warning).
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if device != "auto" and acc.device_name() != device:
        raise RuntimeError(f"training.device={device} but DeepSpeed selected '{acc.device_name()}'")
    return acc


def device_name(acc) -> str:
    """Human-readable name of this rank's device (e.g. 'NVIDIA A100-SXM4-40GB', 'cpu')."""
    if acc.device_name() == "cpu":
        return "cpu"
    try:
        return acc.get_device_name(acc.current_device())
    except Exception:
        return acc.device_name()


def peak_flops(name: str, precision: str) -> float | None:
    """Peak FLOP/s of a device by name, or None when unknown (then MFU is not reported)."""
    upper = name.upper().replace(" ", "")
    for key, table in PEAK_FLOPS.items():
        if key in upper:
            return table[precision]
    return None


def communication_backend(acc) -> str:
    # gloo is the CPU backend that ships with every torch build (oneCCL may not be installed).
    return "gloo" if acc.device_name() == "cpu" else acc.communication_backend_name()


def memory_gib(acc) -> float:
    """Peak memory of this rank: device memory on accelerators, process RSS on CPU."""
    if acc.device_name() == "cpu":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return acc.max_memory_allocated() / 2**30
