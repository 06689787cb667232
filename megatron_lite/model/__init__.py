"""The model: one transformer for GPT- and Llama-style configs, FLOP accounting, HF converters."""

from __future__ import annotations

import dataclasses
import math

import torch

from megatron_lite.config.schema import ModelConfig
from megatron_lite.model.flops import count_parameters, flops_per_token, matmul_parameters
from megatron_lite.model.transformer import Transformer


def padded_vocab_size(vocab: int, multiple: int) -> int:
    """Vocabulary rounded up to ``multiple`` (Megatron pads for efficient matmul shapes, and to
    ``multiple × tensor`` so every tensor-parallel rank holds an equal slice)."""
    return multiple * math.ceil(vocab / multiple)


class VocabularyError(ValueError):
    """The recipe's model and its tokenizer do not fit together: the same on every rank, and
    fixed in the recipe (exit status 2, as a wrong layout)."""


def resolve_model(cfg: ModelConfig, tokenizer_vocab: int | None, seq_length: int,
                  tensor_parallel: int = 1, tokenizer_eod: int | None = None) -> ModelConfig:
    """Fill the fields a recipe may leave to the data: vocab size (padded), the tokenizer's
    vocabulary (the rows that are not padding), maximum length and end-of-document id."""
    vocab = cfg.vocab_size
    if vocab is None:
        if tokenizer_vocab is None:
            raise VocabularyError("'model.vocab_size' is null and no tokenizer gives one")
        vocab = padded_vocab_size(tokenizer_vocab, cfg.vocab_multiple * tensor_parallel)
    used = cfg.tokenizer_vocab_size or tokenizer_vocab or vocab
    if used > vocab:
        raise VocabularyError(f"model.vocab_size={vocab} is smaller than the tokenizer's vocabulary "
                              f"({used}): set it to null (sized from the tokenizer) or to at least that")
    eod = cfg.eod_id if cfg.eod_id is not None else tokenizer_eod
    return dataclasses.replace(cfg, vocab_size=vocab, tokenizer_vocab_size=used,
                               max_seq_len=cfg.max_seq_len or seq_length, eod_id=eod)


def padding_parameters(cfg: ModelConfig, recipe_vocab_size: int | None) -> int:
    """Parameters in the padding rows of the resolved ``cfg``'s vocabulary: the rows past the
    tokenizer's that ``model.vocab_multiple`` and tensor parallelism add (in the embedding, and
    the output layer unless tied). None where the recipe sets ``model.vocab_size``
    (``recipe_vocab_size``): every row of it is the model's, as in a model card's count."""
    if recipe_vocab_size is not None:
        return 0
    rows = cfg.vocab_size - (cfg.tokenizer_vocab_size or cfg.vocab_size)
    return rows * cfg.d_model * (1 if cfg.tie_embeddings else 2)


def padding_note(padding: int) -> str:
    """What follows a parameter count without the padding rows (``padding_parameters``)."""
    return f" (+{padding:,} in the vocabulary's padding rows)" if padding else ""


def require_document_end(cfg: ModelConfig, eod_mask_loss: bool) -> None:
    """Refuse the settings that need the id that ends each document when the resolved model
    (``resolve_model``, given the tokenizer's) has none, or one outside its vocabulary."""
    needs = ([f"model.attention_mask={cfg.attention_mask}"] if cfg.attention_mask == "document" else []) \
        + (["data.eod_mask_loss=true"] if eod_mask_loss else [])
    used = cfg.tokenizer_vocab_size or cfg.vocab_size
    if needs and cfg.eod_id is not None and not 0 <= cfg.eod_id < used:
        # An id no token has: no document would ever end (nor a loss be masked), without a word.
        raise VocabularyError(f"model.eod_id={cfg.eod_id} is not a token id of this vocabulary "
                              f"(0..{used - 1}); set the id that ends each document in the data, or null "
                              "for the tokenizer's")
    if needs and cfg.eod_id is None:
        verb = "need" if len(needs) > 1 else "needs"
        raise VocabularyError(f"{' and '.join(needs)} {verb} the id that ends each document, but the "
                              "tokenizer has none (a character tokenizer, say): set model.eod_id, or leave "
                              "them off")


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int = 0) -> Transformer:
    """The plain model with its parameters initialised on ``device`` from ``seed`` (``meta``
    allocates none)."""
    with torch.device(device):
        return Transformer(cfg, seed)


__all__ = [
    "Transformer", "VocabularyError", "build_model", "resolve_model", "require_document_end",
    "padded_vocab_size", "padding_parameters", "padding_note", "count_parameters", "flops_per_token",
    "matmul_parameters",
]
