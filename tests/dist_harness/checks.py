"""Accelerator semantics for torch.distributed on a CPU machine (tests only).

On a GPU or Gaudi cluster the default process group is NCCL or HCCL, and so is every group made
by ``new_group`` without a backend: they take accelerator tensors only. Host-side traffic must
use a group created with ``backend="gloo"``. On CPU every tensor is a host tensor and gloo takes
them all, so mistakes of that kind pass silently here and fail on the first multi-GPU run.

Installed in each test process (``sitecustomize.py`` beside this file), this module:

- initialises the default group for the ``cuda`` device type only (``cuda:gloo``), as NCCL
  registers it: any collective on it with a host tensor fails;
- gives groups created without a backend gloo (on this machine the device's tensors are CPU
  tensors) but remembers them as *accelerator groups*, and groups created with
  ``backend="gloo"`` as *host groups*;
- checks every collective before it runs: a host (CPU) tensor on the default group, or a
  picklable-object collective (``broadcast_object_list``, ``all_gather_object``, ...) on any
  accelerator group, raises ``AcceleratorSemanticsError`` naming the collective, the group and
  the calling line. DeepSpeed's own calls on the default group pass device tensors on hardware
  (it allocates them on the accelerator), and a barrier carries no tensor of the caller's: those
  run on a gloo group of all ranks instead, as they would succeed on NCCL/HCCL;
- holds the accelerator groups to what every accelerator backend takes: oneCCL (torch's
  ``xccl``, Intel's ``ccl``) reduces with SUM, MIN, MAX and PRODUCT only (no AVG in older
  releases and none in ``ccl``; no bitwise ops or PREMUL_SUM), takes uint8, int8, int32,
  int64, bool and float tensors only (no int16/uint16/uint32/uint64), and cannot split groups
  (``split_group``): each raises ``AcceleratorSemanticsError`` as it would fail on Aurora;
- with ``DIST_HARNESS_REPORT=DIR``, writes ``DIR/rank{R}.json`` at exit: every group (role,
  ranks, timeout) and every collective called from the project's code (name, group role, the
  project function that called it, whether DeepSpeed issued it on the project's behalf), so
  tests can compare the paths of two runs and check that
  ``distributed.timeout_minutes`` reached every group;
- with ``DIST_HARNESS_STALL=RANK:FUNCTION:N:SECONDS``, rank RANK sleeps before the N-th
  collective called from a project function named FUNCTION (a rank stuck before a collective).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
import time
from datetime import timedelta
from typing import NamedTuple

HOST_ROLE, DEVICE_ROLE = "host (gloo)", "accelerator (NCCL/HCCL on hardware)"

TENSOR_COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "reduce_scatter_single", "_all_gather_base",
    "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all",
    "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv",
)
POINT_TO_POINT = ("send", "recv", "isend", "irecv")
OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object",
                      "scatter_object_list", "send_object_list", "recv_object_list")


REDUCTIONS = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
              "_reduce_scatter_base")
ONECCL_OPS = ("SUM", "MIN", "MAX", "PRODUCT")
ONECCL_DTYPES = ("uint8", "int8", "int32", "int64", "bool", "float16", "bfloat16", "float32", "float64")


class AcceleratorSemanticsError(RuntimeError):
    """A collective that would fail (or stall the device) on an NCCL/HCCL cluster."""


roles: dict[object, str] = {}
"""Process group -> role, for every group created in this process."""
timeouts: dict[object, timedelta | None] = {}
created: list[dict] = []
"""Role, ranks and timeout of every group this rank is a member of, in creation order."""
calls: list[dict] = []
"""The collectives the project's code called: name, group role, calling function."""
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROJECT_PARTS = tuple(os.path.join(REPO, part) for part in ("megatron_lite", "tools", "bench", "pretrain.py"))
_stall_seen = [0]
_cpu_world: list = [None]
"""A gloo group of all ranks: where the default group's legitimate calls run here."""


class _Frame(NamedTuple):
    filename: str
    lineno: int
    name: str


def _stack():
    """The caller's stack, innermost frame first. (``traceback.extract_stack`` reads every
    frame's source line: a fifth of a second per hundred collectives, in every rank.)"""
    frame = sys._getframe(2)
    while frame is not None:
        yield _Frame(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back


def _project_frame():
    """The innermost frame in the package (megatron_lite/): the function that issued the call."""
    for frame in _stack():
        if frame.filename.startswith(PROJECT_PARTS) and not frame.filename.endswith("collectives.py"):
            return frame
    return None


# bench/parallel_layouts.py wraps the collectives to count them: its wrapper is never the caller.
_COUNTING_WRAPPER = os.path.join(REPO, "bench", "parallel_layouts.py")


def _from_deepspeed() -> bool:
    """Whether the collective was called by DeepSpeed itself (not through it by our code)."""
    skip = (os.sep + "torch" + os.sep, os.path.dirname(__file__), _COUNTING_WRAPPER)
    for frame in _stack():
        if not any(s in frame.filename for s in skip):
            return os.sep + "deepspeed" + os.sep in frame.filename
    return False


def _call_site() -> str:
    """The first frame outside torch, DeepSpeed and this harness: the code that made the call."""
    skip = (os.sep + "torch" + os.sep, os.sep + "deepspeed" + os.sep, os.path.dirname(__file__),
            _COUNTING_WRAPPER)
    for frame in _stack():
        if not any(s in frame.filename for s in skip):
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "unknown caller"


def _tensors(args, kwargs):
    import torch

    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


@functools.cache
def _parameters(name: str) -> list[str]:
    import inspect

    try:
        return list(inspect.signature(_originals[name]).parameters)
    except (TypeError, ValueError):
        return []


def _group_of(name: str, args, kwargs):
    if "group" in kwargs:
        return kwargs["group"]
    params = _parameters(name)
    if "group" in params and params.index("group") < len(args):
        return args[params.index("group")]
    return None


def _describe(group) -> str:
    import torch.distributed as dist

    if group is None or group is dist.GroupMember.WORLD:
        return "the default process group"
    return f"an {roles.get(group, DEVICE_ROLE)} group of ranks {dist.get_process_group_ranks(group)}"


def _record(name: str, role: str) -> None:
    import threading

    frame = _project_frame()
    # The hang watchers' exchange runs on a timer of its own: its count differs from run to run.
    if frame is None or threading.current_thread().name == "hang-watch":
        return
    site = f"{os.path.relpath(frame.filename, REPO).removeprefix('megatron_lite' + os.sep)}:{frame.name}"
    calls.append({"name": name, "role": role, "site": site,
                  "issuer": "deepspeed" if _from_deepspeed() else "project"})
    stall = os.environ.get("DIST_HARNESS_STALL")
    if stall:
        rank, function, nth, seconds = stall.split(":")
        import torch.distributed as dist

        if dist.get_rank() == int(rank) and frame.name == function:
            _stall_seen[0] += 1
            if _stall_seen[0] == int(nth):
                print(f"[harness] rank {rank} stalls {seconds} s before {name} in {site}", flush=True)
                time.sleep(float(seconds))


def _check(name: str, args, kwargs):
    """Raises for a call that would fail on an accelerator cluster; returns the group to run it
    on instead of the default group where it would succeed there (else None)."""
    import torch.distributed as dist

    ops = list(args[0] if args else kwargs.get("p2p_op_list", ())) if name == "batch_isend_irecv" else []
    group = ops[0].group if ops else _group_of(name, args, kwargs)
    if ops:  # the tensors and group travel inside the P2POps
        args, kwargs = ([op.tensor for op in ops],), {}
    default = group is None or group is dist.GroupMember.WORLD
    role = DEVICE_ROLE if default else roles.get(group, DEVICE_ROLE)
    _record(name, "default" if default else role)
    if name in OBJECT_COLLECTIVES and role != HOST_ROLE:
        raise AcceleratorSemanticsError(
            f"{name} on {_describe(group)}, called at {_call_site()}: on NCCL/HCCL the pickled "
            "objects are staged through the accelerator (a device sync per call); host-side "
            "agreement belongs on the gloo control group")
    if name in POINT_TO_POINT and role != HOST_ROLE and not _from_deepspeed():
        raise AcceleratorSemanticsError(
            f"{name} on {_describe(group)}, called at {_call_site()}: on NCCL/HCCL a rank that "
            "sends to and receives from the same peer must issue both together "
            "(dist.batch_isend_irecv), or both ranks wait in their send until the watchdog")
    if role != HOST_ROLE and not _from_deepspeed():
        _check_oneccl(name, group, args, kwargs)
    if default and not ops and (name == "barrier" or _from_deepspeed()):
        return _cpu_world[0]
    if default:
        host = [t for t in _tensors(args, kwargs) if t.device.type == "cpu"]
        if host:
            raise AcceleratorSemanticsError(
                f"{name} of a host (cpu) tensor on the default process group, called at "
                f"{_call_site()}: NCCL/HCCL would fail with 'No backend type associated with "
                "device type cpu'")


def _check_oneccl(name: str, group, args, kwargs) -> None:
    """What oneCCL refuses on an accelerator group (see the module's docstring)."""
    if name in REDUCTIONS:
        params = _parameters(name)
        op = kwargs.get("op")
        if op is None and "op" in params and params.index("op") < len(args):
            op = args[params.index("op")]
        op_name = str(getattr(op, "name", op)).rsplit(".", 1)[-1] if op is not None else "SUM"
        if op_name not in ONECCL_OPS:
            raise AcceleratorSemanticsError(
                f"{name} with ReduceOp.{op_name} on {_describe(group)}, called at {_call_site()}: "
                f"oneCCL reduces with {', '.join(ONECCL_OPS)} only (Aurora's xccl and ccl refuse it)")
    for t in _tensors(args, kwargs):
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in ONECCL_DTYPES and not dtype.startswith("float8"):
            raise AcceleratorSemanticsError(
                f"{name} of a {dtype} tensor on {_describe(group)}, called at {_call_site()}: "
                f"oneCCL takes {', '.join(ONECCL_DTYPES)} only")


_originals: dict[str, object] = {}


def _wrap(name: str) -> None:
    import torch.distributed as dist

    original = getattr(dist, name, None)
    if original is None:
        return
    _originals[name] = original

    @functools.wraps(original)
    def checked(*args, **kwargs):
        instead = _check(name, args, kwargs)
        if instead is not None:
            params = _parameters(name)
            if "group" in params and params.index("group") < len(args):
                args = list(args)
                args[params.index("group")] = instead
            else:
                kwargs["group"] = instead
        return original(*args, **kwargs)

    setattr(dist, name, checked)


def install() -> None:
    import torch.distributed as dist

    if getattr(dist, "_accelerator_semantics", False):
        return
    dist._accelerator_semantics = True
    init, new_group = dist.init_process_group, dist.new_group

    @functools.wraps(init)
    def init_process_group(backend=None, *args, **kwargs):
        if backend in (None, "gloo", "cpu:gloo"):
            backend = "cuda:gloo"  # the default group of an NCCL/HCCL job: accelerator tensors only
        out = init(backend, *args, **kwargs)
        timeouts["world"] = kwargs.get("timeout")
        _cpu_world[0] = new_group(backend="gloo", timeout=kwargs.get("timeout"))
        return out

    @functools.wraps(new_group)
    def checked_new_group(ranks=None, timeout=None, backend=None, *args, **kwargs):
        role = HOST_ROLE if backend in ("gloo", "cpu:gloo") else DEVICE_ROLE
        if timeout is None:  # what torch gives a group made without one
            timeout = dist.distributed_c10d._get_default_timeout(dist.Backend.GLOO)
        group = new_group(ranks, timeout, "gloo" if backend is None else backend, *args, **kwargs)
        if group is not dist.GroupMember.NON_GROUP_MEMBER:
            roles[group] = role
            timeouts[group] = timeout
            created.append({"role": role, "ranks": dist.get_process_group_ranks(group),
                            "timeout_s": timeout.total_seconds()})
        return group

    dist.init_process_group = init_process_group
    dist.new_group = checked_new_group
    if hasattr(dist, "split_group"):
        def split_group(*args, **kwargs):
            raise AcceleratorSemanticsError(
                f"split_group, called at {_call_site()}: oneCCL's xccl cannot split a group "
                "(torch reports no splitting support for it); create groups with new_group")

        dist.split_group = split_group
    for name in (*TENSOR_COLLECTIVES, *OBJECT_COLLECTIVES, "barrier", "monitored_barrier",
                 "batch_isend_irecv"):
        _wrap(name)
    _unwrap_p2p_ops(dist)
    if os.environ.get("DIST_HARNESS_REPORT"):
        atexit.register(_write_report, os.environ["DIST_HARNESS_REPORT"])


def _unwrap_p2p_ops(dist) -> None:
    """``P2POp`` accepts only torch's own ``isend``/``irecv`` (and ``batch_isend_irecv`` tells
    sends from receives by identity): give it the originals, so that batched point-to-point runs
    as on a cluster (checked once, as ``batch_isend_irecv``) while a bare ``isend`` is refused."""
    plain = dist.P2POp

    class P2POp(plain):
        def __new__(cls, op, *args, **kwargs):
            return super().__new__(cls, getattr(op, "__wrapped__", op), *args, **kwargs)

        def __init__(self, op, *args, **kwargs):
            super().__init__(getattr(op, "__wrapped__", op), *args, **kwargs)

    dist.P2POp = P2POp


def _write_report(folder: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() and not roles:
        return
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump({"groups": created, "calls": calls, "world_timeout_s":
                   timeouts.get("world").total_seconds() if timeouts.get("world") else None}, f)

