"""What the ranks agree on after each training step, read by the host one step late.

Every step ends with a few numbers all ranks must agree on: the loss averaged over the ranks
that hold one, the global gradient norm, whether the update was applied, and the run control's
flags (a signal, the time limit, the save timer) OR-ed over the ranks. Reading them at once
would make the host wait, every step, until the device has finished the step, and the device
would then idle while the host prepares the next one. Instead they are reduced on the device
(one all-reduce over the ``world`` group, queued behind the step's own work), copied into host
memory without waiting, and read once the next step has been queued, by which time the copy has
landed: the host never waits for more than the step before.

A non-finite loss or gradient norm must still never be applied, and that cannot wait for the
host: torch's fused AdamW skips its whole update (moments and step count included) when its
``found_inf`` tensor is set on the device, the mechanism GradScaler uses, so the device decides
and the host learns one step later that the update was skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_lite.distributed import collectives
from megatron_lite.distributed.parallel_dims import ParallelDims


def skips_on_device(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` skips an update on the device when its ``found_inf`` is set: torch's fused
    Adam and AdamW (torch 2.4 and later, CPU and CUDA)."""
    return isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) and bool(opt.defaults.get("fused"))


@dataclass(frozen=True)
class StepReport:
    loss: float
    """Mean micro-batch loss over the ranks holding one; NaN or Inf when any rank's is."""
    grad_norm: float | None
    """The global gradient norm (Inf when not finite), or None where none was computed."""
    applied: bool
    """Whether the update was applied (false: the device skipped a non-finite one)."""
    flags: tuple[bool, ...]
    """The run control's flags, each OR-ed over all ranks."""


class PendingReport:
    """One step's report on its way to the host."""

    def __init__(self, host: torch.Tensor, event, grad_accum: int, n_flags: int):
        self.host, self.event, self.grad_accum, self.n_flags = host, event, grad_accum, n_flags
        self.done = False

    def discard(self) -> None:
        """The step was rolled back: wait for the copy (its buffers are reused), read nothing."""
        if self.event is not None:
            self.event.synchronize()
        self.done = True

    def read(self) -> StepReport:
        """Wait for the copy (not for the work queued after it) and decode it."""
        if self.event is not None:
            self.event.synchronize()
        self.done = True
        loss_total, holders, *flags, norm, has_norm, found = self.host.tolist()
        return StepReport(loss=loss_total / max(holders, 1.0) / self.grad_accum,
                          grad_norm=norm if has_norm else None, applied=not found,
                          flags=tuple(f > 0 for f in flags))


class StepReporter:
    """Builds each step's report on the device (``start``) and tells the optimizer whether to
    skip the update."""

    def __init__(self, dims: ParallelDims, acc, device: torch.device, grad_accum: int, n_flags: int,
                 must_read: bool = False):
        """``must_read``: every report is read (the trainer); else a report nobody read is waited
        for and dropped when its buffers come round again (a benchmark's steps)."""
        self.group = dims.group("world")
        self.acc, self.device, self.grad_accum, self.n_flags = acc, device, grad_accum, n_flags
        self.must_read = must_read
        on_accelerator = device.type != "cpu" and acc is not None
        pin = acc.pin_memory if on_accelerator else (lambda t: t)
        # Two of each: the trainer reads a report one step late, so two are in flight at most;
        # a buffer or event is used again only once its report was read (or dropped).
        # float64: the sum of identical float32 losses divides back to the same value.
        self._flags_in = [pin(torch.zeros(max(n_flags, 1), dtype=torch.float64)) for _ in range(2)]
        self._out = [pin(torch.zeros(n_flags + 5, dtype=torch.float64)) for _ in range(2)]
        self._events = [acc.Event() for _ in range(2)] if on_accelerator and acc.Event is not None else None
        self._reports: list[PendingReport | None] = [None, None]
        self._turn = 0

    def start(self, loss_sum: torch.Tensor | None, grad_norm,
              flags: list[bool]) -> tuple[PendingReport, torch.Tensor]:
        """Queue the report of this step: ``loss_sum`` (this rank's summed micro-batch losses, a
        device scalar, or None on a rank without one), ``grad_norm`` (a device scalar, a float,
        or None), the run control's ``flags`` (host). Returns the report and the device's
        verdict, a float32 scalar on the device: 1 where the update must be skipped."""
        turn, self._turn = self._turn, 1 - self._turn
        previous = self._reports[turn]
        if previous is not None and not previous.done:
            if self.must_read:
                raise RuntimeError("a step report was not read before its buffers came round again")
            previous.discard()
        dev, f64 = self.device, torch.float64
        zero = torch.zeros((), device=dev, dtype=f64)
        local = loss_sum.detach().to(f64).reshape(()) if loss_sum is not None else zero
        holds = torch.ones((), device=dev, dtype=f64) if loss_sum is not None else zero
        parts = [local, holds]
        if self.n_flags:
            # The flags travel from pinned host memory without a host wait (a pageable copy
            # would wait for the device's queue).
            host_flags = self._flags_in[turn]
            host_flags.copy_(torch.tensor([float(f) for f in flags], dtype=f64))
            parts.append(host_flags.to(dev, non_blocking=True))
        agreed = torch.cat([p.reshape(-1) for p in parts])
        if self.group is not None:  # None: one process without torch.distributed (unit tests)
            collectives.all_reduce(agreed, self.group)
        if grad_norm is None:
            norm, has_norm = zero, zero
        else:
            # (A float is filled on the device: a copy from pageable memory would wait for it.)
            norm = grad_norm.detach().to(f64).reshape(()) if isinstance(grad_norm, torch.Tensor) \
                else torch.full((), float(grad_norm), device=dev, dtype=f64)
            has_norm = torch.ones((), device=dev, dtype=f64)
            # ZeRO reports a non-finite norm as -1 where it does not skip the step itself (bf16).
            norm = torch.where(norm < 0, torch.full_like(norm, float("inf")), norm)
        skip = (~torch.isfinite(agreed[0]) | ~torch.isfinite(norm)).to(f64)
        packet = torch.cat([agreed, torch.stack([norm, has_norm, skip])])
        out = self._out[turn]
        out.copy_(packet, non_blocking=self._events is not None)
        event = None
        if self._events is not None:
            event = self._events[turn]
            event.record()
        report = PendingReport(out, event, self.grad_accum, self.n_flags)
        self._reports[turn] = report
        return report, skip.float()  # fused AdamW's found_inf is a float32 scalar
