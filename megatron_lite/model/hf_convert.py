"""Hugging Face transformers <-> megatron_lite weight and config conversion (both directions).

Supported: ``LlamaForCausalLM`` (incl. grouped-query attention) and ``GPT2LMHeadModel``.
Our attention and MLP fuse their input projections ([q|k|v] and [gate|up]); HF keeps them apart
(Llama) or fuses them as ``Conv1D`` with transposed weights (GPT-2). RoPE uses the same
half-split layout as HF's ``rotate_half``, so Llama q/k weights copy without permutation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from megatron_lite.config.schema import ModelConfig
from megatron_lite.model.transformer import ffn_hidden_size

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
    return ModelConfig(
        vocab_size=hf.vocab_size, vocab_multiple=1, n_layers=hf.num_hidden_layers,
        n_heads=hf.num_attention_heads, n_kv_heads=hf.num_key_value_heads, d_model=hf.hidden_size,
        ffn_hidden=hf.intermediate_size, max_seq_len=hf.max_position_embeddings,
        position="rope", rope_theta=_rope_theta(hf), norm="rmsnorm", norm_eps=hf.rms_norm_eps,
        activation="swiglu", bias=bool(getattr(hf, "attention_bias", False)),
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
    )


def gpt2_config_from_hf(hf: Any) -> ModelConfig:
    return ModelConfig(
        vocab_size=hf.vocab_size, vocab_multiple=1, n_layers=hf.n_layer, n_heads=hf.n_head,
        d_model=hf.n_embd, ffn_hidden=hf.n_inner or 4 * hf.n_embd, max_seq_len=hf.n_positions,
        position="learned", norm="layernorm", norm_eps=hf.layer_norm_epsilon, activation="gelu",
        bias=True, tie_embeddings=True,
    )


def llama_from_hf(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> StateDict:
    """HF ``LlamaForCausalLM`` state dict -> ours."""
    out: StateDict = {"tok_emb.weight": sd["model.embed_tokens.weight"],
                      "norm.weight": sd["model.norm.weight"]}
    out["lm_head.weight"] = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.n_layers):
        h, o = f"model.layers.{i}.", f"blocks.{i}."
        out[o + "attn_norm.weight"] = sd[h + "input_layernorm.weight"]
        out[o + "mlp_norm.weight"] = sd[h + "post_attention_layernorm.weight"]
        for kind in ("weight", "bias") if cfg.bias else ("weight",):
            out[o + f"attn.qkv.{kind}"] = torch.cat(
                [sd[h + f"self_attn.{p}_proj.{kind}"] for p in "qkv"], dim=0)
        out[o + "attn.proj.weight"] = sd[h + "self_attn.o_proj.weight"]
        if cfg.bias:
            out[o + "attn.proj.bias"] = sd[h + "self_attn.o_proj.bias"]
        out[o + "mlp.up.weight"] = torch.cat(
            [sd[h + "mlp.gate_proj.weight"], sd[h + "mlp.up_proj.weight"]], dim=0)
        out[o + "mlp.down.weight"] = sd[h + "mlp.down_proj.weight"]
    return out


def llama_to_hf(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> StateDict:
    """Our state dict -> HF ``LlamaForCausalLM``."""
    head_dim = cfg.d_model // cfg.n_heads
    q_size, kv_size = cfg.n_heads * head_dim, (cfg.n_kv_heads or cfg.n_heads) * head_dim
    ffn = ffn_hidden_size(cfg)
    out: StateDict = {"model.embed_tokens.weight": sd["tok_emb.weight"],
                      "model.norm.weight": sd["norm.weight"], "lm_head.weight": sd["lm_head.weight"]}
    for i in range(cfg.n_layers):
        h, o = f"model.layers.{i}.", f"blocks.{i}."
        out[h + "input_layernorm.weight"] = sd[o + "attn_norm.weight"]
        out[h + "post_attention_layernorm.weight"] = sd[o + "mlp_norm.weight"]
        for kind in ("weight", "bias") if cfg.bias else ("weight",):
            q, k, v = sd[o + f"attn.qkv.{kind}"].split([q_size, kv_size, kv_size], dim=0)
            out.update({h + f"self_attn.q_proj.{kind}": q, h + f"self_attn.k_proj.{kind}": k,
                        h + f"self_attn.v_proj.{kind}": v})
        out[h + "self_attn.o_proj.weight"] = sd[o + "attn.proj.weight"]
        if cfg.bias:
            out[h + "self_attn.o_proj.bias"] = sd[o + "attn.proj.bias"]
        gate, up = sd[o + "mlp.up.weight"].split([ffn, ffn], dim=0)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
        out[h + "mlp.down_proj.weight"] = sd[o + "mlp.down.weight"]
    return out


# GPT-2 names (ours <- HF); Conv1D weights are stored (in, out) and are transposed.
_GPT2_LAYER = {
    "attn_norm": "ln_1", "mlp_norm": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
    "mlp.up": "mlp.c_fc", "mlp.down": "mlp.c_proj",
}
_GPT2_CONV1D = {"attn.qkv", "attn.proj", "mlp.up", "mlp.down"}


def gpt2_from_hf(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> StateDict:
    """HF ``GPT2LMHeadModel`` state dict -> ours."""
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    out: StateDict = {"tok_emb.weight": sd["wte.weight"], "pos_emb.weight": sd["wpe.weight"],
                      "norm.weight": sd["ln_f.weight"], "norm.bias": sd["ln_f.bias"]}
    out["lm_head.weight"] = out["tok_emb.weight"]
    for i in range(cfg.n_layers):
        for ours, theirs in _GPT2_LAYER.items():
            w = sd[f"h.{i}.{theirs}.weight"]
            out[f"blocks.{i}.{ours}.weight"] = w.t().contiguous() if ours in _GPT2_CONV1D else w
            out[f"blocks.{i}.{ours}.bias"] = sd[f"h.{i}.{theirs}.bias"]
    return out


def gpt2_to_hf(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> StateDict:
    """Our state dict -> HF ``GPT2LMHeadModel``."""
    out: StateDict = {"transformer.wte.weight": sd["tok_emb.weight"],
                      "transformer.wpe.weight": sd["pos_emb.weight"],
                      "transformer.ln_f.weight": sd["norm.weight"],
                      "transformer.ln_f.bias": sd["norm.bias"], "lm_head.weight": sd["tok_emb.weight"]}
    for i in range(cfg.n_layers):
        for ours, theirs in _GPT2_LAYER.items():
            w = sd[f"blocks.{i}.{ours}.weight"]
            out[f"transformer.h.{i}.{theirs}.weight"] = w.t().contiguous() if ours in _GPT2_CONV1D else w
            out[f"transformer.h.{i}.{theirs}.bias"] = sd[f"blocks.{i}.{ours}.bias"]
    return out


def from_hf(hf_model: Any) -> tuple[ModelConfig, StateDict]:
    """Config and state dict of ours for a transformers ``LlamaForCausalLM``/``GPT2LMHeadModel``."""
    kind = hf_model.config.model_type
    sd = hf_model.state_dict()
    if kind == "llama":
        cfg = llama_config_from_hf(hf_model.config)
        return cfg, llama_from_hf(sd, cfg)
    if kind == "gpt2":
        cfg = gpt2_config_from_hf(hf_model.config)
        return cfg, gpt2_from_hf(sd, cfg)
    raise ValueError(f"model type '{kind}' is not supported; choose a 'llama' or 'gpt2' model")


def to_hf(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> tuple[Any, StateDict]:
    """A transformers config and state dict for our model (Llama-style or GPT-2-style)."""
    from transformers import GPT2Config, LlamaConfig

    if cfg.position == "learned":
        hf_cfg = GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.d_model,
                            n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=ffn_hidden_size(cfg),
                            layer_norm_epsilon=cfg.norm_eps, activation_function="gelu_new")
        return hf_cfg, gpt2_to_hf(sd, cfg)
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=ffn_hidden_size(cfg),
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads or cfg.n_heads, max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, attention_bias=cfg.bias,
        tie_word_embeddings=cfg.tie_embeddings,
    )
    return hf_cfg, llama_to_hf(sd, cfg)
