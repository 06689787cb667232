"""Text samples from the model under training (at evaluation time)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.model.kv_cache import KVCache


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
    """Autoregressive sampling from ``model`` (a ``Transformer``) with a KV cache: each new token
    is one position through the model. Once the window of ``max_len`` positions is full, the
    model starts again from the last three quarters of it (``restart_length``): every token is
    drawn from at least that much context, and the learned positions of GPT-2-style models
    stay within those they were trained on.

    ``fixed_shape``: no cache; every forward sees ``max_len`` positions, the window padded on
    the right (causal attention never lets a position see the padding after it), for devices
    that compile a graph per input shape (``device.compiles_per_shape``); ``after_token`` runs
    after each token (Gaudi's lazy-mode graph cut).

    Every rank calls this with the same seed so that sharded (ZeRO-3) and tensor-parallel
    parameters can be gathered. ``agree`` gets each token's error or None and raises on every
    rank if any rank failed (``raise_together``), so a rank that fails outside the model's own
    collectives (picking the token: NaN probabilities) leaves no other inside the next token's.
    A rank that fails inside them leaves the others there until the collective timeout; the
    agreement then fails with ``CollectiveError``, which ends the run on every rank.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    begin = max(0, len(prompt) - max_len)  # where the window starts in ``tokens``
    cache = KVCache(max_len)
    for _ in range(max_new_tokens):
        try:
            if tokens.size(1) - begin > max_len:  # the window is full: start again from its end
                begin, cache = tokens.size(1) - restart_length(max_len), KVCache(max_len)
            window = tokens[:, begin:]  # (1, n)
            if fixed_shape:
                padded = F.pad(window, (0, max_len - window.size(1)))  # (1, max_len)
                logits = model(padded)[:, window.size(1) - 1, :]  # (1, V)
            else:
                logits = model(window[:, cache.length:], cache=cache)[:, -1, :]  # (1, V)
            logits = logits.float().cpu()
            after_token()
            nxt, error = pick(logits, temperature, top_k, gen), None
        except Exception as e:  # re-raised by agree, on every rank
            nxt, error = None, e
        agree(error)
        tokens = torch.cat([tokens, nxt.to(device)], dim=1)
    return tokens[0, len(prompt):].tolist()


def restart_length(max_len: int) -> int:
    """Positions the cache starts again from when the window is full: three quarters of it (a
    forward of that many positions every quarter window of tokens)."""
    return max(1, max_len - max_len // 4)
