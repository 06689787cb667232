"""A checkpoint of this project as ``checkpoint.init_from``'s source (``convert.open_model``): a rank
that takes the parameters in its model's order assembles one at a time from the memory-mapped
rank files and never holds the whole model; each equals what the whole read gives."""

import subprocess
import sys

import torch

from megatron_lite.checkpoint.convert import import_hf, open_model, read_model
from megatron_lite.checkpoint.init_from import load_initial_weights
from tests.conftest import REPO

PEAK = """
import sys
from pathlib import Path
from megatron_lite.checkpoint.init_from import read_source
from megatron_lite.model import build_model

def resident():  # the process's own memory (the files' mapped pages are the page cache's)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

before = resident()
cfg, weights, _ = read_source(Path(sys.argv[1]))
peak = resident() - before
for name, _ in build_model(cfg, "meta").named_parameters():
    value = weights[name]
    peak = max(peak, resident() - before)
    del value
print(peak)
"""


def _imported(tmp_path, layers: int, width: int, ffn: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=width, intermediate_size=ffn,
                                         num_hidden_layers=layers, num_attention_heads=8,
                                         num_key_value_heads=2, tie_word_embeddings=False))
    total = sum(p.numel() * 4 for p in model.parameters())
    model.save_pretrained(tmp_path / "hf")
    del model
    return import_hf(tmp_path / "hf", tmp_path / "ck"), total


def test_a_rank_reading_in_its_models_order_holds_one_parameter_at_a_time(tmp_path):
    """16 blocks of 6 MB each (fp32), about 100 MB in all: opening the checkpoint and reading
    every parameter grows the process's own memory by a small part of that (the whole model
    assembled first would hold all of it)."""
    ck, total = _imported(tmp_path, 16, 384, 1024)
    proc = subprocess.run([sys.executable, "-c", PEAK, str(ck)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    grown = int(proc.stdout.split()[-1])
    assert total > 90e6 and grown < total / 3, (grown, total)


def test_each_parameter_read_when_asked_equals_the_whole_read(tmp_path):
    ck, _ = _imported(tmp_path, 2, 64, 96)
    manifest, cfg, whole = read_model(ck)
    _, _, lazy = open_model(ck)
    assert list(lazy) == sorted(whole) and len(lazy) == len(whole)
    for name, value in whole.items():
        assert lazy.shape(name) == tuple(value.shape)
        torch.testing.assert_close(lazy[name], value, rtol=0, atol=0)
        assert lazy[name] is lazy[name]  # asked again (ZeRO-3's tiles): assembled once
    initial = load_initial_weights(str(ck), cfg, lambda _: None)
    weight = "blocks.1.mlp.gate_up_proj.weight"
    torch.testing.assert_close(initial.value(weight, whole[weight].shape), whole[weight], rtol=0, atol=0)
