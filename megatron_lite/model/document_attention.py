"""Attention within documents (``model.attention_mask: document``) for the whole sequence on one
device: torch's FlexAttention with a block mask on CUDA (blocks of keys wholly outside a
query block's documents are skipped, not computed and masked), and SDPA with a boolean mask
elsewhere (the CPU's flash kernel takes it; memory for the mask grows with T²)."""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F


def document_mask(q_documents: torch.Tensor, k_documents: torch.Tensor, q_positions: torch.Tensor,
                  k_positions: torch.Tensor) -> torch.Tensor:
    """The (B, 1, Tq, Tk) attention mask of queries over keys: True where the key is in the
    query's document and not after it. Documents (B, Tq) and (B, Tk); positions in the whole
    sequence (Tq,) and (Tk,)."""
    same = q_documents.unsqueeze(2) == k_documents.unsqueeze(1)  # (B, Tq, Tk)
    return (same & (q_positions.unsqueeze(1) >= k_positions.unsqueeze(0))).unsqueeze(1)


# One block mask per documents tensor: every layer of a forward (and its recomputation in
# backward) is given the same tensor.
_block_masks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@functools.cache
def _flex_document_attention():
    """The CUDA path, made on first use: ``torch.compiler.disable`` and ``torch.compile``
    import torch._dynamo (a second of every process's start otherwise)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # FlexAttention is fast only compiled (eager it runs a reference implementation).
    compiled = torch.compile(flex_attention, dynamic=False)

    @torch.compiler.disable  # its own compiled kernel; the block mask is built outside the graph
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
        block_mask = _block_masks.get(documents)
        if block_mask is None:
            def same_document_causal(b, h, q_idx, kv_idx):
                return (documents[b, q_idx] == documents[b, kv_idx]) & (q_idx >= kv_idx)

            B, T = documents.shape
            block_mask = create_block_mask(same_document_causal, B, None, T, T, device=documents.device)
            _block_masks[documents] = block_mask
        return compiled(q, k, v, block_mask=block_mask, enable_gqa=k.size(1) != q.size(1))

    return attend


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor,
                       dropout_p: float, sdpa=F.scaled_dot_product_attention) -> torch.Tensor:
    """(B, H, T, hd) queries over (B, Hkv, T, hd) keys and values, each token attending to the
    tokens of its own document up to itself; ``documents`` (B, T). ``sdpa``: the device's SDPA
    kernel, for the masked path."""
    if q.device.type == "cuda" and dropout_p == 0.0:  # FlexAttention has no dropout
        return _flex_document_attention()(q, k, v, documents)
    t = torch.arange(q.size(2), device=q.device)
    return sdpa(q, k, v, attn_mask=document_mask(documents, documents, t, t), dropout_p=dropout_p,
                enable_gqa=k.size(1) != q.size(1))
