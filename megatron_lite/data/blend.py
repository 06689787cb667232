"""Mixing several datasets by weight, sample by sample (Megatron's error-minimising scheme)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from megatron_lite.data.gpt_index import load_cached, save_cached


def blend_order(weights: list[float], n: int) -> tuple[np.ndarray, np.ndarray]:
    """For each of ``n`` samples: which dataset it comes from and the how-manieth of that
    dataset it is. Each sample goes to the dataset furthest behind its share, so at every
    prefix of the stream the counts are within one sample of ``weight · prefix length``.

    A sequential greedy choice has no closed vectorised form; the loop costs about a second per
    million samples, once per run.
    """
    total = float(sum(weights))
    w = [x / total for x in weights]
    counts = [0] * len(w)
    which = np.empty(n, dtype=np.int16)
    nth = np.empty(n, dtype=np.int64)
    ks = range(len(w))
    for i in range(n):  # plain floats: several times faster than numpy on a handful of values
        k = max(ks, key=lambda j: w[j] * (i + 1) - counts[j])
        which[i] = k
        nth[i] = counts[k]
        counts[k] += 1
    return which, nth


def cached_blend_order(weights: list[float], n: int, cache_dir: Path, build: bool
                       ) -> tuple[np.ndarray, np.ndarray]:
    """``blend_order`` through the index cache: computed once (where ``build``), then mapped."""
    description = {"v": 1, "kind": "blend", "weights": list(map(float, weights)), "samples": n}
    key = "blend-" + hashlib.sha256(json.dumps(description).encode()).hexdigest()[:24]
    cached = load_cached(cache_dir, key, verify_hash=build)
    if cached is None:
        if not build:
            raise FileNotFoundError(
                f"blend index {cache_dir}/{key}.json is missing on this rank although the building "
                "rank wrote it: if data.cache_dir is not shared by all nodes, set data.cache_shared=false")
        which, nth = blend_order(weights, n)
        save_cached(cache_dir, key, {"which": which, "nth": nth}, description)
        return which, nth
    return cached["which"], cached["nth"]


class BlendedSamples(torch.utils.data.Dataset):
    """Sample ``i`` is sample ``nth[i]`` of dataset ``which[i]``."""

    def __init__(self, datasets: list, which: np.ndarray, nth: np.ndarray):
        self.datasets, self.which, self.nth = datasets, which, nth

    def __len__(self) -> int:
        return int(self.which.size)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.datasets[int(self.which[i])][int(self.nth[i])]

    def locate(self, i: int) -> dict:
        """The source dataset's ``locate`` of the sample (see ``StreamDataset.locate``)."""
        return self.datasets[int(self.which[i])].locate(int(self.nth[i]))
