"""Our model reproduces transformers' Llama (GQA), Qwen3 (per-head query/key norms) and GPT-2
logits from converted weights."""

import dataclasses

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


def _tiny_gpt2(**kwargs) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=97, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **kwargs)
    return GPT2LMHeadModel(cfg).eval()


def _tiny_gpt2_exact_gelu_untied() -> GPT2LMHeadModel:
    """transformers' "gelu" is the exact (erf) GELU: ours is model.activation=gelu_exact."""
    return _tiny_gpt2(activation_function="gelu", tie_word_embeddings=False)


MODELS = [_tiny_llama, _tiny_qwen3, _tiny_gpt2, _tiny_gpt2_exact_gelu_untied]
IDS = ["llama-gqa", "qwen3", "gpt2", "gpt2-exact-gelu-untied"]


def _perturbed(hf):
    """Random init leaves biases/norms at constants: perturb every weight, by enough that GELU's
    two forms give different logits."""
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return hf


@pytest.mark.parametrize("make_hf", MODELS, ids=IDS)
def test_logits_match_transformers(make_hf):
    hf = _perturbed(make_hf())
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
    hf = _perturbed(make_hf())
    cfg, sd = from_hf(hf)
    hf_cfg, hf_sd = to_hf(sd, cfg)
    rebuilt = type(hf)(hf_cfg).eval()
    rebuilt.load_state_dict(hf_sd, strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(tokens).logits, hf(tokens).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kwargs, named", [
    (dict(activation_function="relu"), "activation_function 'relu'"),
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    (dict(scale_attn_weights=False), "scale_attn_weights"),
])
def test_gpt2_variants_we_would_compute_differently_are_refused(kwargs, named):
    with pytest.raises(ValueError, match=named):
        from_hf(_tiny_gpt2(**kwargs))


def test_llama_with_another_activation_is_refused():
    hf = _tiny_llama()
    hf.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        from_hf(hf)


def test_export_refuses_a_model_its_target_class_would_compute_differently():
    """A learned-position model exports as GPT-2: RMSNorm, SwiGLU and no biases are each named."""
    cfg, sd = from_hf(_tiny_gpt2())
    odd = dataclasses.replace(cfg, norm="rmsnorm", activation="swiglu", bias=False)
    with pytest.raises(ValueError, match="exports as GPT-2") as err:
        to_hf(sd, odd)
    for field in ("model.norm='rmsnorm'", "model.activation='swiglu'", "model.bias=False"):
        assert field in str(err.value)
    llama_cfg, llama_sd = from_hf(_tiny_llama())
    with pytest.raises(ValueError, match=r"exports as Llama.*model.activation='gelu_exact'"):
        to_hf(llama_sd, dataclasses.replace(llama_cfg, activation="gelu_exact"))
