"""Builds a DeepSpeed engine of each kind the project runs (ZeRO 0 in fp32 and bf16, ZeRO 1,
ZeRO 3, the pipeline engine in fp32 and bf16), steps each once, and checks every ``built`` entry
of ``RELIED_ON`` (engine/internals.py) on those real objects; rank 0 writes the entries it did
not find to OUT as JSON, with the optimizer class of each kind. Run by test_relied_on.py with two
processes; WHERE NAME pairs after OUT are checked as well (the test's own missing name):

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/relied_on_worker.py OUT \
        ["built fp32.engine" no_such_name]
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch

from megatron_lite.config import load_config
from megatron_lite.distributed import ParallelDims, detect, init_distributed
from megatron_lite.distributed.startup import shutdown_distributed
from megatron_lite.engine.initialize import partitioned_init
from megatron_lite.engine.internals import RELIED_ON
from megatron_lite.training.build import build

REPO = Path(__file__).resolve().parents[2]
VOCAB = 64
COMMON = ["model.n_layers=2", "model.n_heads=2", "model.d_model=32", "model.vocab_multiple=1",
          "data.seq_length=16", "training.micro_batch_size=2", "training.global_batch_size=4",
          "training.iters=2"]
KINDS = {
    "fp32": [],
    "bf16": ["training.precision=bf16"],
    "zero1": ["parallel.zero_stage=1"],
    "zero3": ["parallel.zero_stage=3"],
    "pipe": ["parallel.pipeline=2"],
    "pipe_bf16": ["parallel.pipeline=2", "training.precision=bf16"],
}


def built(overrides: list[str], first: bool, env, acc) -> tuple[SimpleNamespace, ParallelDims, object]:
    """One engine of the kind ``overrides`` give, stepped once: its engine, first parameter,
    scheduler and (ZeRO 3) the ``zero.Init`` that partitioned it; its layout; the accelerator."""
    cfg = load_config(REPO / "recipes/shakespeare-char.yaml", [*COMMON, *overrides])
    if first:
        dims, acc = init_distributed(cfg, env)
    else:
        dims = ParallelDims.plan(cfg, env.world_size, env.rank, env.local_rank, env.local_world_size)
        dims.create_groups(timedelta(minutes=cfg.distributed.timeout_minutes))
    init = partitioned_init(cfg, dims)[0]
    parts = build(cfg, dims, acc, VOCAB, 2)
    data = torch.randint(0, VOCAB, (dims.global_batch(cfg), cfg.data.seq_length + 1),
                         generator=torch.Generator().manual_seed(0))
    mine = data[dims.dp_rank::dims.data].split(cfg.training.micro_batch_size)
    parts.step_runner().train_step(iter(mine), parts.device)
    engine = parts.engine
    return SimpleNamespace(engine=engine, param=next(iter(engine.module.parameters())),
                           scheduler=engine.lr_scheduler, init=init.args[0] if init else None), dims, acc


def missing(roots: dict[str, SimpleNamespace | None], entries) -> list[str]:
    """The ``built`` entries whose object lacks the name (none is looked for on a root this
    release does not build)."""
    out = []
    for where, name in entries:
        if not where.startswith("built "):
            continue
        root, *path = where.split(" ", 1)[1].split(".")
        obj = roots[root]
        if obj is None:
            continue
        try:
            for part in path:
                obj = getattr(obj, part)
        except AttributeError as e:
            out.append(f"{where} (not reached: {e})")
            continue
        if not hasattr(obj, name):
            out.append(f"{where}: no '{name}'")
    return out


def main() -> None:
    out, extra = Path(sys.argv[1]), sys.argv[2:]
    env, acc, first = detect(), None, None
    roots: dict[str, SimpleNamespace | None] = {}
    for kind, overrides in KINDS.items():
        roots[kind], dims, acc = built(overrides, first is None, env, acc)
        first = first or dims
    optimizers = {k: type(r.engine.optimizer).__name__ for k, r in roots.items()}
    # bf16 at ZeRO 0: FP16_UnfusedOptimizer in newer releases, BF16_Optimizer in 0.16.
    roots["unfused"] = roots["bf16"] if optimizers["bf16"] == "FP16_UnfusedOptimizer" else None
    # The bf16 optimizer clears its gradients when a backward starts from 0.18.3, not before.
    prologue = hasattr(roots["pipe_bf16"].engine.optimizer, "backward_prologue")
    roots["pipe_bf16_prologue"] = roots["pipe_bf16"] if prologue else None
    entries = [*RELIED_ON, *zip(extra[::2], extra[1::2], strict=True)]
    report = {"missing": missing(roots, entries), "optimizers": optimizers,
              "not_built": [k for k, r in roots.items() if r is None]}
    if env.rank == 0:
        out.write_text(json.dumps(report))
    shutdown_distributed(first)


if __name__ == "__main__":
    main()
