"""Every collective the project issues, each with its group and its device: the one rule.

**Host control** — ranks agreeing on what to do next: errors, stop flags, checkpoint votes,
spike decisions, small objects (paths, manifests, logs), averages for the log line. Always over
a gloo group (``ParallelDims``'s ``control`` group, or the background checkpoint writer's own
``checkpoint`` group) with CPU tensors. It never synchronises the accelerator and works whatever
backend the accelerator uses: NCCL and HCCL groups, the default group included, take device
tensors only ("No backend type associated with device type cpu").

**Device** — tensors that live on the accelerator (activations, gradients, norms), over the
accelerator-backed groups of ``ParallelDims`` (``tensor``, ``ulysses``, ...: NCCL, HCCL, or gloo
on a CPU run). Never the default group.

Nothing else in the project calls ``torch.distributed``'s collectives
(tests/unit/test_collectives_rule.py), and every process group is created by
``ParallelDims.create_groups``. A run always has its process groups, one process too, so a
one-GPU run executes the same collectives as a multi-GPU one; only code that never started
``torch.distributed`` (unit tests, tools) gets the local answers.

A collective that fails or times out (``distributed.timeout_minutes``) raises
``CollectiveError`` naming what the ranks were agreeing on.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from megatron_lite.distributed import hang


class ParallelDims(Protocol):
    """What these functions read of ``parallel_dims.ParallelDims`` (named here, not imported:
    parallel_dims creates its groups through this module)."""

    rank: int
    local_rank: int
    world_size: int

    def group(self, name: str) -> Any: ...


T = TypeVar("T")


class CollectiveError(RuntimeError):
    """A collective failed or timed out: another rank stopped, hung or diverged."""


def set_default_timeout(timeout: timedelta) -> None:
    """Make ``timeout`` the default of every process group created from now on, those DeepSpeed
    creates without one (pipeline and ZeRO groups) included: torch reads the default from these
    two module attributes each time a group is made (``distributed_c10d._get_default_timeout``);
    no public setting exists."""
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout


def _running() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _running() else 0


def first_line(error: BaseException) -> str:
    """An error's first line without the backend's source location (``[.../pair.cc:553] ``)."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    return re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text.splitlines()[0])


def _agree(what: str, fn: Callable[[], T], name: str, group) -> T:
    """Run one host collective ``name`` on ``group``; a failure (a timeout, a rank gone) becomes
    ``CollectiveError``. Only the collective runs inside: gloo reports its failures as plain
    ``RuntimeError``. While it runs, hang.py knows this thread is in it."""
    try:
        with hang.waiting_in(name, what, group):
            return fn()
    except RuntimeError as e:
        raise CollectiveError(f"rank {_rank()}: {what} (a collective on a gloo control group) "
                              f"failed: {first_line(e)}") from e


def _host_group(dims: ParallelDims, group):
    return dims.group("control") if group is None else group


# ---------------------------------------------------------------- host control (gloo, CPU)

def raise_together(error: BaseException | None, dims: ParallelDims, what: str = "error agreement",
                   group=None) -> None:
    """Host, control group: every rank raises if any rank has an ``error``, instead of the
    healthy ranks waiting in a later collective. Every rank raises the same type (a failing rank
    its own error; the others the first failing rank's type, naming that rank and its message),
    so a caller that handles one kind of failure (``checkpoint.on_save_failure=continue``)
    handles it on every rank alike."""
    g = _host_group(dims, group)
    if g is not None:
        failed = torch.tensor([int(error is not None)], dtype=torch.int32)
        _agree(what, lambda: dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=g), "all_reduce", g)
        if failed.item():  # the rare path: learn who failed and how
            # The type travels by name: pickling a class defined inside a function would fail
            # on this rank alone, in the middle of the collective.
            kind = type(error)
            mine = None if error is None else (kind.__module__, kind.__qualname__, first_line(error))
            reports = all_gather_object(mine, dims, f"the errors during {what}", group)
            if error is None:
                rank, (module, name, message) = next((r, x) for r, x in enumerate(reports) if x is not None)
                raise _same_kind(module, name, f"rank {rank} failed during {what}: {message}")
    if error is not None:
        raise error


def _same_kind(module: str, name: str, message: str) -> BaseException:
    """An exception of the class ``module.name`` carrying ``message`` (RuntimeError when that
    class cannot be found or made from a message alone)."""
    try:
        kind = importlib.import_module(module)
        for part in name.split("."):
            kind = getattr(kind, part)
        made = kind(message)
    except Exception:
        return RuntimeError(message)
    return made if isinstance(made, BaseException) and str(made) == message else RuntimeError(message)


def on_one_rank_then_all(fn: Callable[[], T], dims: ParallelDims, what: str, *, share: bool = False,
                         fail: Callable[[Exception], BaseException] | None = None,
                         per_node: bool = False, long_wait: bool = False) -> T | None:
    """Host, control group: the agree-or-fail pattern of work one rank does for all (a file
    read, a directory made). ``fn`` runs on rank 0 (or, with ``per_node``, on local rank 0 of
    every node: node-local disks) while the others wait, up to the control group's timeout, or
    with ``long_wait`` the setup group's (``distributed.setup_timeout_minutes``). If it fails,
    every rank raises (its error through ``fail``, which turns it into the caller's error type,
    when given); else, with ``share``, every rank returns rank 0's result, without it rank 0
    alone does (None elsewhere)."""
    if share and per_node:
        raise ValueError("a per-node result has no one rank to share it from")
    result: T | None = None
    error: BaseException | None = None
    if (dims.local_rank if per_node else dims.rank) == 0:
        try:
            result = fn()
        except Exception as e:  # re-raised by raise_together, on every rank
            error = e if fail is None else fail(e)
    g = dims.group("setup")
    if g is not None and long_wait:
        # The waiting ranks may wait longer than a collective should (a large corpus is being
        # indexed): in the group whose timeout is that long.
        _agree(f"waiting for {what}", lambda: dist.barrier(group=g), "barrier", g)
    raise_together(error, dims, what)
    return broadcast_object(result, dims, what) if share else result


def on_every_rank(fn: Callable[[], T], dims: ParallelDims, what: str) -> T:
    """Host, control group: ``fn()`` on every rank; if it fails on any, every rank raises."""
    try:
        result, error = fn(), None
    except Exception as e:
        result, error = None, e
    raise_together(error, dims, what)
    return result  # type: ignore[return-value]


def any_rank(flags: list[bool], dims: ParallelDims, what: str = "stop/save flags") -> list[bool]:
    """Host, control group: element-wise OR of ``flags`` over all ranks."""
    g = dims.group("control")
    if g is None:
        return flags
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    _agree(what, lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g), "all_reduce", g)
    return [bool(x) for x in t.tolist()]


def sum_over_ranks(values: list[float], dims: ParallelDims, what: str) -> list[float]:
    """Host, control group: element-wise sum of ``values`` over all ranks, in float64 (sums of
    identical float32 values divide back exactly)."""
    g = dims.group("control")
    if g is None:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    _agree(what, lambda: dist.all_reduce(t, group=g), "all_reduce", g)
    return t.tolist()


def mean_over_ranks(value: float, dims: ParallelDims, what: str) -> float:
    """Host, control group: the mean of ``value`` over all ranks (NaN if any rank's is)."""
    return sum_over_ranks([value], dims, what)[0] / dims.world_size


def broadcast_object(obj: T, dims: ParallelDims, what: str, group=None) -> T:
    """Host, control group (or ``group``, a gloo group): rank 0's picklable ``obj`` on every
    rank."""
    g = _host_group(dims, group)
    if g is None:
        return obj
    box = [obj]
    _agree(what, lambda: dist.broadcast_object_list(box, src=0, group=g), "broadcast_object_list", g)
    return box[0]


def all_gather_object(obj, dims: ParallelDims, what: str, group=None) -> list:
    """Host, control group (or ``group``, a gloo group): every rank's picklable ``obj``, in
    rank order."""
    g = _host_group(dims, group)
    if g is None:
        return [obj]
    out = [None] * dist.get_world_size(g)
    _agree(what, lambda: dist.all_gather_object(out, obj, group=g), "all_gather_object", g)
    return out


def watch_exchange(flags: list[int], group) -> list[int]:
    """Host, ``group`` (the hang watchers' gloo group, from their own thread): the element-wise
    maximum of ``flags`` over its ranks. Not itself noted by hang.py: it is the watchers' own."""
    t = torch.tensor(flags, dtype=torch.int32)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    except RuntimeError as e:
        raise CollectiveError(f"rank {_rank()}: the hang watchers' exchange failed: {first_line(e)}") from e
    return t.tolist()


def barrier(dims: ParallelDims, what: str) -> None:
    """Host, control group: wait for every rank."""
    g = dims.group("control")
    if g is not None:
        _agree(what, lambda: dist.barrier(group=g), "barrier", g)


def all_present(dims: ParallelDims, what: str, timeout: timedelta) -> None:
    """Host, control group: every rank reaches this point within ``timeout``, or rank 0 raises
    naming the ranks that did not (gloo's monitored barrier; the others then lose rank 0)."""
    g = dims.group("control")
    if g is not None:
        _agree(what, lambda: dist.monitored_barrier(group=g, timeout=timeout, wait_all_ranks=True),
               "monitored_barrier", g)


# ---------------------------------------------------------------- device (accelerator groups)

_gloo_groups: dict[object, bool] = {}


def _check_device(x: torch.Tensor, group, name: str) -> None:
    """A host tensor on an NCCL/HCCL group fails deep inside the backend: say what happened."""
    if x.device.type != "cpu" or group is None:
        return
    gloo = _gloo_groups.get(group)
    if gloo is None:
        gloo = _gloo_groups[group] = dist.get_backend(group) == "gloo"
    if not gloo:
        raise CollectiveError(f"{name}: a host (cpu) tensor {tuple(x.shape)} was given to an "
                              f"accelerator group ({dist.get_backend(group)}); it takes device tensors")


def _newest(module, name: str, older: str):
    """torch's current name for a collective (the older one warns of deprecation from torch
    2.10 on), or the older name on the torch releases before it."""
    return getattr(module, name, None) or getattr(module, older)


def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Device, ``group`` (an accelerator group of ParallelDims): in place, returns ``x``."""
    _check_device(x, group, "all_reduce")
    with hang.waiting_in("all_reduce", "a device tensor", group):
        dist.all_reduce(x, op=op, group=group)
    return x


def all_reduce_start(x: torch.Tensor, group) -> Callable[[], torch.Tensor]:
    """``all_reduce`` (sum) begun: returns the wait, after which ``x`` holds the sum. Work done
    before the wait overlaps the transfer; ``x`` must not change until then."""
    _check_device(x, group, "all_reduce")
    work = dist.all_reduce(x, group=group, async_op=True)

    def wait() -> torch.Tensor:
        work.wait()
        return x

    return wait


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group) -> torch.Tensor:
    """Device, ``group``: the ranks' ``x`` concatenated along dim 0 into ``out``."""
    _check_device(x, group, "all_gather")
    with hang.waiting_in("all_gather", "a device tensor", group):
        _newest(dist, "all_gather_single", "all_gather_into_tensor")(out, x, group=group)
    return out


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group) -> torch.Tensor:
    """Device, ``group``: the sum over ranks of ``x``, this rank's dim-0 slice into ``out``."""
    _check_device(x, group, "reduce_scatter")
    with hang.waiting_in("reduce_scatter", "a device tensor", group):
        _newest(dist, "reduce_scatter_single", "reduce_scatter_tensor")(out, x, group=group)
    return out


def all_to_all_into(out: torch.Tensor, x: torch.Tensor, group) -> torch.Tensor:
    """Device, ``group``: dim-0 slice i of ``x`` to rank i; slice i of ``out`` from rank i."""
    _check_device(x, group, "all_to_all_single")
    with hang.waiting_in("all_to_all_single", "a device tensor", group):
        dist.all_to_all_single(out, x, group=group)
    return out


def ring_exchange(x: torch.Tensor, group) -> torch.Tensor:
    """Device, ``group``: send ``x`` to the next rank of ``group`` and receive the previous
    rank's (point to point, as pipeline stages pass activations)."""
    return ring_exchange_start(x, group)()


def ring_exchange_start(x: torch.Tensor, group) -> Callable[[], torch.Tensor]:
    """``ring_exchange`` begun: returns the wait, which gives the previous rank's tensor. Work
    done before the wait overlaps the transfer (ring attention computes its block meanwhile);
    ``x`` must not change until then."""
    _check_device(x, group, "batch_isend_irecv")
    size, me = dist.get_world_size(group), dist.get_rank(group)
    out = torch.empty_like(x)
    # One batch: NCCL deadlocks a send and a receive to the same peer issued one after the
    # other (two ranks both in their send), and HCCL requires them grouped as well.
    requests = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, x, dist.get_global_rank(group, (me + 1) % size), group),
        dist.P2POp(dist.irecv, out, dist.get_global_rank(group, (me - 1) % size), group),
    ])

    def wait() -> torch.Tensor:
        for request in requests:
            request.wait()
        return out

    return wait


def group_members(group) -> list[int]:
    """The global ranks of ``group``."""
    return dist.get_process_group_ranks(group)


def group_size(group) -> int:
    return dist.get_world_size(group)


def group_rank(group) -> int:
    return dist.get_rank(group)
