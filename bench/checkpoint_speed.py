#!/usr/bin/env python
"""Checkpoint save and load speed, and how long training is blocked: sync vs async save.

GPT-2 124M (fp32 weights + Adam moments: ~1.5 GB per checkpoint) in one process on the CPU or,
with ``--device cuda``, on one GPU (there the async save's blocked time is the device-to-host
copy into pinned buffers on a side stream), after one training step so the optimizer state
exists. In the same invocation: a synchronous save (the
step is blocked for all of it), an asynchronous save (blocked only while the state is copied to
host memory; the rest is timed until the background write commits) and a load. Prints seconds,
MB/s and the ratio of blocked time async / sync.

    python bench/checkpoint_speed.py [--dir /tmp/ckbench] [--rounds 2] [--device cuda --precision bf16]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "hpu"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    a = p.parse_args()

    import torch

    from megatron_lite.checkpoint import Checkpointer
    from megatron_lite.config import load_config
    from megatron_lite.distributed import detect, init_distributed
    from megatron_lite.training.build import build

    root = Path(a.dir or tempfile.mkdtemp(prefix="ckbench-"))
    cfg = load_config(REPO / "recipes/gpt2-124m.yaml", [
        "model.vocab_size=50304", "data.seq_length=128", "training.micro_batch_size=1",
        "training.global_batch_size=1", f"training.precision={a.precision}", f"training.device={a.device}",
        "parallel.zero_stage=0", "training.iters=10", "training.train_tokens=null",
        f"checkpoint.dir={root}", "checkpoint.keep_last=0"])
    dims, acc = init_distributed(cfg, detect())
    parts = build(cfg, dims, acc, None, 10)
    model_cfg, engine, runner = parts.model_cfg, parts.engine, parts.step_runner()
    params = sum(p.numel() for p in engine.module.parameters())
    batch = torch.randint(0, 50257, (1, cfg.data.seq_length + 1))
    device = torch.device(acc.current_device_name())
    runner.train_step(iter([batch]), device)
    ck = Checkpointer(cfg, dims, acc, engine, model_cfg, lambda msg: None)

    def size(step: int) -> int:
        return sum(f.stat().st_size for f in (root / f"step_{step:08d}").iterdir())

    print(f"model: {params / 1e6:.1f}M parameters on {device} ({a.precision}); writing to {root}")
    sync_blocked, async_blocked, loads = [], [], []
    step = 0
    for _ in range(a.rounds):
        step += 1
        t = time.perf_counter()
        ck.save(step, step)
        sync_blocked.append(time.perf_counter() - t)
        mb = size(step) / 1e6
        rate = mb / sync_blocked[-1]
        print(f"sync save : {sync_blocked[-1]:6.2f} s blocked ({rate:.0f} MB/s, {mb:.0f} MB)")
        step += 1
        t = time.perf_counter()
        ck.save(step, step, background=True)
        async_blocked.append(time.perf_counter() - t)
        runner.train_step(iter([batch]), device)  # training goes on meanwhile
        ck.wait()
        total = time.perf_counter() - t
        print(f"async save: {async_blocked[-1]:6.2f} s blocked, committed after {total:.2f} s "
              f"(incl. one training step)")
        t = time.perf_counter()
        ck.load()
        loads.append(time.perf_counter() - t)
        print(f"load      : {loads[-1]:6.2f} s ({size(step) / 1e6 / loads[-1]:.0f} MB/s, verified)")
    ratio = min(async_blocked) / min(sync_blocked)
    print(f"blocked time async / sync (best of {a.rounds}): {ratio:.2f}")
    if a.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
