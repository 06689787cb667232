#!/usr/bin/env python
"""Train a recipe on a Ray cluster with Ray Train: each worker runs pretrain.py's trainer.

usage: python launch/ray_train.py RECIPE.yaml [dotted.key=value ...] --num-workers N
           [--gpu | --hpu] [--address ADDR] [--max-failures K] [--cpus-per-worker C]
           [--report-interval S]

The ranks meet on the node Ray placed the first worker on: at MASTER_ADDR, else
distributed.master_addr, when that is an address of this node (otherwise ignored with a
warning), else at loopback when every worker is on that node, else at the address the node
registered with Ray. With checkpoint.dir and checkpoint.save_on_signal, SIGTERM or SIGUSR1 to
this launcher or to a worker saves a checkpoint at the next step on every rank and ends the run
with status 0; when Ray drains a node of the run (a preemption), every rank saves and training
goes on until Ray restarts the workers elsewhere, from that save. Secret variables (*_API_KEY,
*_TOKEN, *SECRET*, *_PASSWORD) reach the workers through a private file (in TMPDIR, removed at
exit), never through Ray's runtime_env. Ray's records of the run go under checkpoint.dir/ray.
Exit status: 0 when the run finished as asked or was stopped with a save; otherwise non-zero
with a one-line reason (see docs/launch.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str]) -> int:
    head, usage, notes = __doc__.split("\n\n", 2)
    p = argparse.ArgumentParser(usage=usage.strip().removeprefix("usage: "), description=head,
                                epilog=notes, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="the recipe (recipes/NAME.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, as for pretrain.py")
    p.add_argument("--num-workers", type=int, required=True, metavar="N",
                   help="training processes (one per GPU / HPU)")
    device = p.add_mutually_exclusive_group()
    device.add_argument("--gpu", action="store_true", help="train on GPUs (NCCL); default: CPU (gloo)")
    device.add_argument("--hpu", action="store_true", help="train on Gaudi HPUs (HCCL)")
    p.add_argument("--address", metavar="ADDR",
                   help='join this Ray cluster ("auto": the one this node belongs to); default: start '
                        "a cluster of this machine alone, on loopback")
    p.add_argument("--max-failures", type=int, default=0, metavar="K",
                   help="when a worker process or node dies, restart the workers up to K times; each "
                        "restart resumes from the newest checkpoint in checkpoint.dir (default 0)")
    p.add_argument("--cpus-per-worker", type=float, default=1.0, metavar="C",
                   help="CPUs Ray reserves for each worker (default 1)")
    p.add_argument("--report-interval", type=int, metavar="S",
                   help="report to Ray (ray.train.report) the training records of every S-th step "
                        "(default: every record, training.log_interval)")
    args = p.parse_intermixed_args(argv)
    if args.num_workers < 1:
        p.error(f"--num-workers {args.num_workers}: must be at least 1")
    if args.report_interval is not None and args.report_interval < 1:
        p.error(f"--report-interval {args.report_interval}: must be at least 1")
    if args.max_failures < 0:
        p.error(f"--max-failures {args.max_failures}: must be 0 or more")
    if not args.cpus_per_worker > 0:
        p.error(f"--cpus-per-worker {args.cpus_per_worker:g}: must be more than 0")

    from megatron_lite.config import ConfigError, load_config
    from megatron_lite.launch.ray_spec import WorkerSpec, worker_environment
    from megatron_lite.launch.ray_train import RayNotInstalled, RayNotReached, fit

    device = "cuda" if args.gpu else "hpu" if args.hpu else "cpu"
    try:  # the recipe is checked here, before any worker starts
        cfg = load_config(args.recipe, [*args.overrides, f"training.device={device}"])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # The layout for N ranks, before Ray starts. Where the workers land on a cluster is Ray's to
    # decide: checked as one node here (what depends on the nodes is checked again by the ranks).
    from megatron_lite.distributed import ParallelDims, TopologyError

    try:
        ParallelDims.plan(cfg, args.num_workers, local_world_size=args.num_workers)
    except TopologyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.max_failures and not cfg.checkpoint.dir:
        print("warning: --max-failures without checkpoint.dir: a restarted run starts again "
              "from step 0", file=sys.stderr)
    env = worker_environment(device, cfg.training.hpu_mode, dict(os.environ))
    source = "MASTER_ADDR" if os.environ.get("MASTER_ADDR") else "distributed.master_addr"
    spec = WorkerSpec(recipe=os.path.abspath(args.recipe), overrides=args.overrides, device=device,
                      master_addr=os.environ.get("MASTER_ADDR") or cfg.distributed.master_addr,
                      master_addr_source=source, env=env, cwd=os.getcwd(),
                      report_interval=args.report_interval)
    try:
        name = cfg.logging.run_name or Path(cfg.logging.dir).name
        return fit(spec, args.num_workers, cfg.checkpoint.dir, name, address=args.address,
                   max_failures=args.max_failures, cpus_per_worker=args.cpus_per_worker,
                   save_on_signal=bool(cfg.checkpoint.dir) and cfg.checkpoint.save_on_signal)
    except (RayNotInstalled, RayNotReached) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
