"""The fused q|k|v and gate|up projections compute what the separate ones did, their layouts
keep a tensor-parallel rank's contiguous slice whole, and the conversions round-trip."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.config.schema import ModelConfig
from megatron_lite.model import build_model
from megatron_lite.model.fused import (
    fusable,
    fuse_gate_up,
    fuse_qkv,
    fuse_state_dict,
    split_gate_up,
    split_qkv,
    unfuse_state_dict,
)
from megatron_lite.model.transformer import initial_value

LLAMA = ModelConfig(vocab_size=64, n_layers=2, n_heads=8, n_kv_heads=2, d_model=64, ffn_hidden=96,
                    max_seq_len=16, position="rope", norm="rmsnorm", activation="swiglu", bias=False,
                    qkv_bias=True)
GPT = ModelConfig(vocab_size=64, n_layers=2, n_heads=4, d_model=32, max_seq_len=16, position="learned",
                  norm="layernorm", activation="gelu_exact", bias=True)


def _separate(block, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Random separate projections for one block, as a model before the fusion held them."""
    g = torch.Generator().manual_seed(1)
    q_rows, kv_rows, d = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.d_model
    out = {name: torch.randn(rows, d, generator=g) * 0.2
           for name, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))}
    out |= {f"{name}_bias": torch.randn(rows, generator=g) * 0.2
            for name, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))}
    out |= {"gate": torch.randn(cfg.mlp_hidden, d, generator=g) * 0.2,
            "up": torch.randn(cfg.mlp_hidden, d, generator=g) * 0.2}
    return out


def test_fused_attention_and_mlp_are_the_separate_products():
    """The reference is written out here with one ``F.linear`` per separate projection and
    torch's grouped-query attention; the model holds the same weights fused."""
    cfg = LLAMA
    model = build_model(cfg).double()
    block = model.blocks["0"]
    w = {k: v.double() for k, v in _separate(block, cfg).items()}
    with torch.no_grad():
        block.attn.qkv_proj.weight.copy_(fuse_qkv(w["q"], w["k"], w["v"], cfg.n_heads, cfg.kv_heads))
        block.attn.qkv_proj.bias.copy_(fuse_qkv(w["q_bias"], w["k_bias"], w["v_bias"], cfg.n_heads,
                                                cfg.kv_heads))
        block.mlp.gate_up_proj.weight.copy_(fuse_gate_up(w["gate"], w["up"]))
    x = torch.randn(3, 16, cfg.d_model, dtype=torch.float64)
    B, T, hd = 3, 16, cfg.head_dim

    # Attention without RoPE (rope=None): the projections and the head grouping are what is tested.
    q = F.linear(x, w["q"], w["q_bias"]).view(B, T, cfg.n_heads, hd).transpose(1, 2)
    k = F.linear(x, w["k"], w["k_bias"]).view(B, T, cfg.kv_heads, hd).transpose(1, 2)
    v = F.linear(x, w["v"], w["v_bias"]).view(B, T, cfg.kv_heads, hd).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want = block.attn.o_proj(y.transpose(1, 2).reshape(B, T, -1))
    torch.testing.assert_close(block.attn(x, None), want, rtol=1e-5, atol=1e-5)

    h = F.silu(F.linear(x, w["gate"])) * F.linear(x, w["up"])
    torch.testing.assert_close(block.mlp(x), block.mlp.down_proj(h), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads, tp", [(8, 2, 2), (8, 8, 4), (4, 1, 1), (12, 4, 4)])
def test_a_contiguous_slice_of_fused_rows_is_a_rank_s_heads(heads, kv_heads, tp):
    """Tensor parallelism cuts the fused weight into ``tp`` contiguous row blocks: each must be
    the fusion of that rank's query heads with the key/value heads they share."""
    hd, d = 4, 8
    q, k, v = (torch.randn(n * hd, d) for n in (heads, kv_heads, kv_heads))
    fused = fuse_qkv(q, k, v, heads, kv_heads)
    for rank in range(tp):
        mine = fuse_qkv(q.chunk(tp)[rank], k.chunk(tp)[rank], v.chunk(tp)[rank], heads // tp, kv_heads // tp)
        torch.testing.assert_close(fused.chunk(tp)[rank], mine, rtol=0, atol=0)
    for part, back in zip((q, k, v), split_qkv(fused, heads, kv_heads), strict=True):
        torch.testing.assert_close(back, part, rtol=0, atol=0)

    gate, up = torch.randn(12, d), torch.randn(12, d)
    fused = fuse_gate_up(gate, up)
    for rank in range(tp if 12 % tp == 0 else 1):
        mine = fuse_gate_up(gate.chunk(tp)[rank], up.chunk(tp)[rank])
        torch.testing.assert_close(fused.chunk(tp)[rank], mine, rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(split_gate_up(fused), (gate, up), strict=True))


def test_shapes_that_are_not_those_heads_are_refused():
    with pytest.raises(ValueError, match="4 query and 2 key/value heads cannot have shapes"):
        fuse_qkv(torch.zeros(24, 8), torch.zeros(4, 8), torch.zeros(4, 8), 4, 2)


@pytest.mark.parametrize("cfg", [LLAMA, GPT], ids=["llama", "gpt"])
def test_state_dicts_convert_both_ways_and_initial_values_are_the_separate_ones(cfg):
    model = build_model(cfg, seed=3)
    fused = model.state_dict()
    separate = unfuse_state_dict(fused, cfg.n_heads, cfg.kv_heads)
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in separate)
    assert "blocks.1.attn.q_proj.weight" in separate
    assert ("blocks.1.mlp.gate_proj.weight" in separate) == (cfg.activation == "swiglu")
    back = fuse_state_dict(separate, cfg.n_heads, cfg.kv_heads)
    assert back.keys() == fused.keys()
    for name, value in fused.items():
        torch.testing.assert_close(back[name], value, rtol=0, atol=0, msg=name)
    # The model starts from the values the separate projections were drawn with, by their names.
    for name, value in separate.items():
        if name.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            torch.testing.assert_close(value, initial_value(cfg, name, value.shape, 3), rtol=0, atol=0)
    assert fusable(["a.attn.q_proj.weight", "a.attn.k_proj.weight"]) == {}  # no v: nothing to fuse


def test_fused_weight_init_keeps_its_standard_deviation():
    cfg = ModelConfig(vocab_size=64, n_layers=4, n_heads=8, n_kv_heads=2, d_model=256, max_seq_len=16,
                      activation="swiglu", position="rope", norm="rmsnorm", bias=False)
    model = build_model(cfg)
    for w in (model.blocks["0"].attn.qkv_proj.weight, model.blocks["0"].mlp.gate_up_proj.weight):
        assert w.std().item() == pytest.approx(cfg.init_std, rel=0.05)
    assert model.blocks["0"].mlp.down_proj.weight.std().item() == pytest.approx(
        cfg.init_std / math.sqrt(2 * cfg.n_layers), rel=0.05)
