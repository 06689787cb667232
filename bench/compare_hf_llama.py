#!/usr/bin/env python
"""Our trainer vs a plain PyTorch loop around transformers' LlamaForCausalLM, same invocation.

Both train the same small Llama (GQA, SwiGLU, RoPE, RMSNorm) on the same random token batches,
fp32, AdamW with the same hyper-parameters and gradient clipping. Ours runs the real training
step (``training.build``: DeepSpeed engine, our optimizer and schedule, the step runner); the baseline is the
loop a user would write. Rounds alternate between them so that machine noise hits all, and the
median step times are compared.

The baseline runs in child processes of this one, so that process-wide settings our trainer
makes (``training.cpu_retain_freed_memory``: glibc keeps freed memory instead of faulting it in
again every step) do not leak into it: one child as a user would run the loop, and one with the
same allocator setting, for the like-for-like ratio.

    DS_ACCELERATOR=cpu python bench/compare_hf_llama.py [--layers 4 --d-model 256 ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from megatron_lite.config.schema import (  # noqa: E402
    Config,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    TokenizerConfig,
    TrainingConfig,
)
from megatron_lite.config.validate import validate  # noqa: E402
from megatron_lite.distributed import detect, init_distributed  # noqa: E402
from megatron_lite.model import build_model  # noqa: E402
from megatron_lite.model.hf_convert import to_hf  # noqa: E402
from megatron_lite.training.build import build  # noqa: E402


def make_config(a: argparse.Namespace) -> Config:
    cfg = Config(
        model=ModelConfig(vocab_size=a.vocab, n_layers=a.layers, n_heads=a.heads, n_kv_heads=a.kv_heads,
                          d_model=a.d_model, max_seq_len=a.seq),
        data=DataConfig(prefix="unused", tokenizer=TokenizerConfig(model="unused"), seq_length=a.seq),
        optimizer=OptimizerConfig(lr=3e-4, min_lr=3e-4, weight_decay=0.1, grad_clip=1.0),
        training=TrainingConfig(iters=10**6, micro_batch_size=a.batch, device="cpu", compile=a.compile),
    )
    problems = validate(cfg)
    if problems:
        raise SystemExit("\n".join(problems))
    return cfg


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--compile", action="store_true",
                   help="ours with training.compile (the baseline stays eager)")
    # Internal: this script as the baseline's child process.
    p.add_argument("--baseline-worker", choices=("default", "retained"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def token_batches(a: argparse.Namespace):
    """The same 8 random batches, cycled, in every process."""
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=gen) for _ in range(8)]
    i = 0
    while True:
        yield data[i % len(data)]
        i += 1


def timed(step, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def baseline_worker(a: argparse.Namespace) -> None:
    """The transformers loop: builds the same initial weights, warms up, then runs one timed
    round per line read from stdin and answers with its seconds per step."""
    from transformers import LlamaForCausalLM

    from megatron_lite.distributed.device import retain_freed_host_memory

    if a.baseline_worker == "retained":
        retain_freed_host_memory()
    cfg = make_config(a)
    hf_cfg, hf_sd = to_hf(build_model(cfg.model, "cpu", cfg.training.seed).state_dict(), cfg.model)
    hf_cfg._attn_implementation = "sdpa"
    hf = LlamaForCausalLM(hf_cfg)
    hf.load_state_dict(hf_sd)
    hf.train()
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    batches = token_batches(a)

    def hf_step() -> None:
        x = next(batches)[:, :-1]
        loss = hf(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        hf_opt.step()
        hf_opt.zero_grad(set_to_none=True)
        loss.item()

    timed(hf_step, 3)  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        print(timed(hf_step, a.steps), flush=True)


class Baseline:
    """A baseline worker process, driven one round at a time."""

    def __init__(self, kind: str):
        self.proc = subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--baseline-worker", kind],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._expect("ready")

    def _expect(self, what: str) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the baseline process exited (status {self.proc.wait()}); its error is above")
        if what and line.strip() != what:
            raise SystemExit(f"the baseline process said {line!r}, expected {what!r}")
        return line

    def round(self) -> float:
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        return float(self._expect(""))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    a = parse_args()
    if a.baseline_worker:
        baseline_worker(a)
        return
    cfg = make_config(a)
    baselines = {"default": Baseline("default"), "retained": Baseline("retained")}
    dims, acc = init_distributed(cfg, detect())

    parts = build(cfg, dims, acc, None, cfg.training.iters)
    model = parts.engine.module
    batches = token_batches(a)
    runner = parts.step_runner()

    def ours_step() -> None:
        runner.train_step(batches, parts.device).item()

    timed(ours_step, 3)  # warm-up
    ours_t: list[float] = []
    hf_t: dict[str, list[float]] = {kind: [] for kind in baselines}
    for _ in range(a.rounds):
        ours_t.append(timed(ours_step, a.steps))
        for kind, baseline in baselines.items():
            hf_t[kind].append(baseline.round())
    for baseline in baselines.values():
        baseline.close()

    tokens = a.batch * a.seq
    ours_tps = tokens / statistics.median(ours_t)
    hf_tps = {kind: tokens / statistics.median(t) for kind, t in hf_t.items()}
    params = sum(p.numel() for p in model.parameters())
    print(f"model: Llama {a.layers} layers, d_model {a.d_model}, heads {a.heads}/{a.kv_heads} kv, "
          f"vocab {a.vocab}, {params / 1e6:.1f}M params | batch {a.batch} x seq {a.seq} | fp32 | "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    engine_name = "DeepSpeed engine, compiled blocks" if a.compile else "DeepSpeed engine"
    print(f"megatron_lite ({engine_name}): {ours_tps:,.0f} tokens/s "
          f"(median {1000 * statistics.median(ours_t):.1f} ms/step)")
    labels = {"default": "as a user runs it", "retained": "with the trainer's allocator setting"}
    for kind, label in labels.items():
        print(f"transformers LlamaForCausalLM loop, {label}: {hf_tps[kind]:,.0f} tokens/s "
              f"(median {1000 * statistics.median(hf_t[kind]):.1f} ms/step)")
    print(f"ratio (ours / transformers): {ours_tps / hf_tps['default']:.2f}")
    print(f"ratio with the same allocator setting in both: {ours_tps / hf_tps['retained']:.2f}")


if __name__ == "__main__":
    main()
