"""Our model reproduces transformers' Llama (GQA), Qwen3 (per-head query/key norms) and GPT-2
logits from converted weights."""

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from megatron_lite.model import build_model
from megatron_lite.model.hf_convert import from_hf, to_hf


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                      rms_norm_eps=1e-6, rope_theta=500000.0, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def _tiny_qwen3() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg).eval()


def _tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=97, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).eval()


MODELS, IDS = [_tiny_llama, _tiny_qwen3, _tiny_gpt2], ["llama-gqa", "qwen3", "gpt2"]


@pytest.mark.parametrize("make_hf", MODELS, ids=IDS)
def test_logits_match_transformers(make_hf):
    hf = make_hf()
    with torch.no_grad():  # random init leaves biases/norms at constants; perturb them too
        for p in hf.parameters():
            p.add_(0.02 * torch.randn_like(p))
    cfg, sd = from_hf(hf)
    ours = build_model(cfg).eval()
    ours.load_state_dict(sd, strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("make_hf", MODELS, ids=IDS)
def test_round_trip_to_transformers(make_hf):
    hf = make_hf()
    cfg, sd = from_hf(hf)
    hf_cfg, hf_sd = to_hf(sd, cfg)
    rebuilt = type(hf)(hf_cfg).eval()
    rebuilt.load_state_dict(hf_sd, strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(tokens).logits, hf(tokens).logits, rtol=0, atol=1e-5)
