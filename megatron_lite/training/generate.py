"""Text samples from the model under training (at evaluation time)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error


def pick(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """The next token from the last position's logits (1, V): greedy at temperature 0, else drawn
    from the top-k of the softmax. Returns (1, 1)."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)


@torch.no_grad()
def sample(model: nn.Module, prompt: list[int], max_new_tokens: int, max_len: int,
           temperature: float, top_k: int, seed: int, device: torch.device,
           agree: Callable[[BaseException | None], None] = _raise, fixed_shape: bool = False,
           after_token: Callable[[], None] = lambda: None) -> list[int]:
    """Autoregressive sampling (no KV cache: samples are short and this runs rarely).

    ``fixed_shape``: every forward sees ``max_len`` positions, the tokens so far padded on the
    right (causal attention never lets a position see the padding after it), for devices that
    compile a graph per input shape (``device.compiles_per_shape``); ``after_token`` runs after
    each token (Gaudi's lazy-mode graph cut).

    Every rank calls this with the same seed so that sharded (ZeRO-3) and tensor-parallel
    parameters can be gathered. ``agree`` gets each token's error or None and raises on every
    rank if any rank failed (``raise_together``), so a rank that fails outside the model's own
    collectives (picking the token: NaN probabilities) leaves no other inside the next token's.
    A rank that fails inside them leaves the others there until the collective timeout; the
    agreement then fails with ``CollectiveError``, which ends the run on every rank.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    for _ in range(max_new_tokens):
        try:
            window = tokens[:, -max_len:]  # (1, n)
            last = window.size(1) - 1
            if fixed_shape:
                window = F.pad(window, (0, max_len - window.size(1)))  # (1, max_len)
            logits = model(window)[:, last, :].float().cpu()  # (1, V)
            after_token()
            nxt, error = pick(logits, temperature, top_k, gen), None
        except Exception as e:  # re-raised by agree, on every rank
            nxt, error = None, e
        agree(error)
        tokens = torch.cat([tokens, nxt.to(device)], dim=1)
    return tokens[0, len(prompt):].tolist()
