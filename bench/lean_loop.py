#!/usr/bin/env python
"""Our trainer against the leanest plain loop a user would write, end to end, as a user runs
them (each a fresh process: start-up, data, training, evaluation).

    python bench/lean_loop.py [--iters 2000] [--rounds 3] [dotted.key=value ...]
    python bench/lean_loop.py training.device=cuda training.precision=bf16 training.compile=true
        # on a GPU, as nanoGPT runs there (bf16, fused AdamW, the model compiled)

The lean loop is this file run with ``--lean``: a minimal GPT module (learned positions,
LayerNorm, the recipe's GELU MLP, tied embeddings, torch's scaled-dot-product attention), a memmap
``get_batch`` of random windows of the recipe's own ``.bin`` (the first 90% of the tokens to
train, the rest to validate, as the recipe's split), torch AdamW with the recipe's settings
(decay on matrices only), gradient clipping, the recipe's warm-up + cosine learning rate, and
the same evaluation work: every ``training.eval_interval`` steps and at the end, the loss over
``training.eval_iters`` validation batches and a ``training.sample_tokens``-token sample. Ours is
``python pretrain.py recipes/shakespeare-char.yaml`` with the same iterations and no
checkpoints. Rounds alternate the two; the ratio is lean seconds / ours (above 1: ours is
faster), and each run's last validation loss is printed next to it. Under
``training.compile=true`` the lean model is compiled whole, as nanoGPT compiles its own (the
sample's growing lengths run eager); ours compiles its blocks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "shakespeare-char.yaml"


def settings(overrides: list[str]) -> dict:
    """The recipe's resolved values (with ``overrides``) that the lean loop uses (passed to it as
    JSON: it imports nothing of ours)."""
    sys.path.insert(0, str(REPO))
    from dataclasses import asdict

    from megatron_lite.config import load_config

    cfg = asdict(load_config(str(RECIPE), overrides))
    return {k: cfg[k] for k in ("model", "optimizer", "training", "schedule", "data")}


def lean(iters: int, prefix: str, r: dict) -> None:
    """The plain loop (kept to what a user writes: one file, no framework)."""
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    m, o, t, s = r["model"], r["optimizer"], r["training"], r["schedule"]
    seq, batch = r["data"]["seq_length"], t["micro_batch_size"]
    chars = json.loads((Path(prefix).parent / "chars.json").read_text())
    vocab = len(chars)
    torch.manual_seed(t["seed"])
    found = torch.accelerator.current_accelerator()
    device = t["device"] if t["device"] != "auto" else found.type if found is not None else "cpu"
    # As a user writes it for the recipe's precision: bf16 autocast over fp32 weights.
    autocast = torch.autocast(device, torch.bfloat16, enabled=t["precision"] == "bf16")

    gelu_form = "tanh" if m["activation"] == "gelu" else "none"  # the recipe's GELU

    class Block(nn.Module):
        def __init__(self, d: int, heads: int):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            B, T, D = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
            q, k, v = (z.view(B, T, self.heads, D // self.heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(B, T, D))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate=gelu_form))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            d = m["d_model"]
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(Block(d, m["n_heads"]) for _ in range(m["n_layers"]))
            self.ln = nn.LayerNorm(d)
            self.apply(lambda mod: nn.init.normal_(mod.weight, std=0.02)
                       if isinstance(mod, (nn.Linear, nn.Embedding)) else None)

        def forward(self, idx, targets=None):
            x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
            for block in self.blocks:
                x = block(x)
            logits = self.ln(x) @ self.tok.weight.T  # tied
            if targets is None:
                return logits
            return F.cross_entropy(logits.view(-1, vocab), targets.view(-1))

    data = np.memmap(f"{prefix}.bin", dtype=np.uint16, mode="r")
    cut = int(len(data) * 0.9)

    def get_batch(split: str):
        lo, hi = (0, cut) if split == "train" else (cut, len(data))
        ix = torch.randint(lo, hi - seq - 1, (batch,))
        x = torch.stack([torch.from_numpy(data[i:i + seq].astype(np.int64)) for i in ix.tolist()])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + seq].astype(np.int64)) for i in ix.tolist()])
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    model = GPT().to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o["weight_decay"]},
                             {"params": other, "weight_decay": 0.0}],
                            lr=o["lr"], betas=(o["beta1"], o["beta2"]), fused=device == "cuda")
    sampler = model  # the sample's growing lengths: eager, as nanoGPT samples outside its loop
    if t["compile"]:  # as nanoGPT compiles on a GPU (and ours under training.compile=true)
        model = torch.compile(model)

    def lr_at(step: int) -> float:
        if step < s["warmup_iters"]:
            return o["lr"] * (step + 1) / (s["warmup_iters"] + 1)
        progress = (step - s["warmup_iters"]) / max(iters - s["warmup_iters"], 1)
        return o["min_lr"] + 0.5 * (o["lr"] - o["min_lr"]) * (1 + math.cos(math.pi * min(progress, 1.0)))

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        with autocast:
            loss = sum(model(*get_batch("val")).item() for _ in range(t["eval_iters"])) / t["eval_iters"]
        idx = torch.zeros((1, 1), dtype=torch.long, device=device)
        for _ in range(t["sample_tokens"]):  # the sample, as the recipe generates one
            with autocast:
                logits = sampler(idx[:, -seq:])[:, -1, :].float() / t["sample_temperature"]
            v, _ = torch.topk(logits, min(t["sample_top_k"], vocab))
            logits[logits < v[:, [-1]]] = -float("inf")
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
        model.train()
        return loss

    val = None
    # The launching process's clock at the start (absent when run by hand: startup unknown).
    startup, evaluating = time.time() - float(os.environ.get("LEAN_LOOP_T0", "nan")), 0.0
    started = time.perf_counter()
    for step in range(iters):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with autocast:
            loss = model(*get_batch("train"))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o["grad_clip"])
        opt.step()
        if (step + 1) % t["log_interval"] == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)
        if (step + 1) % t["eval_interval"] == 0 or step + 1 == iters:
            began = time.perf_counter()
            val = evaluate()
            evaluating += time.perf_counter() - began
            print(f"step {step + 1}: val loss {val:.4f}", flush=True)
    training = time.perf_counter() - started - evaluating
    print(f"phases: startup {startup:.1f} s, training {training:.1f} s, evaluation {evaluating:.1f} s")
    print(f"final validation loss {val:.4f}")


def timed(command: list[str], env: dict, run_dir: Path | None = None) -> tuple[float, float, str]:
    """(wall seconds, last validation loss printed, where the time went). ``run_dir``: ours's
    logging directory, whose records give its phases; the lean loop prints its own."""
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, env={**env, "LEAN_LOOP_T0": repr(time.time())},
                          capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command[:3])} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    found = re.findall(r"final validation loss ([0-9.]+)", proc.stdout)
    if run_dir is None:
        phases = re.findall(r"phases: (.*)", proc.stdout)[-1]
    else:
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if "step_time_ms" in r]
        training = sum(r["step_time_ms"] * (r["step"] - prev["step"] if prev else r["step"]) / 1000
                       for prev, r in zip([None, *steps], steps, strict=False))
        evaluating = sum(r["eval_ms"] for r in records if "val_loss" in r) / 1000
        phases = (f"startup {steps[0]['startup_s']:.1f} s, training {training:.1f} s, "
                  f"evaluation {evaluating:.1f} s")
    return seconds, float(found[-1]), phases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lean", action="store_true", help="run the lean loop itself (one process)")
    p.add_argument("--prefix", help="the dataset prefix (default: built in a temporary directory)")
    p.add_argument("--settings", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="more overrides for ours (dotted.key=value)")
    a = p.parse_args()
    if a.lean:
        lean(a.iters, a.prefix, json.loads(a.settings))
        return
    # Ours picks DeepSpeed's accelerator from training.device itself: a DS_ACCELERATOR=cpu set
    # here would have run ours on the CPU under training.device=auto on a GPU machine.
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        prefix = a.prefix or f"{tmp}/data/tiny_text_document"
        data = [f"data.prefix={prefix}", f"data.tokenizer.model={Path(prefix).parent / 'chars.json'}"]
        ours = [sys.executable, str(REPO / "pretrain.py"), str(RECIPE), *data, f"training.iters={a.iters}",
                "checkpoint.dir=null", *a.overrides]
        # The dataset exists before either is timed (built by ours, once).
        subprocess.run([*ours[:3], *data, *a.overrides, "training.iters=1", "training.eval_iters=1",
                        "training.sample_tokens=0", f"logging.dir={tmp}/warm"], cwd=REPO, env=env,
                       check=True, capture_output=True)
        lean_cmd = [sys.executable, __file__, "--lean", "--iters", str(a.iters), "--prefix", prefix,
                    "--settings", json.dumps(settings(a.overrides))]
        ratios = []
        for i in range(a.rounds):
            run_dir = Path(tmp) / f"run{i}"
            runs = [("ours", [*ours, f"logging.dir={run_dir}"], run_dir), ("lean", lean_cmd, None)]
            if i % 2:
                runs.reverse()
            got = {name: timed(cmd, env, where) for name, cmd, where in runs}
            ratio = got["lean"][0] / got["ours"][0]
            ratios.append(ratio)
            print(f"round {i + 1}: ours {got['ours'][0]:.1f} s (val {got['ours'][1]:.4f}) | lean loop "
                  f"{got['lean'][0]:.1f} s (val {got['lean'][1]:.4f}) | lean / ours {ratio:.3f}\n"
                  f"  ours: {got['ours'][2]}\n  lean: {got['lean'][2]}", flush=True)
        print(f"{a.iters} iterations, {a.rounds} rounds: lean / ours median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
