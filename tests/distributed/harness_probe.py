"""Run by test_harness.py on 2 ranks: what the harness refuses and what it lets through.
Writes OUT/rank{R}.json: {case: "ok" | error message}."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_lite.config import load_config
from megatron_lite.distributed import collectives, detect, init_distributed
from megatron_lite.distributed.startup import shutdown_distributed

REPO = Path(__file__).resolve().parents[2]


def attempt(fn) -> str:
    try:
        fn()
        return "ok"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def main() -> None:
    cfg = load_config(REPO / "recipes/shakespeare-char.yaml", ["distributed.timeout_minutes=1",
                                                                         "training.global_batch_size=null"])
    dims, _ = init_distributed(cfg, detect())
    device_group = dims.group("data")
    cases = {
        "host tensor, default group": lambda: dist.all_reduce(torch.zeros(1)),
        "object, default group": lambda: dist.broadcast_object_list([1], src=0),
        "object, accelerator group": lambda: dist.broadcast_object_list([1], src=0, group=device_group),
        "device helper, default group": lambda: collectives.all_reduce(torch.zeros(1), dist.group.WORLD),
        # What oneCCL (Aurora) refuses and gloo takes, on an accelerator group.
        "oneccl: AVG": lambda: collectives.all_reduce(torch.ones(2), device_group, op=dist.ReduceOp.AVG),
        "oneccl: BOR": lambda: collectives.all_reduce(torch.ones(2, dtype=torch.int32), device_group,
                                                      op=dist.ReduceOp.BOR),
        "oneccl: int16": lambda: collectives.all_reduce(torch.ones(2, dtype=torch.int16), device_group),
        "oneccl: split_group": lambda: dist.split_group(split_ranks=[[0], [1]]),
        "oneccl: MAX of int32": lambda: collectives.all_reduce(torch.ones(2, dtype=torch.int32), device_group,
                                                               op=dist.ReduceOp.MAX),
        # What the project does: host control on gloo, device tensors on accelerator groups.
        "control: any_rank": lambda: collectives.any_rank([dims.rank == 1], dims),
        "control: broadcast_object": lambda: collectives.broadcast_object("x", dims, "probe"),
        "control: raise_together": lambda: collectives.raise_together(None, dims),
        "device: all_reduce": lambda: collectives.all_reduce(torch.ones(2), device_group),
        "device: ring_exchange": lambda: collectives.ring_exchange(torch.ones(2), device_group),
        # What deadlocks NCCL on a 2-rank group: a send, then a blocking receive from the peer.
        "p2p, unbatched": lambda: dist.isend(torch.ones(2), 1 - dims.rank, group=device_group),
    }
    results = {name: attempt(fn) for name, fn in cases.items()}
    results["any_rank value"] = collectives.any_rank([dims.rank == 1], dims)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{dims.rank}.json").write_text(json.dumps(results))
    # Every rank done before any tears its groups down (one rank's teardown under a peer still
    # in gloo can abort that peer), as shutdown_distributed does for a run.
    shutdown_distributed(dims)


if __name__ == "__main__":
    from megatron_lite.training.entry import exit_process

    main()
    exit_process(0)  # as pretrain.py: no interpreter finalization after the groups are gone
