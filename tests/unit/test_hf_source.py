"""A Hugging Face directory read one block at a time (``checkpoint/hf_source.py``): every
parameter equals the conversion of the model in memory, whatever the files (safetensors or
.bin, sharded or whole, tied or not), and a reader that takes the parameters in the model's order
holds a block of the source at a time, not the whole."""

import subprocess
import sys

import pytest
import torch

from megatron_lite.checkpoint.convert import read_hf
from megatron_lite.checkpoint.hf_source import open_hf
from megatron_lite.model import build_model
from megatron_lite.model.hf_convert import from_hf
from tests.conftest import REPO


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=3, n_head=4))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48,
                                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=False))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=48,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=True))


@pytest.mark.parametrize("make,files", [
    pytest.param(_gpt2, dict(max_shard_size="20KB"), id="gpt2-tied-sharded-safetensors"),
    pytest.param(_llama, dict(safe_serialization=False, max_shard_size="20KB"), id="llama-gqa-sharded-bin"),
    pytest.param(_llama, {}, id="llama-gqa-safetensors"),
    pytest.param(_qwen2, dict(safe_serialization=False), id="qwen2-tied-bin"),
])
def test_every_parameter_equals_the_conversion_of_the_model_in_memory(tmp_path, make, files):
    torch.manual_seed(0)
    model = make()
    model.save_pretrained(tmp_path / "hf", **files)
    cfg, want = from_hf(model)
    got_cfg, weights, _ = open_hf(tmp_path / "hf")
    assert got_cfg == cfg
    assert weights.shapes == {k: tuple(v.shape) for k, v in want.items()}
    # In the model's order (as a rank builds it), twice over one name, then all at once.
    order = [name for name, _ in build_model(cfg, "meta").named_parameters()]
    for name in [*order, order[1], *(["lm_head.weight"] if cfg.tie_embeddings else [])]:
        got = weights[name]
        assert got.dtype == torch.float32 and got.is_contiguous()
        torch.testing.assert_close(got, want[name].float(), rtol=0, atol=0, msg=name)
    whole = read_hf(tmp_path / "hf")[1]
    assert whole.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(whole[name], value.float(), rtol=0, atol=0, msg=name)


def test_a_missing_tensor_is_named_before_any_weight_is_read(tmp_path):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    _llama().save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf/model.safetensors"
    sd = load_file(path)
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="its weights lack model.layers.1.mlp.up_proj.weight"):
        open_hf(tmp_path / "hf")


PEAK = """
import os, sys, torch
from megatron_lite.checkpoint.hf_source import open_hf
from megatron_lite.model import build_model

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

cfg, weights, _ = open_hf(sys.argv[1])
names = [name for name, _ in build_model(cfg, "meta").named_parameters()]
before, peak = resident(), 0
for name in names:
    value = weights[name]  # the rest of its block waits in the reader
    peak = max(peak, resident() - before)
    del value
print(peak)
"""


def test_a_rank_reading_in_its_models_order_holds_one_block_at_a_time(tmp_path):
    """16 blocks of 6 MB each (fp32), about 100 MB in all: what the process holds grows by a
    small part of that while it reads them (reading the whole would hold all of it at least)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=384, intermediate_size=1024,
                                         num_hidden_layers=16, num_attention_heads=8,
                                         num_key_value_heads=2, tie_word_embeddings=False))
    total = sum(p.numel() * 4 for p in model.parameters())
    model.save_pretrained(tmp_path / "hf")
    del model
    proc = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path / "hf")], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    grown = int(proc.stdout.split()[-1])
    assert total > 90e6 and grown < total / 4, (grown, total)
