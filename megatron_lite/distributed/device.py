"""The one device module: the only code that touches torch.cuda or Habana specifics.

Everything else reaches the device through DeepSpeed's accelerator abstraction via these helpers,
so CPU, CUDA and HPU share one code path. The Gaudi parts (lazy-mode graph cuts, the fused
attention kernel) are small on purpose: they are exercised here only
through the same functions the CPU path calls, which return no-ops off HPU
(``docs/hardware.md``).
"""

from __future__ import annotations

import importlib.util
import os
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceSpec:
    """Data-sheet numbers of one accelerator (dense, no sparsity)."""

    bf16: float
    """Peak bf16/fp16 matmul FLOP/s."""
    fp32: float
    """Peak FLOP/s for fp32 training (TF32 tensor cores on NVIDIA)."""
    memory_gb: float
    """Device memory, GB (10^9 bytes)."""
    host_memory_gb: float = 512
    """Host memory of a typical node carrying this device, GB (where ZeRO-Offload puts its
    state; the planner's ``--host-memory-gb`` overrides it)."""
    intra_node_gbs: float = 200
    """Bandwidth a collective reaches between devices of one node, GB/s per device (NVLink;
    Gaudi's on-chip RoCE ports): the planner's ``--suggest`` prices communication with it."""
    inter_node_gbs: float = 12.5
    """A device's share of its node's network, GB/s."""
    host_gbs: float = 25
    """Device to host memory (PCIe), GB/s: what offload pays."""


# Vendor data sheets (SXM/OAM parts). CPUs have no entry and report no MFU. The name is matched
# against the device's reported name: every dash-separated part of the key must appear in it
# (so "NVIDIA A100-SXM4-80GB" is an A100-80GB), else the first part alone.
# Bandwidths are nominal link rates derated to what collectives typically reach; they rank
# layouts, they do not promise seconds. Polaris: NVLink within a node, 2 x 200 Gb/s Slingshot
# NICs shared by 4 GPUs; DGX H100: NVLink 4, one 400 Gb/s NIC per GPU; Gaudi 2/3: 21 of 24
# RoCE ports (100 / 200 Gb/s) within the node, 3 out.
DEVICES = {
    "A100-40GB": DeviceSpec(312e12, 156e12, 40, 512, 200, 12.5, 25),  # a Polaris node
    "A100-80GB": DeviceSpec(312e12, 156e12, 80, 1000, 200, 25, 25),  # DGX A100 (1 TB)
    "H100": DeviceSpec(989e12, 494e12, 80, 2000, 350, 50, 50),  # DGX H100 (2 TB)
    "H200": DeviceSpec(989e12, 494e12, 141, 2000, 350, 50, 50),
    "GAUDI2": DeviceSpec(432e12, 432e12 / 4, 96, 1000, 250, 37.5, 25),  # HLS-Gaudi2 (1 TB)
    "GAUDI3": DeviceSpec(1835e12, 1835e12 / 4, 128, 1000, 500, 75, 50),
    # One tile (stack) of an Intel Data Center GPU Max 1550, the rank unit on Aurora (12 per
    # node). ALCF publishes measured rates, not a data-sheet peak per tile: bf16 GEMM 273 TFLOP/s,
    # fp32 23; tile-to-tile over Xe Link 196 GB/s within a GPU but 15 between GPUs (one way);
    # 8 Slingshot-11 endpoints of 25 GB/s per node for 12 tiles; PCIe 54 GB/s
    # (docs.alcf.anl.gov/aurora/node-performance-overview/, .../hardware-overview/machine-overview/).
    # Memory: 64 GiB per tile; host: 2 × (512 GB DDR5 + 64 GB HBM) per node.
    "MAX1550": DeviceSpec(273e12, 23e12, 68.7, 1150, 20, 16.7, 54),
}


def device_spec(name: str) -> DeviceSpec | None:
    """The table entry for a device name ('NVIDIA A100-SXM4-40GB', 'h100', 'Gaudi2'), or None."""
    upper = name.upper().replace(" ", "")
    for key, spec in DEVICES.items():
        if all(part in upper for part in key.split("-")):
            return spec
    for key, spec in DEVICES.items():
        if key.split("-")[0] in upper:
            return spec
    return None


class DeviceError(RuntimeError):
    """The device asked for cannot be used here (its software is missing): the same on every rank."""


class LocalDeviceError(DeviceError):
    """This rank's node lacks the device asked for (no GPU visible, no Habana bridge): found
    before any process group exists and nodes differ, so every rank reports its own."""


def cpu_unless_accelerator() -> None:
    """With no GPU and no Gaudi software, tell DeepSpeed it is the CPU (spares its probing and
    warning); call before DeepSpeed is imported."""
    if not torch.cuda.is_available() and importlib.util.find_spec("habana_frameworks") is None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def select_accelerator(device: str, hpu_mode: str = "lazy"):
    """DeepSpeed's accelerator for ``device`` ('auto' lets DeepSpeed detect it). On Gaudi the
    execution mode must be chosen before Habana's PyTorch bridge is imported: a bridge that
    is already loaded (torch imports it since 2.5) in another mode is refused."""
    want = "1" if hpu_mode == "lazy" else "0"
    have = os.environ.setdefault("PT_HPU_LAZY_MODE", want)
    if have != want and device in ("hpu", "auto") and "habana_frameworks" in sys.modules:
        raise RuntimeError(f"training.hpu_mode={hpu_mode} needs PT_HPU_LAZY_MODE={want}, but Habana's "
                           f"bridge was loaded with PT_HPU_LAZY_MODE={have}: export PT_HPU_LAZY_MODE="
                           f"{want} before starting Python (launch/gaudi.sh does), or set "
                           f"training.hpu_mode to match")
    if device == "cuda" and not torch.cuda.is_available():  # else a traceback from DeepSpeed's set_device
        built = torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None  # ROCm too
        why = "this process sees no GPU" if built else "this torch is built without CUDA"
        raise LocalDeviceError(f"training.device=cuda, but {why} (torch {torch.__version__}): run on a "
                               "GPU node with a CUDA build of torch, or set training.device=cpu (auto: "
                               "what is there)")
    if device == "hpu" and "habana_frameworks" not in sys.modules and importlib.util.find_spec(
            "habana_frameworks") is None:
        raise LocalDeviceError("training.device=hpu, but Habana's PyTorch bridge (habana_frameworks) is "
                               "not installed: run on a Gaudi node in Habana's container, or set "
                               "training.device=cpu")
    if device != "auto":
        os.environ["DS_ACCELERATOR"] = device
    else:
        cpu_unless_accelerator()
    try:
        from deepspeed.accelerator import get_accelerator  # importing deepspeed picks it already

        acc = get_accelerator()
    except (AssertionError, ImportError, ValueError) as e:
        if os.environ.get("DS_ACCELERATOR") != "xpu":
            raise
        # DeepSpeed's XPU accelerator asserts torch.xpu (newer releases) or imports Intel's
        # extension (older ones): say which, and what to install.
        raise DeviceError(f"training.device=xpu (DS_ACCELERATOR=xpu): DeepSpeed's XPU accelerator "
                          f"cannot start here: {str(e).rstrip('.')}. It needs a torch built for Intel "
                          f"GPUs with torch.xpu.is_available() true (on Aurora: module load frameworks; "
                          f"DeepSpeed releases before 0.17 also need intel_extension_for_pytorch)"
                          ) from None
    if device != "auto" and acc.device_name() != device:
        raise RuntimeError(f"training.device={device} but DeepSpeed selected '{acc.device_name()}'")
    return acc


def set_matmul_precision(acc, tf32: bool) -> None:
    """TF32 for float32 matrix products on CUDA (``training.tf32``); other devices unchanged."""
    if acc.device_name() == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32


# glibc's mallopt(3) parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def retain_freed_host_memory() -> bool:
    """Keep freed host memory in this process instead of handing it back to the kernel (glibc
    only; True if applied). By default glibc serves large blocks with mmap and trims the heap
    after frees, so every step's activations and gradients arrive in fresh pages, page faults
    that cost a small model a visible share of its step on CPU (docs/benchmarks-history.md). The
    training loop's working set is the same every step, so keeping it costs no more memory than
    the first step's peak. Set by hand because the allocators that do this by default (jemalloc,
    tcmalloc) must be preloaded before the interpreter starts."""
    import ctypes

    libc = ctypes.CDLL(None)
    gnu_version = getattr(libc, "gnu_get_libc_version", None)
    if gnu_version is None or not hasattr(libc, "mallopt"):
        return False  # macOS, musl: their allocators are left alone
    # Heap (never mmap) for blocks below 1 GiB, and never trim the heap's free top.
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def device_name(acc) -> str:
    """Human-readable name of this rank's device (e.g. 'NVIDIA A100-SXM4-40GB', 'cpu')."""
    kind = acc.device_name()
    if kind == "cpu":
        return "cpu"
    # DeepSpeed's accelerators do not report the model; torch.cuda and Habana's torch.hpu do.
    module = getattr(torch, kind, None)
    if module is None or not hasattr(module, "get_device_name"):
        return kind
    return module.get_device_name(acc.current_device())


def float8_problem(acc) -> str | None:
    """Why this rank's device cannot run ``model.fp8``'s float8 products, or None. CUDA needs
    float8 units (compute capability 8.9 and up: Ada, Hopper, Blackwell); the CPU emulates them;
    torchao's float8 training has no HPU path."""
    kind = acc.device_name()
    if kind == "cpu":
        return None
    if kind == "cuda":
        major, minor = torch.cuda.get_device_capability(acc.current_device())
        if (major, minor) >= (8, 9):
            return None
        return (f"'model.fp8' = true needs float8 units (compute capability 8.9+: H100, H200, L40S); "
                f"{device_name(acc)} is {major}.{minor}: set model.fp8=false")
    return f"'model.fp8' = true: torchao's float8 training does not run on {kind}; set model.fp8=false"


def nvme_problem(acc, offload_optimizer: str, offload_params: str) -> str | None:
    """Why NVMe offload cannot run on this machine, or None. DeepSpeed's async-I/O op compiles
    against libaio; without it the run fails in the engine's first swap, after the model is built,
    with "Unable to JIT load the async_io op"."""
    settings = [f"parallel.{key}=nvme" for key, where in (("offload_optimizer", offload_optimizer),
                                                           ("offload_params", offload_params))
                if where == "nvme"]
    builder = acc.create_op_builder("AsyncIOBuilder") if settings else None
    if builder is None or _prebuilt(builder.name) or builder.is_compatible(verbose=False):
        return None
    return (f"{' and '.join(settings)} needs DeepSpeed's async-I/O op, which cannot be built here: "
            "libaio's headers and library are missing (apt install libaio-dev, or conda install -c "
            "conda-forge libaio; then make install builds the op), or offload to 'cpu'")


def _prebuilt(op: str) -> bool:
    """Whether DeepSpeed was installed with ``op`` compiled (``DS_BUILD_*=1``): then it loads it
    without building it, where libaio's headers may be missing."""
    from deepspeed.git_version_info import installed_ops

    return bool(installed_ops.get(op, False))


def peak_flops(name: str, precision: str) -> float | None:
    """Peak FLOP/s of a device by name, or None when unknown (then MFU is not reported)."""
    spec = device_spec(name)
    if spec is None:
        return None
    return spec.fp32 if precision == "fp32" else spec.bf16


def graph_break(acc, hpu_mode: str):
    """A function to call where Gaudi's lazy mode must cut and run the accumulated graph (after
    backward, after the optimizer step); a no-op elsewhere."""
    if acc.device_name() != "hpu" or hpu_mode != "lazy":
        return lambda: None
    import habana_frameworks.torch.core as htcore

    return htcore.mark_step


def compiles_per_shape(acc) -> bool:
    """Whether the device builds a graph for each input shape it sees (Gaudi, in lazy mode and
    under torch.compile alike): there, a loop over growing inputs (sampling token by token)
    compiles once per length; it must feed one padded shape instead."""
    return acc.device_name() == "hpu"


@dataclass(frozen=True)
class DeviceKernels:
    """A device's fused kernels, each with the calling convention of the plain-PyTorch reference
    it replaces; None means the reference runs. ``parallel.apply.use_device_kernels`` plugs the
    model's into its seams, the optimizer and clipping take theirs directly."""

    attention: Callable | None = None
    """``F.scaled_dot_product_attention``'s convention (``CausalAttention.sdpa``)."""
    rms_norm: Callable | None = None
    """(x, weight, eps) -> normalised x, as ``model.transformer.rms_norm``."""
    rope: Callable | None = None
    """(x (B, H, T, hd), cos (T, hd), sin (T, hd)) -> rotated x, as ``model.transformer.apply_rope``."""
    adamw: type | None = None
    """An optimizer class taking ``torch.optim.AdamW``'s arguments."""
    clip_norm: Callable | None = None
    """(parameters, max_norm) -> total gradient norm, the gradients scaled in place (one rank's
    norm: used only where no other rank holds part of the gradients)."""


def device_kernels(acc) -> DeviceKernels:
    """The fused kernels of this rank's device: Habana's on Gaudi (those its release ships),
    none elsewhere (CUDA's fast paths are torch's own: flash SDPA, fused AdamW, compile)."""
    if acc.device_name() != "hpu":
        return DeviceKernels()
    return habana_kernels()


def habana_kernels() -> DeviceKernels:
    """Habana's fused kernels as Intel's Llama pretraining workflow uses them (optimum-habana,
    Megatron-DeepSpeed for Gaudi), adapted to the references' conventions. Each is imported on
    its own: releases differ in which they ship."""
    import importlib

    def find(module: str, name: str):
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return None

    sdpa = find("habana_frameworks.torch.hpex.kernels", "FusedSDPA")
    rms = find("habana_frameworks.torch.hpex.normalization", "FusedRMSNorm")
    rope = find("habana_frameworks.torch.hpex.kernels", "RotaryPosEmbeddingHelperV2")
    adamw = find("habana_frameworks.torch.hpex.optimizers", "FusedAdamW")
    clip = find("habana_frameworks.torch.hpex.normalization", "FusedClipNorm")

    def attention(q, k, v, is_causal=False, dropout_p=0.0, enable_gqa=False):
        if enable_gqa and k.size(1) != q.size(1):  # (B, Hkv, T, hd) -> (B, H, T, hd)
            k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
            v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
        return sdpa.apply(q, k, v, None, dropout_p, is_causal)

    def rms_norm(x, weight, eps):
        return rms.apply(x, weight, eps)

    def rotary(x, cos, sin):
        # Habana's kernel takes (1, 1, T, hd) tables and the positions of each row (B, T).
        positions = torch.arange(x.size(2), device=x.device).expand(x.size(0), -1)
        return rope.apply(x, cos[None, None], sin[None, None], positions)

    def clip_norm(parameters, max_norm):
        parameters = list(parameters)
        return clip(parameters, max_norm).clip_norm(parameters)

    return DeviceKernels(attention=attention if sdpa else None, rms_norm=rms_norm if rms else None,
                         rope=rotary if rope else None, adamw=adamw,
                         clip_norm=clip_norm if clip else None)


def communication_backend(acc) -> str:
    # gloo is the CPU backend that ships with every torch build (oneCCL may not be installed).
    if acc.device_name() == "cpu":
        return "gloo"
    return xpu_backend() if acc.device_name() == "xpu" else acc.communication_backend_name()


def xpu_backend() -> str:
    """oneCCL for Intel GPUs: torch's own ``xccl`` where this torch has it (2.8 and later, built
    for XPU), else the ``ccl`` that importing ``oneccl_bindings_for_pytorch`` registers. (DeepSpeed's
    accelerator prefers ``ccl`` whenever the bindings import: the bindings are the older path.)"""
    import torch.distributed as dist

    available = getattr(dist, "is_xccl_available", None)
    if available is not None and available():
        return "xccl"
    try:
        importlib.import_module("oneccl_bindings_for_pytorch")
    except ImportError:
        raise DeviceError("training.device=xpu: no oneCCL backend: this torch has no 'xccl' (torch 2.8+ "
                          "built for XPU) and oneccl_bindings_for_pytorch is not installed; on Aurora "
                          "load the frameworks module, elsewhere install torch for XPU") from None
    return "ccl"


def host_rss_gib() -> float:
    """This process's resident host memory now (Linux's ``/proc/self/statm``); elsewhere its
    peak (``getrusage``), the nearest portable figure."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def device_memory_gib(acc) -> dict[str, float]:
    """Accelerator memory of this rank (empty on CPU, whose only memory is the host's):
    allocated and reserved now, and the peak allocated since the previous call (the peak
    counter is reset: a record's peak is its own interval's)."""
    if acc.device_name() == "cpu":
        return {}
    stats = {"memory_allocated_gib": acc.memory_allocated() / 2**30,
             "memory_reserved_gib": acc.memory_reserved() / 2**30,
             "memory_peak_gib": acc.max_memory_allocated() / 2**30}
    acc.reset_peak_memory_stats()
    return stats


def memory_gib(acc) -> float:
    """Peak memory of this rank: device memory on accelerators, process RSS on CPU."""
    if acc.device_name() == "cpu":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return acc.max_memory_allocated() / 2**30
