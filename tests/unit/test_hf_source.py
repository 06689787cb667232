"""A Hugging Face directory read one block at a time (``checkpoint/hf_source.py``): every
parameter equals the conversion of the model in memory, whatever the files (safetensors or
.bin, sharded or whole, tied or not); a reader that takes the parameters in the model's order
reads each block once and holds one at a time, not the whole; what cannot be read is one error
naming the source."""

import json
import subprocess
import sys

import pytest
import torch

from megatron_lite.checkpoint.convert import read_hf
from megatron_lite.checkpoint.hf_source import open_hf
from megatron_lite.checkpoint.init_from import (
    InitFromError,
    InitialWeights,
    SourceReadError,
    load_initial_weights,
)
from megatron_lite.model import build_model, resolve_model
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


def _save(model, out, files: str) -> None:
    """``model`` as a Hugging Face directory of ``files``: ``safetensors`` or ``sharded-safetensors``
    (transformers' own), ``bin``, ``sharded-bin`` (torch's zip format, with an index) or
    ``legacy-bin`` (torch's format before 1.6), the files transformers 4 and older wrote."""
    if "safetensors" in files:
        model.save_pretrained(out, **({"max_shard_size": "20KB"} if files.startswith("sharded") else {}))
        return
    model.config.save_pretrained(out)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    zipped = files != "legacy-bin"
    if files != "sharded-bin":
        torch.save(sd, out / "pytorch_model.bin", _use_new_zipfile_serialization=zipped)
        return
    keys, weight_map = sorted(sd), {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        name = f"pytorch_model-{i + 1:05d}-of-00002.bin"
        torch.save({k: sd[k] for k in part}, out / name)
        weight_map.update(dict.fromkeys(part, name))
    (out / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("make,files", [
    pytest.param(_gpt2, "sharded-safetensors", id="gpt2-tied-sharded-safetensors"),
    pytest.param(_llama, "sharded-bin", id="llama-gqa-sharded-bin"),
    pytest.param(_llama, "safetensors", id="llama-gqa-safetensors"),
    pytest.param(_qwen2, "bin", id="qwen2-tied-bin"),
    pytest.param(_gpt2, "legacy-bin", id="gpt2-legacy-bin"),
])
def test_every_parameter_equals_the_conversion_of_the_model_in_memory(tmp_path, make, files):
    torch.manual_seed(0)
    model = make()
    _save(model, tmp_path / "hf", files)
    suffix = ".bin" if "bin" in files else ".safetensors"
    assert any(p.suffix == suffix for p in (tmp_path / "hf").iterdir())
    cfg, want = from_hf(model)
    got_cfg, weights, _ = open_hf(tmp_path / "hf")
    assert got_cfg == cfg
    assert weights.shapes == {k: tuple(v.shape) for k, v in want.items()}
    # In the model's order (as a rank builds it), each name asked for twice (as ZeRO-3's tiles
    # ask): each block read once, the rest (embeddings; final norm and output layer) twice.
    read = []
    reader = weights._read
    weights._read = lambda group: read.append(group) or reader(group)
    order = [name for name, _ in build_model(cfg, "meta").named_parameters()]
    for name in [n for n in order for _ in range(2)]:
        got = weights[name]
        assert got.dtype == torch.float32 and got.is_contiguous()
        torch.testing.assert_close(got, want[name].float(), rtol=0, atol=0, msg=name)
    assert read == [None, *range(cfg.n_layers), None]
    whole = read_hf(tmp_path / "hf")[1]
    assert whole.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(whole[name], value.float(), rtol=0, atol=0, msg=name)


def test_a_file_removed_while_the_model_is_built_is_still_read(tmp_path):
    """The files stay open from the check to the last weight: a download replacing them
    meanwhile does not fail a rank halfway through its model."""
    torch.manual_seed(0)
    model = _llama()
    _save(model, tmp_path / "hf", "sharded-safetensors")
    _, weights, _ = open_hf(tmp_path / "hf")
    for shard in (tmp_path / "hf").glob("*.safetensors"):
        shard.unlink()
    want = from_hf(model)[1]
    for name in weights:
        torch.testing.assert_close(weights[name], want[name], rtol=0, atol=0, msg=name)


def test_a_source_that_is_no_weights_is_one_error_naming_it(tmp_path):
    torch.manual_seed(0)
    model = _llama()
    _save(model, tmp_path / "hf", "safetensors")
    (tmp_path / "hf/model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    run = resolve_model(from_hf(model)[0], 97, 32)
    with pytest.raises(InitFromError, match=r"cannot read its weights \(SafetensorError: .*download"):
        load_initial_weights(str(tmp_path / "hf"), run, print)


def test_a_weight_that_cannot_be_read_while_building_names_the_source_and_the_weight():
    class Failing(dict):
        def __getitem__(self, name):
            raise OSError(5, "Input/output error")

    initial = InitialWeights(Failing(), "/models/llama")
    with pytest.raises(SourceReadError, match=r"checkpoint.init_from='/models/llama': reading norm.weight "
                                              r"failed: OSError: \[Errno 5\] Input/output error"):
        initial.value("norm.weight", (32,))


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
import sys, torch
from megatron_lite.checkpoint.hf_source import open_hf
from megatron_lite.model import build_model

def resident():  # the process's own memory (the files' mapped pages are the page cache's)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

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
    """16 blocks of 6 MB each (fp32), about 100 MB in all: the process's own memory grows by a
    small part of that while it reads them (reading the whole would hold all of it at least).
    The files' pages it maps are the page cache's, shared by a node's ranks."""
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


CUT = """
import os, sys
from pathlib import Path
from megatron_lite.checkpoint.hf_source import open_hf
cfg, weights, _ = open_hf(sys.argv[1])
file = Path(sys.argv[1]) / "model.safetensors"
os.truncate(file, file.stat().st_size // 2)
try:
    for name in weights:
        weights[name]
except OSError as e:
    print("ERROR", type(e).__name__, e)
"""


def test_a_file_cut_short_while_the_model_is_built_is_named_not_a_crash(tmp_path):
    """Its pages are mapped: read, the missing ones would kill the process (SIGBUS)."""
    _save(_llama(), tmp_path / "hf", "safetensors")
    proc = subprocess.run([sys.executable, "-c", CUT, str(tmp_path / "hf")], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert f"ERROR FileChangedError {tmp_path / 'hf' / 'model.safetensors'} was cut short" in proc.stdout, \
        proc.stdout
