"""Hugging Face transformers <-> megatron_lite weight and config conversion (both directions).

Supported: ``LlamaForCausalLM`` (incl. grouped-query attention), ``Qwen2ForCausalLM`` (Llama
with biases on q/k/v: ``model.qkv_bias``), ``Qwen3ForCausalLM`` (Llama with per-head query/key
norms: ``model.qk_norm``) and ``GPT2LMHeadModel``.
Llama's separate q/k/v and gate/up projections are fused into ours (``model/fused.py``: rows
regrouped, nothing else), the rest matches name for name; GPT-2 fuses q/k/v into one ``Conv1D``
in the order [Q|K|V], with its weights stored transposed. RoPE uses the same half-split layout as
HF's ``rotate_half``, so Llama q/k weights need no permutation within a head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from megatron_lite.config.schema import ModelConfig
from megatron_lite.model.fused import fuse_state_dict, unfuse_state_dict
from megatron_lite.model.transformer import VOCAB_PARAMETERS

StateDict = dict[str, torch.Tensor]


def _refuse(model_type: str, refusals: list[str]) -> None:
    """One error naming every such field at once: importing anyway would give a model whose
    logits differ from transformers' without a word."""
    if refusals:
        raise ValueError(f"cannot import this {model_type} model exactly: " + "; ".join(refusals))


LLAMA3_SCALING = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_low_freq_factor",
                  "high_freq_factor": "rope_high_freq_factor",
                  "original_max_position_embeddings": "rope_original_max_len"}
"""transformers' ``llama3`` RoPE parameters -> ours (``model.rope_scaling: llama3``)."""


def _rope(hf: Any) -> tuple[dict, list[str]]:
    """(our RoPE fields, refusals) of an HF config's RoPE, from whichever format carries it:
    transformers ≥ 5's ``rope_parameters`` (theta inside; an older config.json's
    ``rope_scaling`` is converted into it on load), or a transformers < 5 config's top-level
    ``rope_theta`` with a ``rope_scaling`` dict (None when unscaled). Implemented: transformers'
    ``rope_type`` "default" (unscaled) and "llama3"."""
    params = getattr(hf, "rope_parameters", None)
    source = "rope_parameters"
    if params is None:
        source, params = "rope_scaling", getattr(hf, "rope_scaling", None)
    params = dict(params or {})
    refusals = []
    # transformers < 4.45 named the rope type "type"; later versions keep both keys.
    key = "rope_type" if "rope_type" in params else "type"
    fields: dict = {}
    if params.get(key) == "llama3":
        missing = [k for k in LLAMA3_SCALING if params.get(k) is None]
        if missing:
            refusals.append(f"{source} of rope_type 'llama3' lacks {', '.join(missing)}")
        fields = {"rope_scaling": "llama3", **{ours: params[k] for k, ours in LLAMA3_SCALING.items()
                                                if params.get(k) is not None}}
    elif params.get(key, "default") != "default":
        refusals.append(f"{source}.{key}={params[key]!r} is not implemented (rope_type 'default' and "
                        "'llama3' are)")
    if params.get("partial_rotary_factor") not in (None, 1, 1.0):
        refusals.append(f"{source}.partial_rotary_factor={params['partial_rotary_factor']!r} is not "
                        "implemented (RoPE rotates the whole head)")
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
    return {"rope_theta": float(10000.0 if theta is None else theta), **fields}, refusals


def _hf_rope_scaling(cfg: ModelConfig) -> dict | None:
    """transformers' ``rope_scaling`` for ours (None: unscaled)."""
    if cfg.rope_scaling == "none":
        return None
    return {"rope_type": cfg.rope_scaling, **{k: getattr(cfg, ours) for k, ours in LLAMA3_SCALING.items()}}


def _llama_family(hf: Any) -> tuple[ModelConfig, list[str]]:
    """Our config for a Llama-style HF config, with the fields it carries that this model would
    compute differently (the caller refuses them, with its own)."""
    rope, refusals = _rope(hf)
    # Qwen3 and Llama before transformers 4.40 have no mlp_bias: their MLPs have no biases.
    attention_bias = bool(getattr(hf, "attention_bias", False))
    mlp_bias = bool(getattr(hf, "mlp_bias", False))
    if attention_bias != mlp_bias:
        mlp = f"mlp_bias={mlp_bias}" if hasattr(hf, "mlp_bias") else "an MLP without biases"
        refusals.append(f"attention_bias={attention_bias} with {mlp} is not implemented "
                        "(model.bias puts biases in both or neither)")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    if head_dim * hf.num_attention_heads != hf.hidden_size:
        refusals.append(f"head_dim={head_dim} is not implemented (a head here is hidden_size / "
                        f"num_attention_heads = {hf.hidden_size / hf.num_attention_heads:g} wide)")
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        refusals.append(f"hidden_act={act!r} is not implemented (model.activation=swiglu is SiLU-gated: "
                        "'silu')")
    # Per-layer attention kinds (sliding windows, chunked attention): every layer here is full causal.
    other = sorted({t for t in getattr(hf, "layer_types", None) or () if t != "full_attention"})
    if other:
        refusals.append(f"layer_types with {', '.join(map(repr, other))} is not implemented "
                        "(every layer's attention is full and causal)")
    cfg = ModelConfig(
        vocab_size=hf.vocab_size, vocab_multiple=1, n_layers=hf.num_hidden_layers,
        n_heads=hf.num_attention_heads, n_kv_heads=hf.num_key_value_heads, d_model=hf.hidden_size,
        ffn_hidden=hf.intermediate_size, max_seq_len=hf.max_position_embeddings,
        position="rope", **rope, norm="rmsnorm", norm_eps=hf.rms_norm_eps,
        activation="swiglu", bias=attention_bias,
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
    )
    return cfg, refusals


def llama_config_from_hf(hf: Any) -> ModelConfig:
    cfg, refusals = _llama_family(hf)
    _refuse(hf.model_type, refusals)
    return cfg


def _qwen_config(hf: Any, **differences: bool) -> ModelConfig:
    """Qwen2 and Qwen3 are Llama with ``differences`` (Qwen2: biases on q/k/v, always: its config
    has no switch for them; Qwen3: per-head query/key norms), and a sliding window we refuse."""
    cfg, refusals = _llama_family(hf)
    if getattr(hf, "use_sliding_window", False):
        refusals.append("use_sliding_window=True is not implemented (every layer's attention is full "
                        "and causal)")
    _refuse(hf.model_type, refusals)
    return dataclasses.replace(cfg, **differences)


def qwen2_config_from_hf(hf: Any) -> ModelConfig:
    return _qwen_config(hf, qkv_bias=True)


def qwen3_config_from_hf(hf: Any) -> ModelConfig:
    return _qwen_config(hf, qk_norm=True)


# transformers' GPT-2 activation names -> ours. Its "gelu" is the exact (erf) form; "gelu_new" and
# "gelu_pytorch_tanh" are the tanh approximation GPT-2 was trained with.
GPT2_ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact"}


def gpt2_config_from_hf(hf: Any) -> ModelConfig:
    refusals = []
    activation = GPT2_ACTIVATIONS.get(hf.activation_function)
    if activation is None:
        refusals.append(f"activation_function={hf.activation_function!r} is not implemented; choose one "
                        f"of {sorted(GPT2_ACTIVATIONS)}")
    scaled = "attention scores are scaled by 1/sqrt(head width) alone"
    for name, implemented, why in (
            ("scale_attn_weights", True, scaled), ("scale_attn_by_inverse_layer_idx", False, scaled),
            ("reorder_and_upcast_attn", False, "attention scores are computed in the model's precision"),
            ("add_cross_attention", False, "there is no encoder to attend to")):
        value = bool(getattr(hf, name, implemented))
        if value != implemented:
            refusals.append(f"{name}={value} is not implemented ({why})")
    _refuse(hf.model_type, refusals)
    return ModelConfig(
        vocab_size=hf.vocab_size, vocab_multiple=1, n_layers=hf.n_layer, n_heads=hf.n_head,
        d_model=hf.n_embd, ffn_hidden=hf.n_inner or 4 * hf.n_embd, max_seq_len=hf.n_positions,
        position="learned", norm="layernorm", norm_eps=hf.layer_norm_epsilon, activation=activation,
        bias=True, tie_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
    )


# Llama: our names mirror HF's, under shorter prefixes, before q/k/v and gate/up are fused
# (model/fused.py).
_LLAMA_LAYER = {
    "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
    "attn.q_proj": "self_attn.q_proj", "attn.k_proj": "self_attn.k_proj",
    "attn.v_proj": "self_attn.v_proj", "attn.o_proj": "self_attn.o_proj",
    "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.up_proj", "mlp.down_proj": "mlp.down_proj",
}

# Qwen3 is Llama with these.
_QWEN3_QK_NORMS = {"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}


_QKV = ("attn.q_proj", "attn.k_proj", "attn.v_proj")


def _llama_names(cfg: ModelConfig) -> dict[str, str]:
    """Our parameter name -> HF's, for every parameter of a Llama-style model."""
    names = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}
    layer = {**_LLAMA_LAYER, **(_QWEN3_QK_NORMS if cfg.qk_norm else {})}
    for i in range(cfg.n_layers):
        for ours, theirs in layer.items():
            names[f"blocks.{i}.{ours}.weight"] = f"model.layers.{i}.{theirs}.weight"
            if (cfg.bias and not ours.endswith("_norm")) or (cfg.qkv_bias and ours in _QKV):
                names[f"blocks.{i}.{ours}.bias"] = f"model.layers.{i}.{theirs}.bias"
    return names


def llama_from_hf(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> StateDict:
    """HF ``LlamaForCausalLM`` (or ``Qwen3ForCausalLM``) state dict -> ours (a tied model may
    omit ``lm_head.weight``)."""
    sd = dict(sd)
    sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
    return fuse_state_dict({ours: sd[theirs] for ours, theirs in _llama_names(cfg).items()},
                           cfg.n_heads, cfg.kv_heads)


def llama_to_hf(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> StateDict:
    """Our state dict -> HF ``LlamaForCausalLM`` (``Qwen3ForCausalLM`` with ``qk_norm``)."""
    sd = unfuse_state_dict(sd, cfg.n_heads, cfg.kv_heads)
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
    return fuse_state_dict(out, cfg.n_heads, cfg.kv_heads)


def gpt2_to_hf(sd: Mapping[str, torch.Tensor], cfg: ModelConfig) -> StateDict:
    """Our state dict -> HF ``GPT2LMHeadModel``."""
    sd = unfuse_state_dict(sd, cfg.n_heads, cfg.kv_heads)
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


def config_from_hf(hf_config: Any) -> ModelConfig:
    """Our config for a transformers Llama / Qwen3 / GPT-2 config; refuses, naming each, every
    field this model would compute differently."""
    converters = {"llama": llama_config_from_hf, "qwen2": qwen2_config_from_hf, "qwen3": qwen3_config_from_hf,
                  "gpt2": gpt2_config_from_hf}
    kind = hf_config.model_type
    if kind not in converters:
        raise ValueError(f"model type '{kind}' is not supported; choose a 'llama', 'qwen2', 'qwen3' or "
                         "'gpt2' model")
    return converters[kind](hf_config)


def from_hf(hf_model: Any) -> tuple[ModelConfig, StateDict]:
    """Config and state dict of ours for a transformers ``LlamaForCausalLM``/``Qwen3ForCausalLM``/
    ``GPT2LMHeadModel``."""
    cfg = config_from_hf(hf_model.config)
    convert = gpt2_from_hf if cfg.position == "learned" else llama_from_hf
    return cfg, convert(hf_model.state_dict(), cfg)


def _check_exportable(cfg: ModelConfig) -> None:
    """Refuse, naming every field at once, a model that the transformers class it exports as
    (by ``model.position``, and ``qk_norm``) would compute differently."""
    if cfg.position == "learned":
        target, needs = "GPT-2", {"norm": ("layernorm",), "activation": ("gelu", "gelu_exact"),
                                  "bias": (True,), "n_kv_heads": (None, cfg.n_heads), "qk_norm": (False,)}
    elif cfg.qk_norm:
        target, needs = "Qwen3", {"norm": ("rmsnorm",), "activation": ("swiglu",), "bias": (False,),
                                  "qkv_bias": (False,)}
    elif cfg.qkv_bias:
        target, needs = "Qwen2", {"norm": ("rmsnorm",), "activation": ("swiglu",), "bias": (False,)}
    else:
        target, needs = "Llama", {"norm": ("rmsnorm",), "activation": ("swiglu",)}
    wrong = [f"model.{field}={getattr(cfg, field)!r} (needs {' or '.join(map(repr, allowed))})"
             for field, allowed in needs.items() if getattr(cfg, field) not in allowed]
    if wrong:
        raise ValueError(f"this model (model.position={cfg.position}, qk_norm={cfg.qk_norm}) exports as "
                         f"{target}, which it does not match: " + "; ".join(wrong))


def to_hf(sd: Mapping[str, torch.Tensor], cfg: ModelConfig,
          token_ids: Mapping[str, Any] | None = None) -> tuple[Any, StateDict]:
    """A transformers config and state dict for our model (Llama-style, Qwen3-style with
    ``qk_norm``, or GPT-2-style). ``token_ids``: the config's special-token ids
    (``bos_token_id``, ...); the ones not given are null, never the class's defaults, which
    are ids of another vocabulary (GPT-2's 50256, Llama's 1 and 2)."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config, Qwen3Config

    ids = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **(token_ids or {})}

    used = cfg.tokenizer_vocab_size or cfg.vocab_size
    if used < cfg.vocab_size:  # the padding rows are ours alone
        sd = {k: v[:used] if k in VOCAB_PARAMETERS else v for k, v in sd.items()}
        cfg = dataclasses.replace(cfg, vocab_size=used)
    _check_exportable(cfg)
    if cfg.position == "learned":
        # n_inner None is GPT-2's own spelling of 4·n_embd: an imported config comes back as it was.
        n_inner = None if cfg.mlp_hidden == 4 * cfg.d_model else cfg.mlp_hidden
        hf_cfg = GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.d_model,
                            n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=n_inner,
                            layer_norm_epsilon=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
                            activation_function="gelu_new" if cfg.activation == "gelu" else "gelu",
                            # Not the class's 0.1: the model trains with model.dropout, in the same
                            # three places (attention weights, residual branches, embeddings).
                            attn_pdrop=cfg.dropout, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, **ids)
        return hf_cfg, gpt2_to_hf(sd, cfg)
    if cfg.qk_norm:
        hf_cfg = Qwen3Config(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.mlp_hidden,
            num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len,
            rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, attention_bias=False,
            use_sliding_window=False, tie_word_embeddings=cfg.tie_embeddings,
            rope_scaling=_hf_rope_scaling(cfg), attention_dropout=cfg.dropout, **ids,
        )
        return hf_cfg, llama_to_hf(sd, cfg)
    if cfg.qkv_bias:
        hf_cfg = Qwen2Config(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.mlp_hidden,
            num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.max_seq_len,
            rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, use_sliding_window=False,
            tie_word_embeddings=cfg.tie_embeddings, rope_scaling=_hf_rope_scaling(cfg),
            attention_dropout=cfg.dropout, **ids,
        )
        return hf_cfg, llama_to_hf(sd, cfg)
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.mlp_hidden,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, attention_bias=cfg.bias, mlp_bias=cfg.bias,
        tie_word_embeddings=cfg.tie_embeddings, rope_scaling=_hf_rope_scaling(cfg),
        attention_dropout=cfg.dropout, **ids,  # (transformers' Llama drops out nowhere else)
    )
    return hf_cfg, llama_to_hf(sd, cfg)
