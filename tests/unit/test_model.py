import dataclasses
import math

import pytest
import torch

from megatron_lite.config import load_config
from megatron_lite.config.schema import ModelConfig
from megatron_lite.model import build_model, count_parameters, flops_per_token, resolve_model
from tests.conftest import REPO


def _recipe_model(name: str, tokenizer_vocab: int | None = None, multiple: int | None = None) -> ModelConfig:
    cfg = load_config(REPO / "recipes" / name)
    model = cfg.model if multiple is None else dataclasses.replace(cfg.model, vocab_multiple=multiple)
    return resolve_model(model, tokenizer_vocab, cfg.data.seq_length)


def test_gpt2_small_parameter_count():
    # The published count is for the unpadded GPT-2 vocabulary (50257) and 1024 positions.
    cfg = _recipe_model("gpt2-124m.yaml", tokenizer_vocab=50257, multiple=1)
    assert cfg.max_seq_len == 1024
    assert count_parameters(build_model(cfg, "meta")) == 124_439_808


def test_llama2_7b_parameter_count():
    cfg = _recipe_model("llama2-7b.yaml")
    assert count_parameters(build_model(cfg, "meta")) == 6_738_415_616


def test_llama3_8b_parameter_count():
    cfg = _recipe_model("llama3-8b.yaml")
    assert count_parameters(build_model(cfg, "meta")) == 8_030_261_248


def test_flops_per_token_by_hand():
    # Llama-style, no biases: per layer qkv d·(H+2Hkv)·hd + proj d·d + SwiGLU 3·d·F + 2 norms d.
    d, L, V, T, F, H, Hkv = 64, 3, 100, 32, 96, 8, 2
    cfg = ModelConfig(vocab_size=V, n_layers=L, n_heads=H, n_kv_heads=Hkv, d_model=d, ffn_hidden=F,
                      max_seq_len=T)
    hd = d // H
    per_layer = d * (H + 2 * Hkv) * hd + d * d + 3 * d * F + 2 * d
    n = L * per_layer + d + V * d  # + final norm + output layer; input embedding excluded
    expected = 6 * n + 12 * L * d * T
    assert flops_per_token(cfg, T) == expected
    # ... and N is all parameters but the input embedding (untied model).
    assert n == count_parameters(build_model(cfg, "meta")) - V * d


def test_swiglu_hidden_matches_llama_rounding():
    assert ModelConfig(d_model=4096, ffn_multiple=256).mlp_hidden == 11008


def test_gqa_and_forward_shapes():
    cfg = ModelConfig(vocab_size=50, n_layers=2, n_heads=4, n_kv_heads=1, d_model=32, max_seq_len=16)
    model = build_model(cfg)
    assert model.blocks["0"].attn.qkv_proj.weight.shape == (32 + 2 * 8, 32)  # q, k, v heads of 8
    tokens = torch.randint(0, 50, (3, 16))
    assert model(tokens).shape == (3, 16, 50)
    assert model(tokens, tokens).dim() == 0


def test_causality():
    cfg = ModelConfig(vocab_size=50, n_layers=2, n_heads=4, d_model=32, max_seq_len=16)
    model = build_model(cfg).eval()
    a = torch.randint(0, 50, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 50
    torch.testing.assert_close(model(a)[0, :10], model(b)[0, :10])


def test_scaled_init():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, n_layers=8, n_heads=4, d_model=256, max_seq_len=16)
    model = build_model(cfg)
    assert model.blocks["0"].attn.qkv_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    down = model.blocks["0"].mlp.down_proj.weight
    assert down.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


@pytest.mark.parametrize("recompute", ["full", "selective"])
@pytest.mark.parametrize("position", ["rope", "learned"])
def test_activation_checkpointing_gives_same_loss_and_gradients(position, recompute):
    from megatron_lite.parallel.apply import use_selective_recompute

    base = ModelConfig(vocab_size=50, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, max_seq_len=16,
                       position=position, dropout=0.1, activation="swiglu", norm="rmsnorm")
    results = []
    for ckpt in ("none", recompute):
        torch.manual_seed(0)
        model = build_model(dataclasses.replace(base, activation_checkpointing=ckpt))
        use_selective_recompute(model)
        tokens = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
        loss = model(tokens, tokens)
        loss.backward()
        results.append([loss.detach(), *(p.grad.clone() for p in model.parameters())])
    for g0, g1 in zip(*results, strict=True):  # (dropout's masks replayed)
        torch.testing.assert_close(g0, g1)


def test_selective_recomputation_needs_the_ops_it_keeps():
    cfg = ModelConfig(vocab_size=50, n_layers=1, n_heads=2, d_model=16, max_seq_len=8,
                      activation_checkpointing="selective")
    tokens = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(RuntimeError, match="use_selective_recompute"):
        build_model(cfg)(tokens, tokens)


def test_tied_embeddings_share_storage():
    cfg = ModelConfig(vocab_size=50, n_layers=1, n_heads=2, d_model=16, max_seq_len=8, tie_embeddings=True)
    model = build_model(cfg)
    assert model.lm_head.weight is model.tok_emb.weight


def test_mfu_by_hand():
    from megatron_lite.distributed.device import peak_flops
    from megatron_lite.model.flops import mfu

    # GPT-2 124M (d 768, 12 layers, vocab 50304 tied, seq 1024) at 150,000 tokens/s on an A100
    # (N = 123,689,472 matmul parameters):
    # N = 12·(4·768² + 4·768 + 2·4·768² + 4·768 + 768 + 4·768 + 2·2·768) + 2·768 + 50304·768
    d, L, V, T = 768, 12, 50304, 1024
    cfg = ModelConfig(vocab_size=V, n_layers=L, n_heads=12, d_model=d, max_seq_len=T, position="learned",
                      norm="layernorm", activation="gelu", bias=True, tie_embeddings=True)
    per_layer = (4 * d * d + 4 * d) + (2 * 4 * d * d + 4 * d + d) + 2 * 2 * d
    n = L * per_layer + 2 * d + V * d
    fpt = 6 * n + 12 * L * d * T
    assert flops_per_token(cfg, T) == fpt
    peak = peak_flops("NVIDIA A100-SXM4-40GB", "bf16")
    assert peak == 312e12 and peak_flops("NVIDIA A100-SXM4-40GB", "fp32") == 156e12
    assert mfu(150_000, fpt, peak) == 150_000 * fpt / 312e12
    assert round(mfu(150_000, fpt, peak), 4) == 0.4112  # 855,383,040 FLOPs per token
    assert mfu(150_000, fpt, None) is None  # CPUs: no peak, no MFU
    # Recompute is not model FLOPs: checkpointing leaves the count unchanged.
    assert flops_per_token(dataclasses.replace(cfg, activation_checkpointing="full"), T) == fpt


@pytest.mark.parametrize("tie", [True, False])
def test_vocabulary_padding_is_not_part_of_the_model(tie):
    """The same 65-id model padded to 65 and to 72 rows: equal initial rows, zero padding,
    the same logits (over the 65 ids only) and loss, and no gradient into the padding."""
    base = dict(n_layers=2, n_heads=4, d_model=32, max_seq_len=16, tie_embeddings=tie, vocab_multiple=1)
    plain = build_model(resolve_model(ModelConfig(**base), 65, 16))
    padded_cfg = resolve_model(dataclasses.replace(ModelConfig(**base), vocab_multiple=8), 65, 16)
    assert (padded_cfg.vocab_size, padded_cfg.tokenizer_vocab_size) == (72, 65)
    padded = build_model(padded_cfg)
    for p, q in [(plain.tok_emb.weight, padded.tok_emb.weight),
                 (plain.lm_head.weight, padded.lm_head.weight)]:
        torch.testing.assert_close(q[:65], p, rtol=0, atol=0)
        assert not q[65:].any()
    tokens = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(0))
    assert padded(tokens).shape == (2, 16, 65)
    torch.testing.assert_close(padded(tokens), plain(tokens))
    loss = padded(tokens[:, :-1], tokens[:, 1:])
    torch.testing.assert_close(loss, plain(tokens[:, :-1], tokens[:, 1:]))
    loss.backward()
    assert not padded.lm_head.weight.grad[65:].any() and not padded.tok_emb.weight.grad[65:].any()


def test_a_tokenizer_larger_than_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="model.vocab_size=64 is smaller than the tokenizer's vocabulary"):
        resolve_model(ModelConfig(vocab_size=64), 65, 16)


def test_documents_and_positions_of_packed_tokens():
    from megatron_lite.model.transformer import document_ids, document_positions

    tokens = torch.tensor([[5, 7, 0, 3, 0, 0, 9, 4], [1, 2, 3, 4, 5, 6, 7, 0]])
    documents = document_ids(tokens == 0)
    # The end-of-document token (0) belongs to the document it ends, as in Megatron.
    assert documents.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0] * 8]
    assert document_positions(documents).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]


def test_document_attention_and_eod_mask_loss_need_an_end_of_document_id():
    from megatron_lite.model import require_document_end

    cfg = ModelConfig(vocab_size=64, attention_mask="document")
    with pytest.raises(ValueError, match="model.attention_mask=document and data.eod_mask_loss=true need "
                                         "the id that ends each document.*set model.eod_id"):
        require_document_end(resolve_model(cfg, 64, 16), True)  # a character tokenizer has none
    with pytest.raises(ValueError, match="^data.eod_mask_loss=true needs the id"):
        require_document_end(resolve_model(ModelConfig(vocab_size=64), 64, 16), True)
    require_document_end(resolve_model(ModelConfig(vocab_size=64), 64, 16), False)
    assert resolve_model(cfg, 64, 16, tokenizer_eod=3).eod_id == 3
    require_document_end(resolve_model(cfg, 64, 16, tokenizer_eod=3), True)
    assert resolve_model(dataclasses.replace(cfg, eod_id=5), 64, 16, tokenizer_eod=3).eod_id == 5
    with pytest.raises(ValueError, match=r"model.eod_id=64 is not a token id of this vocabulary \(0..63\)"):
        require_document_end(resolve_model(dataclasses.replace(cfg, eod_id=64), 64, 16), False)
    # An id that nothing uses is not checked: a causal run never reads it.
    require_document_end(resolve_model(ModelConfig(vocab_size=64, eod_id=64), 64, 16), False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention is the CUDA path; no GPU here")
def test_flex_attention_on_cuda_equals_the_masked_reference():
    """On CUDA, attention within documents runs FlexAttention with a block mask; it must equal
    SDPA with the boolean mask (the CPU's path), forward and backward, GQA included."""
    from megatron_lite.model.document_attention import document_attention, document_mask
    from megatron_lite.model.transformer import document_ids

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 50, (2, 256), generator=gen)
    tokens[0, [40, 41, 200]] = 0
    tokens[1, 130] = 0
    documents = document_ids(tokens == 0).cuda()
    q = torch.randn(2, 8, 256, 64, generator=gen)
    k, v = (torch.randn(2, 4, 256, 64, generator=gen) for _ in range(2))
    upstream = torch.randn(2, 8, 256, 64, generator=gen).cuda()
    leaves = [x.cuda().bfloat16().requires_grad_() for x in (q, k, v)]
    out = document_attention(*leaves, documents, 0.0)
    out.backward(upstream.bfloat16())
    ref_leaves = [x.detach().float().requires_grad_() for x in leaves]
    t = torch.arange(256, device="cuda")
    ref = torch.nn.functional.scaled_dot_product_attention(
        *ref_leaves, attn_mask=document_mask(documents, documents, t, t), enable_gqa=True)
    ref.backward(upstream)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    for name, got, want in zip("qkv", leaves, ref_leaves, strict=True):
        torch.testing.assert_close(got.grad.float(), want.grad, rtol=2e-2, atol=2e-2, msg=f"d{name}")
