"""A checkpoint of this project as ``checkpoint.init_from``'s source (``convert.open_model``): a rank
that takes the parameters in its model's order assembles one at a time from the memory-mapped
rank files and never holds the whole model; each equals what the whole read gives. A parameter
its fragments leave a gap in, or whose weights are not finite, is refused when the checkpoint is
opened, before anything is built; a rank file changed in place while the model is built is an
error naming it when its next parameter is read (cut short, its pages would kill the process
with SIGBUS); one deleted or replaced by a rename still gives the weights that were checked."""

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_lite.checkpoint import store
from megatron_lite.checkpoint.convert import import_hf, open_model, read_model
from megatron_lite.checkpoint.init_from import InitFromError, load_initial_weights
from megatron_lite.checkpoint.mapped import FileChangedError
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


def _rewritten(ck, change) -> None:
    """``ck``'s rank file with its fragments through ``change``, its manifest's hashes and
    index following (a checkpoint that verifies)."""
    file = ck / "rank_00000.pt"
    state = store.load_rank_file(file)
    state["fragments"] = change(state["fragments"])
    torch.save(state, f"{file}.new")
    os.replace(f"{file}.new", file)
    manifest = json.loads((ck / store.MANIFEST).read_text())
    entry = manifest["files"][0]
    entry["bytes"], entry["sha256"] = file.stat().st_size, hashlib.sha256(file.read_bytes()).hexdigest()
    if "fragments" in entry:
        entry["fragments"] = [[f["name"], [], list(f["slice_shape"]), f["start"],
                               f["tensors"]["param"].numel()] for f in state["fragments"]]
    (ck / store.MANIFEST).write_text(json.dumps(manifest))


def _split_with_a_gap(fragments):
    """blocks.0's down projection in two fragments that hold as many elements as it has, the
    second shifted 100 elements back over the first: its last 100 elements are in neither."""
    out = []
    for f in fragments:
        if f["name"] != "blocks.0.mlp.down_proj.weight":
            out.append(f)
            continue
        n = f["tensors"]["param"].numel()
        half = n // 2
        for start, lo, hi in ((0, 0, half), (half - 100, half, n)):
            pieces = {k: v[lo:hi].clone() for k, v in f["tensors"].items()}
            out.append({**f, "start": start, "tensors": pieces})
    return out


def _with_nan(fragments):
    for f in fragments:
        if f["name"] == "norm.weight":
            f["tensors"]["param"] = f["tensors"]["param"].clone()
            f["tensors"]["param"][5] = float("nan")
    return fragments


@pytest.mark.parametrize("change, says", [(_split_with_a_gap, "do not cover it"), (_with_nan, "not finite")],
                         ids=["gap", "nan"])
def test_a_gap_or_a_non_finite_weight_is_refused_when_the_checkpoint_is_opened(tmp_path, change, says):
    ck, _ = _imported(tmp_path, 2, 64, 96)
    cfg = read_model(ck)[1]
    _rewritten(ck, change)
    with pytest.raises(InitFromError, match=says) as e:
        load_initial_weights(str(ck), cfg, lambda _: None)
    assert str(ck) in str(e.value)


CHANGED = """
import os, sys
from pathlib import Path
from megatron_lite.checkpoint.init_from import read_source
ck, how = Path(sys.argv[1]), sys.argv[2]
_, weights, _ = read_source(ck)
name = "blocks.1.mlp.down_proj.weight"
whole = weights[name].clone()
rank_file = ck / "rank_00000.pt"
if how == "cut":
    os.truncate(rank_file, rank_file.stat().st_size // 2)
elif how == "rewritten":  # the same size, other bytes at the end (where the last tensors are)
    with open(rank_file, "r+b") as f:
        f.seek(-4096, os.SEEK_END)
        f.write(bytes(4096))
elif how == "deleted":
    rank_file.unlink()
else:  # another file renamed over it
    other = ck / "other"
    other.write_bytes(bytes(rank_file.stat().st_size))
    os.replace(other, rank_file)
try:
    again = {n: weights[n] for n in weights}
except OSError as e:
    print("ERROR", type(e).__name__, e)
else:
    import torch
    torch.testing.assert_close(again[name], whole, rtol=0, atol=0)
    print("READ", len(again))
"""


@pytest.mark.parametrize("how", ["cut", "rewritten", "deleted", "renamed-over"])
def test_a_rank_file_changed_while_the_model_is_built(tmp_path, how):
    """In a process of its own: without the check, the cut-short file's pages kill it (SIGBUS)."""
    ck, _ = _imported(tmp_path, 2, 64, 96)
    proc = subprocess.run([sys.executable, "-c", CHANGED, str(ck), how], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    if how in ("cut", "rewritten"):
        assert f"ERROR {FileChangedError.__name__} {ck / 'rank_00000.pt'}" in proc.stdout, proc.stdout
        assert ("cut short" if how == "cut" else "rewritten in place") in proc.stdout, proc.stdout
    else:  # the mapping keeps the pages that were checked
        assert proc.stdout.startswith("READ "), proc.stdout
