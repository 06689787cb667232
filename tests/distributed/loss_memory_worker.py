"""One training step of a small Llama with Llama 3's vocabulary (128,256 ids), whose memory is
dominated by the output layer and loss; writes the host memory the step allocated at its peak
(torch's profiler, "Total Allocated", counted from the step's start) on the first rank that
holds the output layer, and what that rank ran (its pipeline stage and blocks), to OUT.
``vocab=N`` takes another vocabulary.

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
    """The peak of what the profiled step allocated (the profiler counts from its start)."""
    events = json.loads(trace.read_text())["traceEvents"]
    return max((e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"), default=0)


def main() -> None:
    out, overrides = Path(sys.argv[1]), [a for a in sys.argv[2:] if not a.startswith("vocab=")]
    vocab = next((int(a.split("=")[1]) for a in sys.argv[2:] if a.startswith("vocab=")), VOCAB)
    cfg = load_config(REPO / "recipes/shakespeare-char.yaml", [*SETTINGS, *overrides])
    dims, acc = init_distributed(cfg, detect())
    parts = build(cfg, dims, acc, vocab, 2)
    runner, device = parts.step_runner(), parts.device
    micro = cfg.training.micro_batch_size
    data = torch.randint(0, vocab, (2 * micro, cfg.data.seq_length + 1),
                         generator=torch.Generator().manual_seed(0))
    runner.train_step(iter([data[:micro]]), device)  # optimizer state and buffers exist from here on
    trace = out / f"trace{dims.rank}.json"
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        runner.train_step(iter([data[micro:]]), device)
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    first = dims.tp_rank == 0 and dims.dp_rank == 0 and dims.sequence_rank == 0
    if dims.pp_rank == dims.pipeline - 1 and first:
        from tests.distributed.layout_worker import what_ran

        (out / "peak.json").write_text(json.dumps({"bytes": peak_allocated(trace),
                                                   "ran": what_ran(parts.engine, dims)}))
    trace.unlink()
    shutdown_distributed(dims)


if __name__ == "__main__":
    from megatron_lite.training.entry import exit_process

    main()
    exit_process(0)  # as pretrain.py: no interpreter finalization after the groups are gone
