"""Checkpoints written before q|k|v and gate|up were fused (tests/fixtures/unfused_checkpoint)
resume to the losses the code that wrote them logged, in another layout, and export to the same
Hugging Face weights; one that lacks a separate projection, or holds a block's both ways, is
refused naming it."""

import shutil
from pathlib import Path

import pytest
import torch

from megatron_lite.checkpoint import store
from megatron_lite.checkpoint.convert import read_model
from megatron_lite.model import build_model
from megatron_lite.model.hf_convert import to_hf
from tests.conftest import REPO, char_overrides, check, read_metrics, run_pretrain

FIXTURE = REPO / "tests" / "fixtures" / "unfused_checkpoint"
ARGS = ["recipes/shakespeare-char.yaml", "model.position=rope", "model.norm=rmsnorm",
        "model.activation=swiglu", "model.bias=false", "model.qkv_bias=true", "model.tie_embeddings=false",
        "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_model=32",
        "model.ffn_hidden=48", "model.vocab_multiple=1", "data.seq_length=32", "training.micro_batch_size=2",
        "training.global_batch_size=4", "training.eval_iters=1", "training.sample_tokens=0",
        "training.log_interval=1", "training.eval_interval=1000", "schedule.warmup_iters=1",
        "checkpoint.save_interval=2"]
# What commit 8e994dd's code logged resuming the fixture to step 4 (schedule.on_resume=checkpoint).
OLD = {3: (4.14412784576416, 1.1929665803909302), 4: (4.166794776916504, 1.0678484439849854)}


@pytest.mark.parametrize("layout", [pytest.param(["parallel.tensor=2"], id="tensor2")])
def test_an_unfused_checkpoint_resumes_to_the_losses_it_had(tmp_path, layout):
    """In another layout than it was written with (one process): each tensor rank's slice of
    the fused weights and Adam moments comes from the separate ones."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURE, ck, ignore=shutil.ignore_patterns("README.md"))
    proc = check(run_pretrain([*ARGS, *char_overrides(tmp_path), f"checkpoint.dir={ck}", "training.iters=4",
                               "schedule.on_resume=checkpoint", *layout], nproc=2 if layout else 1))
    assert "resumed from" in proc.stdout
    records = {r["step"]: r for r in read_metrics(tmp_path / "run") if "loss" in r}
    assert sorted(records) == [3, 4]
    for step, (loss, grad_norm) in OLD.items():
        # One fused product sums in another order than three: equal to rounding.
        assert records[step]["loss"] == pytest.approx(loss, rel=1e-5), step
        assert records[step]["grad_norm"] == pytest.approx(grad_norm, rel=1e-4), step
    # What it saves now is fused.
    _, _, weights = read_model(ck)
    assert "blocks.0.attn.qkv_proj.weight" in weights and "blocks.0.attn.q_proj.weight" not in weights


def test_an_unfused_checkpoint_exports_its_own_weights():
    from transformers import Qwen2ForCausalLM

    _, cfg, weights = read_model(FIXTURE)
    assert "blocks.1.mlp.gate_up_proj.weight" in weights
    hf_cfg, hf_sd = to_hf(weights, cfg)
    # The exported separate projections are the very tensors the checkpoint's file holds.
    step = store.read_latest(FIXTURE)
    saved = {f["name"]: f["tensors"]["param"] for f in
             store.load_rank_file(step / "rank_00000.pt")["fragments"]}
    pairs = {"self_attn.q_proj.weight": "attn.q_proj.weight", "self_attn.k_proj.bias": "attn.k_proj.bias",
             "self_attn.v_proj.weight": "attn.v_proj.weight", "mlp.gate_proj.weight": "mlp.gate_proj.weight",
             "mlp.up_proj.weight": "mlp.up_proj.weight"}
    for theirs, ours in pairs.items():
        torch.testing.assert_close(hf_sd[f"model.layers.1.{theirs}"].flatten(), saved[f"blocks.1.{ours}"],
                                   rtol=0, atol=0, msg=theirs)
    hf = Qwen2ForCausalLM(hf_cfg).eval()
    hf.load_state_dict(hf_sd)
    ours = build_model(cfg).eval()
    ours.load_state_dict(weights)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5)


def _rewritten(tmp_path: Path, change) -> Path:
    """A copy of the fixture whose rank file's fragments went through ``change`` (the manifest's
    index and hashes follow)."""
    import hashlib
    import json

    out = tmp_path / "ck"
    shutil.copytree(FIXTURE, out, ignore=shutil.ignore_patterns("README.md"))
    step = store.read_latest(out)
    state = store.load_rank_file(step / "rank_00000.pt")
    state["fragments"] = change(state["fragments"])
    # (Written beside and moved over it: the loaded state maps the old file.)
    torch.save(state, step / "rank_00000.pt.new")
    (step / "rank_00000.pt.new").replace(step / "rank_00000.pt")
    manifest = json.loads((step / "manifest.json").read_text())
    entry = manifest["files"][0]
    entry["bytes"] = (step / "rank_00000.pt").stat().st_size
    entry["sha256"] = hashlib.sha256((step / "rank_00000.pt").read_bytes()).hexdigest()
    names = {f["name"] for f in state["fragments"]}
    entry["fragments"] = [e for e in entry["fragments"] if e[0] in names] + [
        [f["name"], [], list(f["slice_shape"]), 0, f["tensors"]["param"].numel()]
        for f in state["fragments"] if f["name"] not in {e[0] for e in entry["fragments"]}]
    (step / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_a_missing_or_doubled_projection_is_named(tmp_path):
    lacking = _rewritten(tmp_path / "a", lambda frags: [f for f in frags
                                                         if f["name"] != "blocks.0.attn.k_proj.weight"])
    with pytest.raises(store.CheckpointError) as e:
        read_model(lacking)
    assert ("blocks.0.attn.k_proj.weight is not in the checkpoint (it holds blocks.0.attn.q_proj.weight, "
            "blocks.0.attn.v_proj.weight)") in str(e.value)
    assert "model.n_kv_heads=2 or model.n_heads=4" in str(e.value)

    def doubled(frags):
        q = next(f for f in frags if f["name"] == "blocks.1.attn.q_proj.weight")
        return [*frags, {**q, "name": "blocks.1.attn.qkv_proj.weight"}]

    with pytest.raises(store.CheckpointError, match="holds blocks.1.attn.qkv_proj.weight and also the "
                                                    "separate projections it fuses"):
        read_model(_rewritten(tmp_path / "b", doubled))
