#!/usr/bin/env python
"""Time the training step of a recipe: throughput, MFU and where the time goes.

    DS_ACCELERATOR=cpu python bench/step.py recipes/shakespeare-char.yaml [overrides] [--steps 20]
    torchrun --nproc-per-node 4 bench/step.py recipes/gpt2-124m.yaml --steps 20
    python bench/step.py recipes/llama3.2-1b.yaml --synthetic      # one GPU, no dataset needed

1. The real step (``Trainer.train_step`` on the DeepSpeed engine, the recipe's data loader)
   after ``--warmup`` steps: tokens/s, TFLOP/s per device and MFU (the device's peak from the
   table in ``distributed/device.py``; none on CPU).
2. A breakdown over ``--breakdown`` more steps, synchronising the device between phases: data
   wait, forward, backward, optimizer step; communication is the time the PyTorch profiler
   records in collective operations (inside backward and the optimizer step). Not under
   pipeline parallelism, where DeepSpeed's engine interleaves the phases.
3. On one process: the same model as a plain loop around transformers' model class
   (LlamaForCausalLM, or GPT2LMHeadModel for GPT-2-style recipes) on the same device, same
   weights, batches and AdamW (fp32 weights under autocast where the recipe trains in bf16),
   timed in alternating rounds with ours, and the ratio of the two (``--no-baseline`` skips it).
   It shares this process, and so the trainer's process-wide settings (on CPU,
   ``training.cpu_retain_freed_memory``): a like-for-like ratio. ``bench/compare_hf_llama.py``
   also times the loop as a user runs it, in a process of its own.
4. ``--top N``: the N operators with the most (device) time in the profiled steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron_lite.distributed import device as devmod  # noqa: E402

devmod.cpu_unless_accelerator()

from megatron_lite.config import load_config  # noqa: E402
from megatron_lite.data.build import ensure_dataset  # noqa: E402
from megatron_lite.data.source import build_data  # noqa: E402
from megatron_lite.distributed import detect, init_distributed  # noqa: E402
from megatron_lite.distributed.collectives import on_one_rank_then_all  # noqa: E402
from megatron_lite.logging import MetricsLogger  # noqa: E402
from megatron_lite.model import build_model  # noqa: E402
from megatron_lite.model.flops import mfu  # noqa: E402
from megatron_lite.model.hf_convert import to_hf  # noqa: E402
from megatron_lite.training.build import build  # noqa: E402
from megatron_lite.training.trainer import Trainer  # noqa: E402

COLLECTIVES = ("c10d", "nccl", "gloo", "all_reduce", "allreduce", "all_gather", "allgather",
               "reduce_scatter", "broadcast", "all_to_all", "send", "recv")


class SyntheticData:
    """Stands in for ``DataSource`` with uniformly random tokens (no dataset or tokenizer)."""

    class _Tokenizer:
        def __init__(self, vocab_size: int):
            self.vocab_size = vocab_size

    class _Samples(torch.utils.data.Dataset):
        def __init__(self, vocab_size: int, seq_length: int):
            self.vocab_size, self.seq_length = vocab_size, seq_length

        def __len__(self) -> int:
            return 2**62

        def __getitem__(self, i: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(i)
            return torch.randint(0, self.vocab_size, (self.seq_length + 1,), generator=g)

    def __init__(self, vocab_size: int, seq_length: int):
        self.tokenizer = self._Tokenizer(vocab_size)
        self.train = self.valid = self._Samples(vocab_size, seq_length)
        self.num_workers = 0

    def loader(self, dataset, sampler):
        return (torch.stack([dataset[i] for i in idx]) for idx in sampler)


def timed(fn, n: int, sync) -> float:
    """Seconds per call of ``fn`` over ``n`` calls."""
    sync()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - start) / n


def breakdown(trainer: Trainer, batches, n: int, sync) -> dict[str, float]:
    """Mean seconds per step in data wait, forward, backward and optimizer step. The update
    gate's report is not taken here (it is in the timed steps: one device all-reduce and a copy
    to the host, read one step late)."""
    runner, engine, device = trainer.step_runner, trainer.engine, trainer.device
    parts = dict.fromkeys(("data wait", "forward", "backward", "optimizer"), 0.0)
    for _ in range(n):
        for _micro in range(runner.grad_accum):
            sync()
            t0 = time.perf_counter()
            batch = next(batches)
            pair = runner.split(batch.to(device, non_blocking=True))
            sync()
            t1 = time.perf_counter()
            loss = engine(*pair)
            sync()
            t2 = time.perf_counter()
            engine.backward(loss)
            sync()
            t3 = time.perf_counter()
            engine.step()
            sync()
            t4 = time.perf_counter()
            parts["data wait"] += t1 - t0
            parts["forward"] += t2 - t1
            parts["backward"] += t3 - t2
            parts["optimizer"] += t4 - t3
    return {k: v / n for k, v in parts.items()}


def communication(trainer: Trainer, batches, n: int, device_type: str, top: int = 0) -> float:
    """Seconds per step the profiler records in collectives; with ``top``, also print the
    operators that take the most time (device time on accelerators)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(n):
            trainer.train_step(batches)
    if top:
        sort = "self_cpu_time_total" if device_type == "cpu" else "self_device_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=top, max_name_column_width=60))
    total = 0.0
    for event in prof.key_averages():
        if any(k in event.key.lower() for k in COLLECTIVES):
            total += max(event.self_cpu_time_total, getattr(event, "self_device_time_total", 0.0))
    return total / 1e6 / n


def hf_baseline(model_cfg, cfg, batches, steps: int, device: torch.device):
    """A step function of the plain transformers loop on the same weights and batches: fp32
    weights, under bf16 autocast where the recipe trains in bf16 (the usual mixed-precision
    loop)."""
    from transformers import AutoModelForCausalLM

    reference = build_model(model_cfg, "cpu", cfg.training.seed)
    hf_cfg, state = to_hf(reference.state_dict(), model_cfg)
    hf_cfg._attn_implementation = "sdpa"
    hf = AutoModelForCausalLM.from_config(hf_cfg)
    hf.load_state_dict(state, strict=False)  # (GPT-2 keeps causal-mask buffers of its own)
    hf.to(device).train()
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.training.precision)
    o = cfg.optimizer
    opt = torch.optim.AdamW(hf.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay)
    accum = steps

    def step() -> None:
        for _ in range(accum):
            batch = next(batches).to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=low or torch.float32, enabled=low is not None):
                loss = hf(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps (per round with the baseline)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds against the baseline")
    p.add_argument("--breakdown", type=int, default=3, help="steps of the per-phase breakdown")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--top", type=int, default=0, help="print the N costliest operators (profiler)")
    p.add_argument("--synthetic", action="store_true",
                   help="random tokens instead of the recipe's dataset (needs model.vocab_size)")
    p.add_argument("--json", type=Path, help="also write the results here")
    a = p.parse_args()

    cfg = load_config(a.recipe, a.overrides)
    dims, acc = init_distributed(cfg, detect())
    gb = dims.global_batch(cfg)
    if a.synthetic:
        if cfg.model.vocab_size is None:
            raise SystemExit("--synthetic needs model.vocab_size (the tokenizer is not read)")
        data = SyntheticData(cfg.model.vocab_size, cfg.data.seq_length)
    else:
        on_one_rank_then_all(lambda: ensure_dataset(cfg.data, log=lambda m: None), dims, "the dataset build")
        budget = gb * (a.warmup + a.steps * (a.rounds + 1) + 2 * a.breakdown + 4)
        data = build_data(cfg.data, budget, gb)
    parts = build(cfg, dims, acc, data.tokenizer.vocab_size, 10**6, getattr(data.tokenizer, "eod_id", None))
    model_cfg, fpt = parts.model_cfg, parts.flops_per_token
    quiet = MetricsLogger(cfg, Path("."), False, {})
    trainer = Trainer(cfg, dims, parts, data, quiet, lambda m: None)
    batches = trainer._train_batches()
    sync = acc.synchronize

    def ours() -> None:
        trainer.train_step(batches).item()  # the loop reads the loss at log steps; here at every step

    for _ in range(a.warmup):
        ours()
    peak_memory = devmod.memory_gib(acc)  # ours alone: the baseline is not built yet
    baseline = None
    one_process = dims.world_size == 1 and not a.no_baseline
    if one_process:
        hf_batches = trainer._batches(data.train, 0, None, workers=False)
        baseline = hf_baseline(model_cfg, cfg, hf_batches, dims.grad_accumulation(cfg),
                               torch.device(trainer.device))
        for _ in range(a.warmup):
            baseline()
    ours_t, hf_t = [], []
    for _ in range(a.rounds if baseline else 1):
        ours_t.append(timed(ours, a.steps, sync))
        if baseline:
            hf_t.append(timed(baseline, a.steps, sync))
    step_s = statistics.median(ours_t)
    tokens = gb * cfg.data.seq_length
    per_device = tokens / step_s / dims.world_size
    peak = devmod.peak_flops(devmod.device_name(acc), cfg.training.precision)
    result = {
        "recipe": a.recipe, "overrides": a.overrides, "device": devmod.device_name(acc),
        "world_size": dims.world_size, "tokens_per_step": tokens, "step_ms": 1000 * step_s,
        "tokens_per_sec": tokens / step_s, "tokens_per_sec_per_device": per_device,
        "tflops_per_device": per_device * fpt / 1e12,
        "mfu": mfu(per_device, fpt, peak),
        "peak_memory_gib": peak_memory,
    }
    if dims.pipeline == 1:
        parts = breakdown(trainer, batches, a.breakdown, sync)
        parts["communication (in backward/optimizer)"] = communication(
            trainer, batches, a.breakdown, acc.device_name(), a.top if dims.is_main else 0)
        result["breakdown_ms"] = {k: 1000 * v for k, v in parts.items()}
    if hf_t:
        result["baseline_step_ms"] = 1000 * statistics.median(hf_t)
        result["ratio_vs_transformers"] = statistics.median(hf_t) / step_s
    if dims.is_main:
        print(f"{a.recipe} {' '.join(a.overrides)} | {result['device']} × {dims.world_size} | "
              f"{cfg.training.precision} | {tokens:,} tokens/step"
              f"{' | compiled blocks' if cfg.training.compile else ''}")
        print(f"step {result['step_ms']:.1f} ms | {result['tokens_per_sec']:,.0f} tokens/s | "
              f"{result['tokens_per_sec_per_device']:,.0f} tokens/s/device | "
              f"{result['tflops_per_device']:.3f} TFLOP/s/device | MFU "
              + (f"{100 * result['mfu']:.1f}%" if result["mfu"] is not None else "n/a (no peak known)")
              + f" | peak memory {result['peak_memory_gib']:.1f} GiB")
        for name, ms in result.get("breakdown_ms", {}).items():
            print(f"  {name:<40} {ms:8.1f} ms")
        if hf_t:
            print(f"transformers plain loop: {result['baseline_step_ms']:.1f} ms/step | ratio (ours / "
                  f"transformers, throughput): {result['ratio_vs_transformers']:.2f}")
        if a.json:
            a.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
