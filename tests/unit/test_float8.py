"""model.fp8: torchao's float8 training swapped into the block linears (emulated on the CPU)."""

import dataclasses

import pytest
import torch
from torch import nn

from megatron_lite.config import load_config
from megatron_lite.config.schema import ModelConfig
from megatron_lite.distributed.device import float8_problem
from megatron_lite.model import build_model
from megatron_lite.model.float8 import convert_blocks_to_float8
from tests.conftest import REPO

LLAMA = ModelConfig(vocab_size=96, n_layers=2, n_heads=4, n_kv_heads=2, d_model=64, max_seq_len=32,
                    position="rope", norm="rmsnorm", activation="swiglu", ffn_multiple=32)


def _loss_and_grads(model: nn.Module, seed: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 96, (4, 32), generator=gen)
    y = torch.randint(0, 96, (4, 32), generator=gen)
    model.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("cfg", [LLAMA, dataclasses.replace(
    LLAMA, position="learned", norm="layernorm", activation="gelu_exact", bias=True, tie_embeddings=True,
    n_kv_heads=None)], ids=["llama", "gpt2"])
def test_block_linears_become_float8_with_the_same_parameters(cfg):
    from torchao.float8.float8_linear import Float8Linear

    model = build_model(cfg)
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    assert convert_blocks_to_float8(model) == 4 * cfg.n_layers  # q|k|v, o, gate|up or up, down
    # The very same Parameter objects under the same names: the optimizer, ZeRO and checkpoints
    # see no difference.
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert list(model.state_dict()) == keys
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert all(n.startswith("blocks.") for n in converted)
    assert not isinstance(model.lm_head, Float8Linear)


def test_float8_training_is_close_to_fp32_and_really_float8():
    torch.manual_seed(0)
    exact = build_model(LLAMA)
    fp8 = build_model(LLAMA)
    fp8.load_state_dict(exact.state_dict())
    convert_blocks_to_float8(fp8)
    loss, grads = _loss_and_grads(exact)
    loss8, grads8 = _loss_and_grads(fp8)
    torch.testing.assert_close(loss8, loss, rtol=2e-3, atol=0)
    for name, g in grads.items():
        cos = torch.nn.functional.cosine_similarity(g.flatten(), grads8[name].flatten(), dim=0)
        assert cos > 0.99, (name, cos)
    # Rounded through float8: the block weights' gradients are not fp32's.
    name = "blocks.0.mlp.gate_up_proj.weight"
    assert not torch.equal(grads[name], grads8[name])


def test_float8_needs_what_its_products_need():
    recipe = REPO / "recipes/shakespeare-char.yaml"
    with pytest.raises(ValueError) as err:
        load_config(recipe, ["model.fp8=true", "model.d_model=120", "model.n_heads=4", "parallel.tensor=2",
                             "training.micro_batch_size=3", "data.seq_length=7", "model.max_seq_len=64"])
    text = str(err.value)
    assert "'parallel.tensor' = 2" in text
    assert "multiples of 16, but qkv_proj 360 x 120" in text and "'model.d_model' = 120" in text
    assert "(3 × 7 = 21) to be a multiple of 16" in text
    load_config(recipe, ["model.fp8=true"])  # 128-wide, 768 tokens a micro-batch: accepted


def test_devices_without_a_float8_path_are_refused():
    class Accelerator:
        def __init__(self, kind: str):
            self.kind = kind

        def device_name(self) -> str:
            return self.kind

    assert float8_problem(Accelerator("cpu")) is None
    assert "does not run on hpu; set model.fp8=false" in float8_problem(Accelerator("hpu"))


def test_float8_without_torchao_is_refused_with_the_fix(monkeypatch):
    import sys

    from megatron_lite.model.float8 import float8_library_problem

    assert float8_library_problem() is None  # installed here
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao: ImportError
    problem = float8_library_problem()
    assert problem.startswith("'model.fp8' = true needs torchao's float8 training") and \
        "pip install torchao" in problem and "model.fp8=false" in problem


def test_compiled_float8_blocks_match_eager_ones():
    """training.compile after model.fp8 (the GPU recipes' combination): inductor fuses the casts
    and scales into the blocks; the loss and gradients stay eager float8's."""
    from megatron_lite.parallel.apply import compile_blocks

    torch._dynamo.reset()
    cfg = dataclasses.replace(LLAMA, n_layers=1)
    eager = build_model(cfg)
    compiled = build_model(cfg)
    compiled.load_state_dict(eager.state_dict())
    for model in (eager, compiled):
        convert_blocks_to_float8(model)
    assert compile_blocks(compiled, "inductor") == 1
    loss, grads = _loss_and_grads(eager)
    loss_c, grads_c = _loss_and_grads(compiled)
    torch.testing.assert_close(loss_c, loss, rtol=1e-4, atol=0)
    for name, g in grads.items():
        torch.testing.assert_close(grads_c[name], g, rtol=1e-3, atol=1e-5, msg=name)
