"""Keys and values of the positions a model has already seen, so that sampling runs one new
token through the model per step instead of the whole window again.

``Transformer.forward(tokens, cache=KVCache())`` runs ``tokens`` after the positions the cache
holds and adds theirs to it; each attention layer keeps its keys (RoPE applied) and values.
"""

from __future__ import annotations

import torch


class LayerCache:
    """One attention layer's keys and values so far: the first ``length`` positions of buffers
    (B, Hkv, capacity, hd), written in place (appending by concatenation would copy the whole
    cache at every token)."""

    def __init__(self, capacity: int):
        self.capacity, self.length = capacity, 0
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions' (B, Hkv, T, hd) keys and values; returns all of them (views)."""
        end = self.length + k.size(2)
        if end > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} positions; {end} were given")
        if self.k is None:
            B, H, _, hd = k.shape
            self.k, self.v = (k.new_empty(B, H, self.capacity, hd) for _ in range(2))
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]  # (B, Hkv, end, hd)


class KVCache:
    """Every layer's ``LayerCache``, by the name of its block, and the positions they hold (at
    most ``capacity``: the model's context)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.layers: dict[str, LayerCache] = {}
        self.length = 0

    def start_of(self, count: int) -> int:
        """The position of the first of ``count`` new ones; refuses to go past the capacity."""
        if self.length + count > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} positions; "
                             f"{self.length + count} were given")
        return self.length

    def layer(self, name: str) -> LayerCache:
        if name not in self.layers:
            self.layers[name] = LayerCache(self.capacity)
        return self.layers[name]


def causal_mask(queries: int, keys: int, device: torch.device) -> torch.Tensor | None:
    """Which of ``keys`` positions each of the last ``queries`` may attend to: (T, n) bool, or
    None where every query sees every key (one new position after the cached ones)."""
    if queries == 1:
        return None
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)
