#!/usr/bin/env python
"""The output layer's loss, forward and backward: the fused chunked pass against the plain
``F.cross_entropy(h @ W.T)``, for logits of several sizes, alternating rounds in one process.

    python bench/loss_speed.py [--rounds 5] [--dtype fp32|bf16]

Prints each shape's milliseconds and the ratio plain / fused (above 1: the fused pass is
faster), with ``SMALL_LOGITS`` (``model/loss.py``), the size up to which the trainer takes the
plain loss.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron_lite.model import loss as loss_module  # noqa: E402

# (tokens, width, vocabulary): shakespeare-char's step, then larger logits up to a 4K vocabulary.
SHAPES = [(768, 128, 65), (8192, 128, 65), (4096, 256, 256), (1024, 128, 1024), (512, 64, 4096),
          (2048, 128, 2048), (2048, 256, 4096)]


def per_call_ms(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    a = p.parse_args()
    dtype = torch.float32 if a.dtype == "fp32" else torch.bfloat16
    print(f"SMALL_LOGITS = {loss_module.SMALL_LOGITS:,} | {a.dtype} | {torch.get_num_threads()} threads")
    for n, d, v in SHAPES:
        g = torch.Generator().manual_seed(0)
        h = torch.randn(n, d, generator=g).to(dtype).requires_grad_()
        w = (torch.randn(v, d, generator=g) * 0.05).to(dtype).requires_grad_()
        t = torch.randint(0, v, (n,), generator=g)

        def fused(h=h, w=w, t=t):
            loss_module._LinearCrossEntropy.apply(h, w, t, loss_module._default_softmax_grad(h, w)).backward()

        def plain(h=h, w=w, t=t):
            F.cross_entropy((h @ w.t()).float(), t).backward()

        calls = max(3, int(2e7 // (n * v * d) + 1))
        times = {"fused": [], "plain": []}
        for _ in range(a.rounds):
            times["fused"].append(per_call_ms(fused, calls))
            times["plain"].append(per_call_ms(plain, calls))
        f, pl = statistics.median(times["fused"]), statistics.median(times["plain"])
        taken = "plain" if n * v <= loss_module.SMALL_LOGITS else "fused"
        print(f"{n:>6} x {v:<6} ({n * v / 1e6:5.2f}M logits, d {d:>3}): fused {f:8.3f} ms | "
              f"plain {pl:8.3f} ms | plain / fused {pl / f:5.2f} | the trainer takes: {taken}")


if __name__ == "__main__":
    main()
