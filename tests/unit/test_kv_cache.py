"""The KV cache (model/kv_cache.py) and sampling with it (training/generate.py)."""

import pytest
import torch

from megatron_lite.config.schema import ModelConfig
from megatron_lite.model import build_model
from megatron_lite.model.kv_cache import KVCache
from megatron_lite.training.generate import sample

GPT = ModelConfig(vocab_size=48, n_layers=2, n_heads=4, d_model=32, ffn_hidden=64, max_seq_len=24,
                  position="learned", norm="layernorm", activation="gelu_exact", bias=True)
LLAMA = ModelConfig(vocab_size=48, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, ffn_hidden=64,
                    max_seq_len=24, position="rope", norm="rmsnorm", activation="swiglu", bias=False,
                    qk_norm=True)


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt", "llama-gqa"])
def test_tokens_fed_in_pieces_through_the_cache_give_the_full_forwards_logits(cfg):
    model = build_model(cfg, seed=3).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)  # (2, 20, V)
        cache, pieces = KVCache(cfg.max_seq_len), []
        for lo, hi in [(0, 7), (7, 8), (8, 9), (9, 13), (13, 20)]:  # a prompt, single tokens, chunks
            pieces.append(model(tokens[:, lo:hi], cache=cache))
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


def test_a_cache_refuses_more_positions_than_the_model_has():
    model = build_model(GPT, seed=0).eval()
    cache = KVCache(GPT.max_seq_len)
    with torch.no_grad():
        model(torch.zeros(1, 24, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="holds 24 positions; 25 were given"):
            model(torch.zeros(1, 1, dtype=torch.long), cache=cache)


def test_a_cache_is_refused_where_it_would_be_skipped():
    """Recomputed blocks (training mode) and document attention never see the cache: refused,
    not positions counted with nothing cached."""
    import dataclasses

    tokens = torch.zeros(1, 4, dtype=torch.long)
    model = build_model(dataclasses.replace(GPT, activation_checkpointing="full"), seed=0).train()
    with pytest.raises(ValueError, match="a KV cache is for sampling"):
        model(tokens, cache=KVCache(24))
    with pytest.raises(ValueError, match="a KV cache is for sampling"):
        model.eval()(tokens, documents=torch.zeros(1, 4, dtype=torch.long), cache=KVCache(24))


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt", "llama-gqa"])
def test_sampling_past_the_context_restarts_the_window_at_three_quarters(cfg):
    """Greedy tokens equal a plain loop of whole forwards over each token's window: all tokens
    while they fit, then from the last 18 (3/4 of 24) whenever the window is full."""
    model = build_model(cfg, seed=5).eval()
    prompt, n = [1, 2, 3, 4, 5], 40
    got = sample(model, prompt, n, cfg.max_seq_len, temperature=0.0, top_k=0, seed=0,
                 device=torch.device("cpu"))
    tokens, begin = list(prompt), 0
    with torch.no_grad():
        for _ in range(n):
            if len(tokens) - begin > 24:
                begin = len(tokens) - 18
            logits = model(torch.tensor([tokens[begin:]]))[0, -1]
            tokens.append(int(logits.argmax()))
    assert got == tokens[len(prompt):]
