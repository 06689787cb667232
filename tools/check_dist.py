#!/usr/bin/env python
"""Check a new allocation before training on it: every rank, every process group, every
collective the run will use.

usage (one process per device, like pretrain.py):
  torchrun --nproc-per-node 4 tools/check_dist.py [RECIPE.yaml [dotted.key=value ...]] [options]
  mpiexec -n 8 -ppn 4 python tools/check_dist.py ...          (Cray PALS or MPICH Hydra)
  deepspeed --num_gpus 4 tools/check_dist.py ...
  CHECK=1 launch/polaris.sh [RECIPE [overrides]]               (inside a PBS job)

  RECIPE.yaml        the parallel layout to build (default: data parallel over all ranks)
  --size-mb N        message size per collective and rank (default 64; 1 on a CPU)
  --iters K          timed repetitions per collective (default 5)
  --timeout-s S      how long a rank may be missing or a collective may take (default 120)

What it does, in order: prints each rank's host, local rank, device and the launcher / NCCL /
OFI / HCCL environment; builds the recipe's process groups as pretrain.py does; checks that
every rank agrees on the members of every group; then, on each group, runs all-reduce,
all-gather, reduce-scatter and all-to-all (accelerator groups with device tensors, the gloo
control groups with host tensors) and a point-to-point exchange around each pipeline group,
checks every result, and prints the bus bandwidth per group (nccl-tests' definition) and a
per-rank table. Exit status 0 when everything passed; otherwise 1, with a line naming the rank
and the group that failed, disagreed or did not answer in time.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron_lite.config import load_config  # noqa: E402
from megatron_lite.config.load import build_config, parse_overrides  # noqa: E402
from megatron_lite.distributed import collectives, detect, init_distributed  # noqa: E402
from megatron_lite.distributed.collectives import CollectiveError  # noqa: E402
from megatron_lite.distributed.parallel_dims import (  # noqa: E402
    AXES,
    GROUP_AXES,
    HOST_GROUPS,
    ParallelDims,
    TopologyError,
)
from megatron_lite.distributed.startup import abandon_distributed, shutdown_distributed  # noqa: E402

# Environment that decides how the ranks find each other and which network the collectives use.
ENV_PREFIXES = ("NCCL_", "FI_", "OFI_", "HCCL_", "HABANA_", "PT_HPU", "CUDA_VISIBLE", "MASTER_",
                "PALS_", "PMI_", "OMPI_COMM_WORLD_LOCAL", "SLURM_LOCALID", "LOCAL_", "DS_ACCELERATOR",
                "OMP_NUM_THREADS", "CUDA_DEVICE_MAX_CONNECTIONS")
DEFAULT_LAYOUT = ["data.prefix=unused", "data.tokenizer.model=unused", "training.iters=1"]
# nccl-tests' bus bandwidth: the bytes each rank's link carries relative to the message size.
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
              "send_recv": lambda n: 1.0}


class CheckFailed(RuntimeError):
    pass


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="check_dist.py", add_help=False)
    parser.add_argument("args", nargs="*", help="RECIPE.yaml and dotted.key=value overrides")
    parser.add_argument("--size-mb", type=float, default=None,
                        help="message size per collective and rank (default 64; 1 on a CPU)")
    parser.add_argument("--iters", type=int, default=5, help="timed repetitions per collective")
    parser.add_argument("--timeout-s", type=float, default=120.0,
                        help="how long a rank may be missing or a collective may take")
    # The DeepSpeed launcher (and torch.distributed.launch) pass the local rank as an option;
    # detect() reads it from the environment.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_intermixed_args(argv)
    for name, value in (("--size-mb", args.size_mb), ("--timeout-s", args.timeout_s)):
        if value is not None and not value > 0:
            parser.error(f"{name} {value:g}: must be more than 0")
    if args.iters < 1:
        parser.error(f"--iters {args.iters}: must be at least 1")
    return args


def build_cfg(args: list[str], timeout_s: float):
    # Batch sizes do not matter here: the global batch follows the data-parallel size.
    forced = [f"distributed.timeout_minutes={timeout_s / 60}", "training.global_batch_size=null"]
    if args and args[0].endswith((".yaml", ".yml")):
        return load_config(args[0], [*args[1:], *forced])
    return build_config(parse_overrides([*DEFAULT_LAYOUT, *args, *forced]))


def rank_info(env, acc) -> dict:
    device = acc.current_device_name()
    name = device
    if acc.device_name() != "cpu":
        from megatron_lite.distributed.device import device_name

        name = f"{device} ({device_name(acc)})"
    return {"rank": env.rank, "host": socket.gethostname(), "local_rank": env.local_rank,
            "launcher": env.launcher, "device": name, "pid": os.getpid(),
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}}


def expected_members(dims: ParallelDims, name: str, rank: int) -> list[int]:
    if name in HOST_GROUPS:
        return list(range(dims.world_size))
    if name == "embedding":  # the first and last stage of the rank's pipeline
        ranks = next(g for g in dims.group_ranks(("pipeline",)) if rank in g)
        return [ranks[0], ranks[-1]]
    if name in ("shard", "replica"):  # HSDP's
        shards, replicas = dims.hsdp_group_ranks()
        return next(sorted(g) for g in (shards if name == "shard" else replicas) if rank in g)
    return next(g for g in dims.group_ranks(GROUP_AXES[name]) if rank in g)


def check_members(dims: ParallelDims) -> None:
    """Every rank's view of every group against the layout and against the other members'."""
    mine = {name: collectives.group_members(g) for name, g in dims.groups.items()}
    views = collectives.all_gather_object(mine, dims, "the group membership check")
    problems = []
    for rank, view in enumerate(views):
        for name, members in view.items():
            want = expected_members(dims, name, rank)
            if members != want:
                problems.append(f"rank {rank}: group '{name}' has ranks {members}, the layout says {want}")
            for other in members:
                if views[other].get(name) != members:
                    problems.append(f"rank {rank} and rank {other} disagree on group '{name}': "
                                    f"{members} vs {views[other].get(name)}")
    problems = collectives.broadcast_object(problems, dims, "the group membership verdict")
    if problems:
        raise CheckFailed("process groups do not match:\n  " + "\n  ".join(dict.fromkeys(problems)))


def run_op(op: str, group, device: torch.device, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One collective on ``group``: (output, expected output). Ranks put known values in."""
    n, me = collectives.group_size(group), collectives.group_rank(group)
    members = collectives.group_members(group)
    chunk = max(numel // n, 1)
    if op == "all_reduce":
        x = torch.full((chunk * n,), float(members[me] + 1), device=device)
        return collectives.all_reduce(x, group), torch.full_like(x, float(sum(m + 1 for m in members)))
    if op == "all_gather":
        x = torch.full((chunk,), float(members[me] + 1), device=device)
        out = torch.empty(chunk * n, device=device)
        want = torch.cat([torch.full((chunk,), float(m + 1), device=device) for m in members])
        return collectives.all_gather_into(out, x, group), want
    if op == "reduce_scatter":
        x = torch.arange(chunk * n, dtype=torch.float32, device=device) + members[me]
        out = torch.empty(chunk, device=device)
        want = (torch.arange(chunk * n, dtype=torch.float32, device=device) * n + sum(members))
        return collectives.reduce_scatter_into(out, x, group), want[me * chunk:(me + 1) * chunk]
    if op == "all_to_all":
        # Slice j of rank i's input holds 1000·i + j: rank j must get 1000·i + j from each i.
        x = torch.cat([torch.full((chunk,), 1000.0 * me + j, device=device) for j in range(n)])
        out = torch.empty_like(x)
        want = torch.cat([torch.full((chunk,), 1000.0 * i + me, device=device) for i in range(n)])
        return collectives.all_to_all_into(out, x, group), want
    if op == "send_recv":
        x = torch.full((chunk * n,), float(members[me] + 1), device=device)
        return collectives.ring_exchange(x, group), torch.full_like(x, float(members[(me - 1) % n] + 1))
    raise ValueError(op)


def ops_for(name: str) -> list[str]:
    if name in HOST_GROUPS:  # what host control uses
        return ["all_reduce", "all_gather"]
    ops = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
    return [*ops, "send_recv"] if name == "pipeline" else ops


def check_groups(dims: ParallelDims, acc, numel: int, iters: int, timeout: timedelta) -> list[dict]:
    rows = []
    for name in sorted(dims.groups):
        group = dims.groups[name]
        size = collectives.group_size(group)
        host = name in HOST_GROUPS
        device = torch.device("cpu") if host else torch.device(acc.current_device_name())
        for op in ops_for(name):
            if size == 1 and op != "all_reduce":
                continue
            all_present(dims, f"{op} on group '{name}'", timeout)
            error, seconds = None, 0.0
            try:
                out, want = run_op(op, group, device, numel)  # warm-up and correctness
                if not torch.equal(out, want):
                    error = f"wrong result: {out[:4].tolist()}... expected {want[:4].tolist()}..."
                sync = (lambda: None) if host else acc.synchronize
                sync()
                start = time.perf_counter()
                for _ in range(iters):
                    run_op(op, group, device, numel)
                sync()
                seconds = (time.perf_counter() - start) / iters
            except (CollectiveError, RuntimeError) as e:
                error = f"{type(e).__name__}: {collectives.first_line(e)}"
            nbytes = max(numel // size, 1) * size * 4
            rows.append({"rank": dims.rank, "group": name, "members": collectives.group_members(group),
                         "op": op, "bytes": nbytes, "seconds": seconds, "error": error,
                         "busbw": BUS_FACTOR[op](size) * nbytes / seconds / 1e9 if seconds else 0.0})
            failed = [r for r in collectives.all_gather_object(rows[-1], dims, "the collective results")
                      if r["error"]]
            if failed:
                raise CheckFailed("; ".join(f"rank {r['rank']}: {r['op']} on group '{r['group']}' "
                                            f"(ranks {r['members']}): {r['error']}" for r in failed))
    return rows


def all_present(dims: ParallelDims, before: str, timeout: timedelta) -> None:
    """Every rank is here before the next collective, or the missing ranks are named."""
    try:
        collectives.all_present(dims, f"waiting for every rank before {before}", timeout)
    except CollectiveError as e:
        raise CheckFailed(f"{e} (a rank stopped, hung, or is slower than --timeout-s)") from None


def report(dims: ParallelDims, infos: list[dict], rows: list[dict]) -> None:
    print(f"{'rank':>4}  {'host':<24} {'local':>5}  {'launcher':<9} {'pid':>7}  device")
    for i in infos:
        print(f"{i['rank']:>4}  {i['host']:<24} {i['local_rank']:>5}  {i['launcher']:<9} {i['pid']:>7}  "
              f"{i['device']}")
    print("\nenvironment (rank 0; ranks whose values differ are listed):")
    for key, value in infos[0]["env"].items():
        others = [i["rank"] for i in infos if i["env"].get(key) != value]
        print(f"  {key}={value}" + (f"   (differs on ranks {others})" if others else ""))
    extra = sorted({k for i in infos for k in i["env"]} - set(infos[0]["env"]))
    for key in extra:
        print(f"  {key} set on ranks {[i['rank'] for i in infos if key in i['env']]} only")
    print(f"\n{'group':<14} {'ranks':<20} {'op':<15} {'MB':>8} {'ms':>9} {'busbw GB/s':>11}")
    slowest: dict[tuple, dict] = {}
    for r in rows:
        key = (r["group"], tuple(r["members"]), r["op"])
        if key not in slowest or r["seconds"] > slowest[key]["seconds"]:
            slowest[key] = r
    single = sorted({group for group, members, _ in slowest if len(members) == 1})
    for (group, members, op), r in sorted(slowest.items()):
        if len(members) == 1:
            continue
        ranks = str(list(members)) if len(members) <= 6 else f"[{members[0]}..{members[-1]}] ({len(members)})"
        print(f"{group:<14} {ranks:<20} {op:<15} {r['bytes'] / 1e6:>8.2f} {1e3 * r['seconds']:>9.3f} "
              f"{r['busbw']:>11.2f}")
    if single:
        print(f"groups of one rank (created and checked, no traffic): {', '.join(single)}")


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(__doc__.strip())
        return 0
    options = parse(argv)
    try:  # before any rank waits for another: a bad recipe is a usage error (status 2), as in pretrain.py
        cfg = build_cfg(options.args, options.timeout_s)
    except ValueError as e:  # ConfigError is one
        print(f"check_dist: {e}", file=sys.stderr)
        return 2
    env = detect()
    print(f"check_dist: rank {env.rank}/{env.world_size} on {socket.gethostname()} (local rank "
          f"{env.local_rank}, launcher {env.launcher}, pid {os.getpid()}) starting", flush=True)
    timeout = timedelta(seconds=options.timeout_s)
    try:
        dims, acc = init_distributed(cfg, env)
        size_mb = options.size_mb if options.size_mb is not None else (
            64 if acc.device_name() != "cpu" else 1)
        numel = int(size_mb * 2**20 / 4)
        all_present(dims, "the checks", timeout)
        infos = collectives.all_gather_object(rank_info(env, acc), dims, "the rank table")
        layout = " × ".join(f"{a} {dims.size(a)}" for a in AXES)
        if dims.is_main:
            print(f"check_dist: {dims.world_size} ranks up; layout {layout}", flush=True)
        check_members(dims)
        rows = check_groups(dims, acc, numel, options.iters, timeout)
        results = collectives.all_gather_object(rows, dims, "the bandwidth table")
        if dims.is_main:
            report(dims, infos, [r for per_rank in results for r in per_rank])
            print(f"\ncheck_dist: OK ({dims.world_size} ranks, {len(dims.groups)} groups per rank)")
        # Every rank waits for the others, then the groups are torn down in order: left to
        # interpreter exit, gloo's threads can abort a rank after "OK" (seen under load).
        shutdown_distributed(dims)
    except (CheckFailed, CollectiveError, TopologyError, ValueError) as e:
        print(f"check_dist: FAILED on rank {env.rank} ({socket.gethostname()}): {e}", file=sys.stderr,
              flush=True)
        abandon_distributed()
        return 1
    return 0


if __name__ == "__main__":
    from megatron_lite.training.entry import exit_process

    exit_process(main(sys.argv[1:]))  # as pretrain.py (see exit_process)
