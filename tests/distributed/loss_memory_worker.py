"""One training step of a small Llama with Llama 3's vocabulary (128,256 ids), whose memory is
dominated by the output layer and loss; writes the host memory the step allocated at its peak
(torch's profiler, "Total Allocated") on the rank that holds the output layer, and what that
rank ran (its pipeline stage and blocks), to OUT.

    python tests/distributed/loss_memory_worker.py OUT                      # one process
    python -m torch.distributed.run --nproc-per-node 2 \
        tests/distributed/loss_memory_worker.py OUT parallel.pipeline=2     # its last stage
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from megatron_lite.config import load_config
from megatron_lite.distributed import detect, init_distributed
from megatron_lite.distributed.startup import shutdown_distributed
from megatron_lite.training.build import build

REPO = Path(__file__).resolve().parents[2]
VOCAB = 128_256
SETTINGS = ["model.n_layers=2", "model.n_heads=2", "model.d_model=32", "model.vocab_multiple=1",
            "model.position=rope", "model.norm=rmsnorm", "model.activation=swiglu", "model.bias=false",
            "model.tie_embeddings=false", "data.seq_length=256", "training.micro_batch_size=4",
            "training.global_batch_size=4", "training.iters=2", "schedule.warmup_iters=0"]


def peak_allocated(trace: Path) -> int:
    events = json.loads(trace.read_text())["traceEvents"]
    return max((e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"), default=0)


def main() -> None:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    cfg = load_config(REPO / "recipes/shakespeare-char.yaml", [*SETTINGS, *overrides])
    dims, acc = init_distributed(cfg, detect())
    parts = build(cfg, dims, acc, VOCAB, 2)
    runner, device = parts.step_runner(), parts.device
    data = torch.randint(0, VOCAB, (8, cfg.data.seq_length + 1), generator=torch.Generator().manual_seed(0))
    runner.train_step(iter([data[:4]]), device)  # optimizer state and buffers exist from here on
    trace = out / f"trace{dims.rank}.json"
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        runner.train_step(iter([data[4:]]), device)
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    if dims.pp_rank == dims.pipeline - 1 and dims.tp_rank == 0 and dims.dp_rank == 0:
        from tests.distributed.layout_worker import what_ran

        (out / "peak.json").write_text(json.dumps({"bytes": peak_allocated(trace),
                                                   "ran": what_ran(parts.engine, dims)}))
    trace.unlink()
    shutdown_distributed(dims)


if __name__ == "__main__":
    from megatron_lite.training.entry import exit_process

    main()
    exit_process(0)  # as pretrain.py: no interpreter finalization after the groups are gone
