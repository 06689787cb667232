"""pretrain.py with ``raise_together`` as it was before the control group: a host tensor
all-reduced on the default process group. Used by test_harness.py to show that the harness
fails this on CPU, as NCCL/HCCL would on the first multi-GPU run.

    torchrun --nproc-per-node 2 tests/distributed/old_raise_together.py RECIPE [overrides]
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_lite.distributed import collectives


def raise_together(error, *_, **__) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        failed = torch.tensor([int(error is not None)])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item() and error is None:
            raise RuntimeError("another rank failed (its error is printed above)")
    if error is not None:
        raise error


collectives.raise_together = raise_together
sys.argv = [str(Path(__file__).resolve().parents[2] / "pretrain.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
