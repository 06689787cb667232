"""tools/check_dist.py with one rank given a wrong group: after the groups are created, rank 1
swaps its tensor-parallel and data-parallel groups (what a layout bug on one rank looks like).
Used by test_check_dist.py."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from megatron_lite.distributed.parallel_dims import ParallelDims

create = ParallelDims.create_groups


def create_wrong_on_rank_1(self, *args) -> None:
    create(self, *args)
    if self.rank == 1:
        self.groups["tensor"], self.groups["data"] = self.groups["data"], self.groups["tensor"]


ParallelDims.create_groups = create_wrong_on_rank_1
sys.argv = [str(Path(__file__).resolve().parents[2] / "tools/check_dist.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
