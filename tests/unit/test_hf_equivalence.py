"""Our model reproduces transformers' Llama (GQA), Qwen2 (biases on q/k/v), Qwen3 (per-head
query/key norms) and GPT-2 logits from converted weights."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from megatron_lite.model import build_model
from megatron_lite.model.hf_convert import config_from_hf, from_hf, to_hf

LLAMA = dict(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)


def _tiny_llama(**kwargs) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**LLAMA, "rope_theta": 500000.0, "tie_word_embeddings": False, **kwargs})
    return LlamaForCausalLM(cfg).eval()


def _tiny_llama_biased() -> LlamaForCausalLM:
    """attention_bias and mlp_bias together are model.bias."""
    return _tiny_llama(attention_bias=True, mlp_bias=True)


def _tiny_qwen3() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg).eval()


def _tiny_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                      rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).eval()


def _tiny_gpt2(**kwargs) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=97, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **kwargs)
    return GPT2LMHeadModel(cfg).eval()


def _tiny_gpt2_exact_gelu_untied() -> GPT2LMHeadModel:
    """transformers' "gelu" is the exact (erf) GELU: ours is model.activation=gelu_exact."""
    return _tiny_gpt2(activation_function="gelu", tie_word_embeddings=False)


def _tiny_llama3_scaled() -> LlamaForCausalLM:
    """Llama 3.1's RoPE scaling, its original context (16) well inside the tested lengths."""
    return _tiny_llama(rope_scaling=LLAMA3_ROPE)


MODELS = [_tiny_llama, _tiny_llama_biased, _tiny_llama3_scaled, _tiny_qwen2, _tiny_qwen3, _tiny_gpt2,
          _tiny_gpt2_exact_gelu_untied]
IDS = ["llama-gqa", "llama-biased", "llama3-rope-scaling", "qwen2", "qwen3", "gpt2", "gpt2-exact-gelu-untied"]


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


@pytest.mark.parametrize("make_hf", MODELS, ids=IDS)
def test_a_padded_vocabulary_is_exported_as_the_tokenizers_rows(make_hf):
    """Our model with its vocabulary padded (as a run pads it: rows past the tokenizer's are
    ours alone) exports the tokenizer's rows only, and transformers then computes our logits on
    them (Megatron's GPT-2: 50257 ids in 50304 rows)."""
    hf = _perturbed(make_hf())
    cfg, sd = from_hf(hf)
    used, rows = cfg.vocab_size, cfg.vocab_size + 13
    padded = dataclasses.replace(cfg, vocab_size=rows, tokenizer_vocab_size=used)
    ours = build_model(padded).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            value = sd[name]
            if p.shape[0] == rows and value.shape[0] == used:  # a vocabulary parameter: padding rows
                value = torch.cat([value, 0.3 * torch.randn(rows - used, *value.shape[1:])])
            p.copy_(value)
    hf_cfg, hf_sd = to_hf(dict(ours.state_dict()), padded)
    assert hf_cfg.vocab_size == used
    rebuilt = type(hf)(hf_cfg).eval()
    rebuilt.load_state_dict(hf_sd, strict=True)
    tokens = torch.randint(0, used, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(tokens).logits, ours(tokens)[..., :used], rtol=0, atol=1e-5)


# Bookkeeping and training-time dropout: not what the model computes at inference (and
# transformers' private fields, which its releases before 5 put in to_dict).
NOT_ARCHITECTURE = {"transformers_version", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
                    "pad_token_id", "use_cache", "initializer_range", "attn_pdrop", "resid_pdrop",
                    "embd_pdrop"}


@pytest.mark.parametrize("make_hf", MODELS, ids=IDS)
def test_export_writes_back_every_architecture_field_it_imported(make_hf):
    hf = make_hf()
    hf_cfg, _ = to_hf(*reversed(from_hf(hf)))
    before, after = hf.config.to_dict(), hf_cfg.to_dict()
    fields = {f for f in before.keys() | after.keys() if not f.startswith("_")} - NOT_ARCHITECTURE
    for field in sorted(fields):
        assert after.get(field) == before.get(field), field


@pytest.mark.parametrize("kwargs, named", [
    (dict(activation_function="relu"), "activation_function='relu' is not implemented"),
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx=True is not implemented"),
    (dict(scale_attn_weights=False), "scale_attn_weights=False is not implemented"),
    (dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn=True is not implemented"),
    (dict(add_cross_attention=True), "add_cross_attention=True is not implemented"),
])
def test_gpt2_variants_we_would_compute_differently_are_refused(kwargs, named):
    with pytest.raises(ValueError, match=named):
        from_hf(_tiny_gpt2(**kwargs))


def test_llama_with_another_activation_is_refused():
    hf = _tiny_llama()
    hf.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act='gelu' is not implemented"):
        from_hf(hf)


def _transformers4_llama(**fields) -> SimpleNamespace:
    """A Llama config as transformers < 5 gives it: ``rope_theta`` at the top and ``rope_scaling``
    a dict or None, no ``rope_parameters``."""
    return SimpleNamespace(**{**LLAMA, "model_type": "llama", "hidden_act": "silu", "attention_bias": False,
                              "mlp_bias": False, "tie_word_embeddings": False, "rope_theta": 500000.0,
                              "rope_scaling": None, **fields})


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize("make_config, named", [
    (lambda: LlamaConfig(**LLAMA, rope_parameters={"rope_theta": 500000.0, **YARN}),
     "rope_parameters.rope_type='yarn' is not implemented"),
    # An older config.json's rope_scaling: transformers 5 moves it into rope_parameters.
    # (transformers 4 keeps it as rope_scaling, and the message names the field it has.)
    (lambda: LlamaConfig(**LLAMA, rope_theta=500000.0, rope_scaling=YARN),
     "rope_(parameters|scaling).rope_type='yarn' is not implemented"),
    (lambda: LlamaConfig(**LLAMA, rope_scaling={"type": "linear", "factor": 2.0}),
     "rope_(parameters|scaling).rope_type='linear' is not implemented"),
    (lambda: _transformers4_llama(rope_scaling=YARN),
     "rope_scaling.rope_type='yarn' is not implemented"),
    (lambda: _transformers4_llama(rope_scaling={"type": "dynamic", "factor": 2.0}),
     "rope_scaling.type='dynamic' is not implemented"),
    (lambda: _transformers4_llama(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
     "rope_scaling of rope_type 'llama3' lacks low_freq_factor, high_freq_factor, "
     "original_max_position_embeddings"),
    (lambda: LlamaConfig(**LLAMA, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                   "partial_rotary_factor": 0.5}),
     "rope_parameters.partial_rotary_factor=0.5 is not implemented"),
], ids=["rope_parameters", "rope_scaling-in-config.json", "old-type-key", "transformers4-rope_scaling",
        "transformers4-type-key", "llama3-incomplete", "partial-rotary"])
def test_scaled_or_partial_rope_is_refused_in_every_config_format(make_config, named):
    with pytest.raises(ValueError, match=named):
        config_from_hf(make_config())


@pytest.mark.parametrize("make_config", [
    lambda: LlamaConfig(**LLAMA, rope_parameters={"rope_theta": 500000.0, **LLAMA3_ROPE}),
    lambda: LlamaConfig(**LLAMA, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    lambda: _transformers4_llama(rope_scaling=LLAMA3_ROPE),
], ids=["rope_parameters", "rope_scaling-in-config.json", "transformers4-rope_scaling"])
def test_llama3_rope_scaling_is_read_from_every_config_format(make_config):
    cfg = config_from_hf(make_config())
    assert (cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
            cfg.rope_original_max_len, cfg.rope_theta) == ("llama3", 8.0, 1.0, 4.0, 16, 500000.0)


def test_unscaled_rope_theta_is_read_from_every_config_format():
    assert config_from_hf(_transformers4_llama()).rope_theta == 500000.0
    assert config_from_hf(_transformers4_llama(rope_scaling={"rope_type": "default"})).rope_theta == 500000.0
    assert config_from_hf(LlamaConfig(**LLAMA, rope_theta=250000.0)).rope_theta == 250000.0


def test_every_field_this_model_does_not_implement_is_named_in_one_line():
    hf = LlamaConfig(**LLAMA, rope_parameters={"rope_theta": 500000.0, **YARN}, attention_bias=True,
                     head_dim=16, hidden_act="gelu")
    with pytest.raises(ValueError) as err:
        config_from_hf(hf)
    message = str(err.value)
    assert "\n" not in message
    for named in ("rope_parameters.rope_type='yarn'", "attention_bias=True with mlp_bias=False",
                  "head_dim=16", "hidden_act='gelu'"):
        assert named in message


@pytest.mark.parametrize("kwargs, named", [
    (dict(use_sliding_window=True, max_window_layers=1), "use_sliding_window=True is not implemented"),
    (dict(layer_types=["full_attention", "sliding_attention"]),
     "layer_types with 'sliding_attention' is not implemented"),
    (dict(attention_bias=True), "attention_bias=True with an MLP without biases is not implemented"),
    (dict(head_dim=16), "head_dim=16 is not implemented"),
])
def test_qwen3_variants_we_would_compute_differently_are_refused(kwargs, named):
    cfg = Qwen3Config(**{**LLAMA, "head_dim": 8, **kwargs})
    with pytest.raises(ValueError, match=named):
        config_from_hf(cfg)


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


@pytest.mark.parametrize("make_hf", MODELS, ids=IDS)
def test_export_writes_the_given_token_ids_and_null_for_the_others(make_hf):
    """Not the target class's defaults (GPT-2's 50256, Llama's 1 and 2): ids of another
    vocabulary."""
    cfg, sd = from_hf(make_hf())
    hf_cfg, _ = to_hf(sd, cfg, {"bos_token_id": 5, "eos_token_id": [6, 7]})
    assert (hf_cfg.bos_token_id, hf_cfg.eos_token_id, hf_cfg.pad_token_id) == (5, [6, 7], None)
    hf_cfg, _ = to_hf(sd, cfg)
    assert (hf_cfg.bos_token_id, hf_cfg.eos_token_id, hf_cfg.pad_token_id) == (None, None, None)


@pytest.mark.parametrize("make_hf", MODELS, ids=IDS)
def test_export_writes_the_models_dropout_not_the_classes_default(make_hf):
    """GPT2Config's default is 0.1 in three places: a model trained without dropout, exported
    with it, gave other logits at every call in training mode (continued training elsewhere)."""
    cfg, sd = from_hf(make_hf())
    for dropout in (0.0, 0.2):
        hf_cfg, hf_sd = to_hf(sd, dataclasses.replace(cfg, dropout=dropout))
        names = (("attn_pdrop", "resid_pdrop", "embd_pdrop") if isinstance(hf_cfg, GPT2Config)
                 else ("attention_dropout",))
        assert [getattr(hf_cfg, n) for n in names] == [dropout] * len(names)
    hf_cfg, hf_sd = to_hf(sd, dataclasses.replace(cfg, dropout=0.0))
    hf = type(make_hf())(hf_cfg).train()
    hf.load_state_dict(hf_sd, strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, hf(tokens).logits, rtol=0, atol=0)
