"""Text samples from the model under training (at evaluation time)."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def sample(model: nn.Module, prompt: list[int], max_new_tokens: int, max_len: int,
           temperature: float, top_k: int, seed: int, device: torch.device) -> list[int]:
    """Autoregressive sampling (no KV cache: samples are short and this runs rarely).

    Every rank calls this with the same seed so that sharded (ZeRO-3) parameters can be gathered.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -max_len:])[:, -1, :].float().cpu()  # (1, V)
        if temperature <= 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        tokens = torch.cat([tokens, nxt.to(device)], dim=1)
    return tokens[0, len(prompt):].tolist()
