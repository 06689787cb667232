"""Row layouts of the fused projections: queries, keys and values as one matrix (``qkv_proj``),
SwiGLU's gate and up as one (``gate_up_proj``), and the conversions from and to the separate
projections (``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``) that Hugging Face
models and checkpoints written before the fusion hold.

One product instead of three (or two) per block: fewer, larger matrix products and fewer module
calls. The layouts keep every contiguous run of whole groups self-contained, because tensor
parallelism gives each rank a contiguous slice of rows (``ColumnParallelLinear``):

- q|k|v is grouped by key/value head (Megatron's layout): for each of the ``n_kv_heads`` groups,
  its ``n_heads / n_kv_heads`` query heads, then its key head, then its value head. A rank's
  slice of whole groups is its query heads with the key/value heads they share.
- gate|up interleaves rows: gate row i, then up row i. A rank's slice holds the pairs of its
  hidden units, as the row-parallel down projection's slice of columns expects.

The functions work on weights (rows, columns) and biases (rows,) alike, and on any tensor of a
parameter's shape (the optimizer's moments).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

import torch

PARTS = {"attn.qkv_proj": ("attn.q_proj", "attn.k_proj", "attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
"""Each fused projection (its name in a block) and the separate ones it replaces, in order."""


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_heads: int,
             n_kv_heads: int) -> torch.Tensor:
    """(H·hd, ...), (Hkv·hd, ...), (Hkv·hd, ...) -> ((H + 2·Hkv)·hd, ...) in the grouped layout.
    ``ValueError`` when the shapes are not those of ``n_heads`` query and ``n_kv_heads``
    key/value heads of one width."""
    rest = q.shape[1:]
    if (k.shape != v.shape or k.shape[1:] != rest or k.shape[0] % n_kv_heads
            or q.shape[0] * n_kv_heads != k.shape[0] * n_heads):
        raise ValueError(f"q, k, v of {n_heads} query and {n_kv_heads} key/value heads cannot have "
                         f"shapes {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    groups = [t.reshape(n_kv_heads, -1, *rest) for t in (q, k, v)]  # (Hkv, rows per group, ...)
    return torch.cat(groups, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, n_heads: int, n_kv_heads: int) -> tuple[torch.Tensor, ...]:
    """The inverse of ``fuse_qkv``: (q, k, v), each contiguous."""
    rest = qkv.shape[1:]
    head_dim = qkv.shape[0] // (n_heads + 2 * n_kv_heads)
    group = n_heads // n_kv_heads
    parts = qkv.reshape(n_kv_heads, (group + 2) * head_dim, *rest).split(
        [group * head_dim, head_dim, head_dim], dim=1)
    return tuple(p.reshape(-1, *rest).contiguous() for p in parts)


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """(F, ...), (F, ...) -> (2F, ...) with gate and up rows interleaved."""
    if gate.shape != up.shape:
        raise ValueError(f"gate and up projections of shapes {list(gate.shape)} and {list(up.shape)}")
    return torch.stack([gate, up], dim=1).reshape(-1, *gate.shape[1:])


def split_gate_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``fuse_gate_up``: (gate, up), each contiguous."""
    pairs = gate_up.reshape(-1, 2, *gate_up.shape[1:])
    return pairs[:, 0].contiguous(), pairs[:, 1].contiguous()


def parts_of(name: str) -> tuple[str, ...] | None:
    """The separate projections' names for a fused one (``blocks.0.attn.qkv_proj.weight`` ->
    its q, k, v), or None for any other parameter."""
    fused = next((f for f in PARTS if f".{f}." in f".{name}"), None)
    return None if fused is None else tuple(name.replace(fused, p) for p in PARTS[fused])


def fusable(names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Fused name -> the names of its parts, for every complete set of separate projections
    among ``names`` (``blocks.0.attn.q_proj.weight`` with its k and v -> ``blocks.0.attn.qkv_proj
    .weight``)."""
    names = set(names)
    out = {}
    for name in names:
        for fused, parts in PARTS.items():
            m = re.fullmatch(rf"(.*){re.escape(parts[0])}\.(weight|bias)", name)
            found = m and tuple(f"{m.group(1)}{p}.{m.group(2)}" for p in parts)
            if found and all(f in names for f in found):
                out[f"{m.group(1)}{fused}.{m.group(2)}"] = found
    return out


def fuse_parts(name: str, parts: Sequence[torch.Tensor], n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """The fused tensor ``name`` from its parts' tensors (in ``PARTS`` order)."""
    if ".qkv_proj." in name:
        return fuse_qkv(*parts, n_heads=n_heads, n_kv_heads=n_kv_heads)
    return fuse_gate_up(*parts)


def fuse_state_dict(sd: Mapping[str, torch.Tensor], n_heads: int, n_kv_heads: int) -> dict[str, torch.Tensor]:
    """A state dict with separate projections -> the same with fused ones (the rest as it is)."""
    merges = fusable(sd)
    taken = {p for parts in merges.values() for p in parts}
    out = {k: v for k, v in sd.items() if k not in taken}
    for name, parts in merges.items():
        out[name] = fuse_parts(name, [sd[p] for p in parts], n_heads, n_kv_heads)
    return out


def unfuse_state_dict(sd: Mapping[str, torch.Tensor], n_heads: int,
                      n_kv_heads: int) -> dict[str, torch.Tensor]:
    """The inverse of ``fuse_state_dict``: every fused projection as its separate ones."""
    out = {}
    for name, value in sd.items():
        parts = parts_of(name)
        if parts is None:
            out[name] = value
            continue
        values = split_qkv(value, n_heads, n_kv_heads) if ".qkv_proj." in name else split_gate_up(value)
        out.update(zip(parts, values, strict=True))
    return out
