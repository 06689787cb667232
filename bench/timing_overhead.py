#!/usr/bin/env python
"""What the training records' timings cost: the step with them against the step without.

    DS_ACCELERATOR=cpu python bench/timing_overhead.py recipes/shakespeare-char.yaml [overrides]
        [--steps 50] [--rounds 10]

"with": the trainer's step as it runs in ``pretrain.py``: the phase clock marks every phase of
every micro-batch (device events on accelerators), the interval clock counts the step, and
every ``training.log_interval`` steps the record's extra work is done (reading the phase
clock, device memory, host RSS, the slowdown rule). "without": the same step with a clock
that does nothing. Rounds alternate in one process on the same engine and data stream;
the ratio is the median over rounds of with / without (1.01 = 1% slower).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.distributed import device as devmod  # noqa: E402

devmod.cpu_unless_accelerator()

from megatron_lite.config import load_config  # noqa: E402
from megatron_lite.data.build import ensure_dataset  # noqa: E402
from megatron_lite.data.source import build_data  # noqa: E402
from megatron_lite.distributed import detect, init_distributed  # noqa: E402
from megatron_lite.logging import MetricsLogger  # noqa: E402
from megatron_lite.training.build import build  # noqa: E402
from megatron_lite.training.timing import NoClock, PhaseClock  # noqa: E402
from megatron_lite.training.trainer import Trainer  # noqa: E402


class SwitchedClock:
    """The trainer's phase clock, switched per round between the real one and one that does
    nothing: the same trainer, gate and engine time both arms."""

    def __init__(self, active):
        self.active = active

    def mark(self, phase: str | None) -> None:
        self.active.mark(phase)

    def read(self) -> dict[str, float]:
        return self.active.read()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--steps", type=int, default=50, help="steps per round")
    p.add_argument("--rounds", type=int, default=10, help="rounds of each, alternating")
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args()

    cfg = load_config(a.recipe, a.overrides)
    dims, acc = init_distributed(cfg, detect())
    gb = dims.global_batch(cfg)
    ensure_dataset(cfg.data, log=lambda m: None)
    data = build_data(cfg.data, gb * (a.warmup + 2 * a.steps * a.rounds + 4), gb)
    parts = build(cfg, dims, acc, data.tokenizer.vocab_size, 10**6)
    timed_clock = PhaseClock(acc)
    clock = SwitchedClock(timed_clock)
    trainer = Trainer(cfg, dims, parts, data, MetricsLogger(cfg, Path("."), False, {}), lambda m: None,
                      clock=clock)
    batches = trainer._train_batches()
    log_interval = cfg.training.log_interval

    def run(steps: int, with_timing: bool) -> float:
        clock.active = timed_clock if with_timing else NoClock()
        acc.synchronize()
        start = time.perf_counter()
        loss = None
        for step in range(1, steps + 1):
            loss = trainer.train_step(batches)
            if with_timing:
                trainer.interval.step_done()
            if step % log_interval == 0:
                loss.item()  # the log step's read, in both
                if with_timing:
                    record = {"step": step, "step_time_ms": 1.0, "tokens_per_sec": 1.0,
                              **{f"{k}_ms": v for k, v in timed_clock.read().items()},
                              **devmod.device_memory_gib(acc), "host_rss_gib": devmod.host_rss_gib()}
                    trainer.slowdowns.observe(record)
                    trainer.interval.restart()
        loss.item()
        acc.synchronize()
        return time.perf_counter() - start

    run(a.warmup, True)
    ratios = []
    for i in range(a.rounds):
        # Alternate which goes first so that a drift of the machine's speed cancels.
        first = i % 2 == 0
        t1 = run(a.steps, first)
        t2 = run(a.steps, not first)
        with_s, without_s = (t1, t2) if first else (t2, t1)
        ratios.append(with_s / without_s)
    ratio = statistics.median(ratios)
    print(f"{a.recipe} {' '.join(a.overrides)} | {devmod.device_name(acc)} | {a.rounds} rounds of "
          f"{a.steps} steps | log every {log_interval}")
    print(f"with timings / without, per round: {' '.join(f'{r:.4f}' for r in ratios)}")
    print(f"ratio (median): {ratio:.4f} ({100 * (ratio - 1):+.2f}%)")


if __name__ == "__main__":
    main()
