#!/usr/bin/env python
"""Our trainer vs a plain PyTorch loop around transformers' LlamaForCausalLM, same invocation.

Both train the same small Llama (GQA, SwiGLU, RoPE, RMSNorm) on the same random token batches,
fp32, AdamW with the same hyper-parameters and gradient clipping. Ours runs the real training
step (DeepSpeed engine, our optimizer and schedule, ``Trainer.train_step``); the baseline is the
loop a user would write. Rounds alternate between the two so that machine noise hits both, and
the median step time of each is compared.

    DS_ACCELERATOR=cpu python bench/compare_hf_llama.py [--layers 4 --d-model 256 ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
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
from megatron_lite.logging import MetricsLogger  # noqa: E402
from megatron_lite.model import build_model  # noqa: E402
from megatron_lite.model.hf_convert import to_hf  # noqa: E402
from megatron_lite.parallel.apply import compile_blocks  # noqa: E402
from megatron_lite.training.engine import build_engine  # noqa: E402
from megatron_lite.training.trainer import Trainer  # noqa: E402


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


def main() -> None:
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
    a = p.parse_args()
    cfg = make_config(a)
    dims, acc = init_distributed(cfg, detect())

    torch.manual_seed(0)
    model = build_model(cfg.model)
    from transformers import LlamaForCausalLM

    hf_cfg, hf_sd = to_hf(model.state_dict(), cfg.model)
    hf_cfg._attn_implementation = "sdpa"
    hf = LlamaForCausalLM(hf_cfg)
    hf.load_state_dict(hf_sd)
    hf.train()
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    if cfg.training.compile:
        compile_blocks(model, acc.get_compile_backend())
    engine = build_engine(model, cfg, dims, cfg.training.iters, acc.device_name())
    trainer = Trainer(cfg, dims, acc, engine, None, MetricsLogger(cfg, Path("."), False, {}),
                      cfg.training.iters, 0.0, lambda m: None)

    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=gen) for _ in range(8)]

    def batches():
        i = 0
        while True:
            yield data[i % len(data)]
            i += 1

    ours_batches = batches()

    def ours_step() -> None:
        trainer.train_step(ours_batches).item()

    hf_batches = batches()

    def hf_step() -> None:
        x = next(hf_batches)[:, :-1]
        loss = hf(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        hf_opt.step()
        hf_opt.zero_grad(set_to_none=True)
        loss.item()

    def timed(step) -> float:
        start = time.perf_counter()
        for _ in range(a.steps):
            step()
        return (time.perf_counter() - start) / a.steps

    for step in (ours_step, hf_step):  # warm-up
        for _ in range(3):
            step()
    ours_t, hf_t = [], []
    for _ in range(a.rounds):
        ours_t.append(timed(ours_step))
        hf_t.append(timed(hf_step))
    tokens = a.batch * a.seq
    ours_tps, hf_tps = tokens / statistics.median(ours_t), tokens / statistics.median(hf_t)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: Llama {a.layers} layers, d_model {a.d_model}, heads {a.heads}/{a.kv_heads} kv, "
          f"vocab {a.vocab}, {params / 1e6:.1f}M params | batch {a.batch} x seq {a.seq} | fp32 | "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    engine_name = "DeepSpeed engine, compiled blocks" if a.compile else "DeepSpeed engine"
    print(f"megatron_lite ({engine_name}): {ours_tps:,.0f} tokens/s "
          f"(median {1000 * statistics.median(ours_t):.1f} ms/step)")
    print(f"transformers LlamaForCausalLM loop: {hf_tps:,.0f} tokens/s "
          f"(median {1000 * statistics.median(hf_t):.1f} ms/step)")
    print(f"ratio (ours / transformers): {ours_tps / hf_tps:.2f}")


if __name__ == "__main__":
    main()
