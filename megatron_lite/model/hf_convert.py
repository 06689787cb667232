"""Hugging Face transformers <-> megatron_lite weight and config conversion (both directions).

Supported: ``LlamaForCausalLM`` (incl. grouped-query attention), ``Qwen3ForCausalLM`` (Llama
with per-head query/key norms: ``model.qk_norm``) and ``GPT2LMHeadModel``.
Llama's layout matches ours name for name; GPT-2 fuses q/k/v into one ``Conv1D`` whose weights
are stored transposed. RoPE uses the same half-split layout as HF's ``rotate_half``, so Llama
q/k weights copy without permutation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from megatron_lite.config.schema import ModelConfig
from megatron_lite.model.transformer import VOCAB_PARAMETERS

StateDict = dict[str, torch.Tensor]


def _rope_theta(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    if "rope_theta" in params:
        return float(params["rope_theta"])
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ValueError(f"RoPE scaling {scaling} is not supported")
    return float(getattr(hf_config, "rope_theta", 10000.0))


def llama_config_from_hf(hf: Any) -> ModelConfig:
    if bool(getattr(hf, "attention_bias", False)) != bool(getattr(hf, "mlp_bias", False)):
        raise ValueError("Llama configs with biases in attention but not the MLP (or the reverse) "
                         "are not supported: model.bias covers both")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    if head_dim * hf.num_attention_heads != hf.hidden_size:
        raise ValueError(f"{hf.model_type} head_dim {head_dim} × {hf.num_attention_heads} heads is not the "
                         f"hidden size {hf.hidden_size}: this model's head width is d_model / n_heads")
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"{hf.model_type} hidden_act '{hf.hidden_act}' is not supported; "
                         "model.activation=swiglu is SiLU-gated ('silu')")
    return ModelConfig(
        vocab_size=hf.vocab_size, vocab_multiple=1, n_layers=hf.num_hidden_layers,
        n_heads=hf.num_attention_heads, n_kv_heads=hf.num_key_value_heads, d_model=hf.hidden_size,
        ffn_hidden=hf.intermediate_size, max_seq_len=hf.max_position_embeddings,
        position="rope", rope_theta=_rope_theta(hf), norm="rmsnorm", norm_eps=hf.rms_norm_eps,
        activation="swiglu", bias=bool(getattr(hf, "attention_bias", False)),
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
    )


def qwen3_config_from_hf(hf: Any) -> ModelConfig:
    if getattr(hf, "use_sliding_window", False):
        raise ValueError("Qwen3 configs with sliding-window attention are not supported")
    if getattr(hf, "attention_bias", False):
        raise ValueError("Qwen3 configs with attention biases are not supported (its MLP has none; "
                         "model.bias covers both)")
    return dataclasses.replace(llama_config_from_hf(hf), qk_norm=True)


# transformers' GPT-2 activation names -> ours. Its "gelu" is the exact (erf) form; "gelu_new" and
# "gelu_pytorch_tanh" are the tanh approximation GPT-2 was trained with.
GPT2_ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact"}


def gpt2_config_from_hf(hf: Any) -> ModelConfig:
    activation = GPT2_ACTIVATIONS.get(hf.activation_function)
    if activation is None:
        raise ValueError(f"GPT-2 activation_function '{hf.activation_function}' is not supported; "
                         f"choose one of {sorted(GPT2_ACTIVATIONS)}")
    if not getattr(hf, "scale_attn_weights", True) or getattr(hf, "scale_attn_by_inverse_layer_idx", False):
        raise ValueError("GPT-2 configs that scale attention other than by 1/sqrt(head width) "
                         "(scale_attn_weights=false or scale_attn_by_inverse_layer_idx=true) "
                         "are not supported")
    return ModelConfig(
        vocab_size=hf.vocab_size, vocab_multiple=1, n_layers=hf.n_layer, n_heads=hf.n_head,
        d_model=hf.n_embd, ffn_hidden=hf.n_inner or 4 * hf.n_embd, max_seq_len=hf.n_positions,
        position="learned", norm="layernorm", norm_eps=hf.layer_norm_epsilon, activation=activation,
        bias=True, tie_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
    )


# Llama: our names mirror HF's, under shorter prefixes.
_LLAMA_LAYER = {
    "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
    "attn.q_proj": "self_attn.q_proj", "attn.k_proj": "self_attn.k_proj",
    "attn.v_proj": "self_attn.v_proj", "attn.o_proj": "self_attn.o_proj",
    "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.up_proj", "mlp.down_proj": "mlp.down_proj",
}

# Qwen3 is Llama with these.
_QWEN3_QK_NORMS = {"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}


def _llama_names(cfg: ModelConfig) -> dict[str, str]:
    """Our parameter name -> HF's, for every parameter of a Llama-style model."""
    names = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}
    layer = {**_LLAMA_LAYER, **(_QWEN3_QK_NORMS if cfg.qk_norm else {})}
    for i in range(cfg.n_layers):
        for ours, theirs in layer.items():
            names[f"blocks.{i}.{ours}.weight"] = f"model.layers.{i}.{theirs}.weight"
            if cfg.bias and not ours.endswith("_norm"):
                names[f"blocks.{i}.{ours}.bias"] = f"model.layers.{i}.{theirs}.bias"
    return names


def llama_from_hf(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> StateDict:
    """HF ``LlamaForCausalLM`` (or ``Qwen3ForCausalLM``) state dict -> ours (a tied model may
    omit ``lm_head.weight``)."""
    sd = dict(sd)
    sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
    return {ours: sd[theirs] for ours, theirs in _llama_names(cfg).items()}


def llama_to_hf(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> StateDict:
    """Our state dict -> HF ``LlamaForCausalLM`` (``Qwen3ForCausalLM`` with ``qk_norm``)."""
    return {theirs: sd[ours] for ours, theirs in _llama_names(cfg).items()}


# GPT-2 names (ours <- HF); HF fuses q/k/v into one Conv1D (weights stored (in, out)).
_GPT2_LAYER = {"attn_norm": "ln_1", "mlp_norm": "ln_2", "attn.o_proj": "attn.c_proj",
               "mlp.up_proj": "mlp.c_fc", "mlp.down_proj": "mlp.c_proj"}
_GPT2_CONV1D = {"attn.o_proj", "mlp.up_proj", "mlp.down_proj"}


def gpt2_from_hf(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> StateDict:
    """HF ``GPT2LMHeadModel`` state dict -> ours."""
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    out: StateDict = {"tok_emb.weight": sd["wte.weight"], "pos_emb.weight": sd["wpe.weight"],
                      "norm.weight": sd["ln_f.weight"], "norm.bias": sd["ln_f.bias"]}
    out["lm_head.weight"] = out["tok_emb.weight"] if cfg.tie_embeddings else sd["lm_head.weight"]
    for i in range(cfg.n_layers):
        o = f"blocks.{i}."
        for ours, theirs in _GPT2_LAYER.items():
            w = sd[f"h.{i}.{theirs}.weight"]
            out[o + f"{ours}.weight"] = w.t().contiguous() if ours in _GPT2_CONV1D else w
            out[o + f"{ours}.bias"] = sd[f"h.{i}.{theirs}.bias"]
        q, k, v = sd[f"h.{i}.attn.c_attn.weight"].t().chunk(3, dim=0)
        qb, kb, vb = sd[f"h.{i}.attn.c_attn.bias"].chunk(3)
        for name, w, b in (("q", q, qb), ("k", k, kb), ("v", v, vb)):
            out[o + f"attn.{name}_proj.weight"] = w.contiguous()
            out[o + f"attn.{name}_proj.bias"] = b
    return out


def gpt2_to_hf(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> StateDict:
    """Our state dict -> HF ``GPT2LMHeadModel``."""
    out: StateDict = {"transformer.wte.weight": sd["tok_emb.weight"],
                      "transformer.wpe.weight": sd["pos_emb.weight"],
                      "transformer.ln_f.weight": sd["norm.weight"],
                      "transformer.ln_f.bias": sd["norm.bias"],
                      "lm_head.weight": sd["tok_emb.weight" if cfg.tie_embeddings else "lm_head.weight"]}
    for i in range(cfg.n_layers):
        o, h = f"blocks.{i}.", f"transformer.h.{i}."
        for ours, theirs in _GPT2_LAYER.items():
            w = sd[o + f"{ours}.weight"]
            out[h + f"{theirs}.weight"] = w.t().contiguous() if ours in _GPT2_CONV1D else w
            out[h + f"{theirs}.bias"] = sd[o + f"{ours}.bias"]
        out[h + "attn.c_attn.weight"] = torch.cat(
            [sd[o + f"attn.{n}_proj.weight"] for n in "qkv"], dim=0).t().contiguous()
        out[h + "attn.c_attn.bias"] = torch.cat([sd[o + f"attn.{n}_proj.bias"] for n in "qkv"])
    return out


def from_hf(hf_model: Any) -> tuple[ModelConfig, StateDict]:
    """Config and state dict of ours for a transformers ``LlamaForCausalLM``/``Qwen3ForCausalLM``/
    ``GPT2LMHeadModel``."""
    kind = hf_model.config.model_type
    sd = hf_model.state_dict()
    if kind == "llama":
        cfg = llama_config_from_hf(hf_model.config)
        return cfg, llama_from_hf(sd, cfg)
    if kind == "qwen3":
        cfg = qwen3_config_from_hf(hf_model.config)
        return cfg, llama_from_hf(sd, cfg)
    if kind == "gpt2":
        cfg = gpt2_config_from_hf(hf_model.config)
        return cfg, gpt2_from_hf(sd, cfg)
    raise ValueError(f"model type '{kind}' is not supported; choose a 'llama', 'qwen3' or 'gpt2' model")


def _check_exportable(cfg: ModelConfig) -> None:
    """Refuse, naming every field at once, a model that the transformers class it exports as
    (by ``model.position``, and ``qk_norm``) would compute differently."""
    if cfg.position == "learned":
        target, needs = "GPT-2", {"norm": ("layernorm",), "activation": ("gelu", "gelu_exact"),
                                  "bias": (True,), "n_kv_heads": (None, cfg.n_heads), "qk_norm": (False,)}
    elif cfg.qk_norm:
        target, needs = "Qwen3", {"norm": ("rmsnorm",), "activation": ("swiglu",), "bias": (False,)}
    else:
        target, needs = "Llama", {"norm": ("rmsnorm",), "activation": ("swiglu",)}
    wrong = [f"model.{field}={getattr(cfg, field)!r} (needs {' or '.join(map(repr, allowed))})"
             for field, allowed in needs.items() if getattr(cfg, field) not in allowed]
    if wrong:
        raise ValueError(f"this model (model.position={cfg.position}, qk_norm={cfg.qk_norm}) exports as "
                         f"{target}, which it does not match: " + "; ".join(wrong))


def to_hf(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> tuple[Any, StateDict]:
    """A transformers config and state dict for our model (Llama-style, Qwen3-style with
    ``qk_norm``, or GPT-2-style)."""
    from transformers import GPT2Config, LlamaConfig, Qwen3Config

    used = cfg.tokenizer_vocab_size or cfg.vocab_size
    if used < cfg.vocab_size:  # the padding rows are ours alone
        sd = {k: v[:used] if k in VOCAB_PARAMETERS else v for k, v in sd.items()}
        cfg = dataclasses.replace(cfg, vocab_size=used)
    _check_exportable(cfg)
    if cfg.position == "learned":
        hf_cfg = GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.d_model,
                            n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=cfg.mlp_hidden,
                            layer_norm_epsilon=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
                            activation_function="gelu_new" if cfg.activation == "gelu" else "gelu")
        return hf_cfg, gpt2_to_hf(sd, cfg)
    if cfg.qk_norm:
        hf_cfg = Qwen3Config(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.mlp_hidden,
            num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len,
            rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, attention_bias=False,
            use_sliding_window=False, tie_word_embeddings=cfg.tie_embeddings,
        )
        return hf_cfg, llama_to_hf(sd, cfg)
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.mlp_hidden,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, attention_bias=cfg.bias, mlp_bias=cfg.bias,
        tie_word_embeddings=cfg.tie_embeddings,
    )
    return hf_cfg, llama_to_hf(sd, cfg)
