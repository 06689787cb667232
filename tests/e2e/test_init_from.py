"""``checkpoint.init_from``: a run starts from a Hugging Face model's weights (or a checkpoint's)
in every layout, with a fresh step, optimizer and data position; a mismatch is refused listing
every parameter; a run with its own checkpoint resumes from it instead."""

import json

import pytest
import torch

from megatron_lite.checkpoint import store
from megatron_lite.checkpoint.convert import read_model
from megatron_lite.checkpoint.init_from import load_initial_weights
from megatron_lite.model import resolve_model
from megatron_lite.model.hf_convert import config_from_hf, from_hf
from tests.conftest import char_overrides, check, read_metrics, run_pretrain

VOCAB = 65  # shakespeare-char's characters
# The recipe's model, as the HF model below is: Llama-3 style with llama3 RoPE scaling.
LLAMA = ["model.position=rope", "model.norm=rmsnorm", "model.activation=swiglu", "model.bias=false",
         "model.tie_embeddings=false", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.d_model=64", "model.ffn_hidden=96", "model.norm_eps=1e-5", "model.rope_theta=500000",
         "model.rope_scaling=llama3", "model.rope_scaling_factor=8", "model.rope_original_max_len=16",
         "model.vocab_multiple=1", "data.seq_length=64"]
# Adam's steps at this rate leave fp32 weights bit for bit as they were: what a run saves after
# its steps is then what it was built from.
FROZEN = ["optimizer.lr=1e-30", "optimizer.min_lr=0", "schedule.warmup_iters=0", "training.iters=2",
          "training.micro_batch_size=2", "training.global_batch_size=4", "training.eval_iters=1",
          "training.sample_tokens=0", "training.log_interval=1"]


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A small random Llama-3 (llama3 RoPE scaling) saved by transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("hf") / "llama"
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    WEIGHTS[out] = from_hf(model)[1]  # ours, from the model in memory (not from its files)
    return out


WEIGHTS = {}


def _hf_weights(hf_dir):
    return WEIGHTS[hf_dir]


@pytest.mark.parametrize("layout", [pytest.param([], id="one-process"),
                                    pytest.param(["parallel.tensor=2", "parallel.sequence_parallel=true"],
                                                 id="tensor2-sp"),
                                    pytest.param(["parallel.pipeline=2"], id="pipeline2"),
                                    pytest.param(["parallel.zero_stage=3"], id="zero3-data2")])
def test_every_layout_starts_from_the_hf_weights(tmp_path, hf_llama, layout):
    nproc = 1 if not layout else 2
    ck = tmp_path / "ck"
    base = ["recipes/shakespeare-char.yaml", *char_overrides(tmp_path), *LLAMA, *FROZEN,
            f"checkpoint.dir={ck}", f"checkpoint.init_from={hf_llama}"]
    proc = check(run_pretrain([*base, *layout], nproc=nproc))
    assert f"init_from: weights of the Hugging Face model {hf_llama}" in proc.stdout
    _, _, saved = read_model(ck)
    expected = _hf_weights(hf_llama)
    # The banner counts the model's parameters as its card does; tensor parallelism pads the
    # vocabulary of 65 to 66 rows, in the embedding and the output layer, counted apart.
    padding = " (+128 in the vocabulary's padding rows)" if "parallel.tensor=2" in layout else ""
    assert f"model: {sum(v.numel() for v in expected.values()):,} parameters{padding}," in proc.stdout
    assert saved.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0, msg=name)
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in records] == [1, 2]  # step 0: a fresh step, whatever the source's
    manifest = json.loads((store.read_latest(ck) / store.MANIFEST).read_text())
    assert manifest["consumed_samples"] == 8  # two global batches from the start of the data

    if not layout:
        # The run's own checkpoint wins over init_from from then on, and the log says so.
        proc = check(run_pretrain([*base, "training.iters=3", "schedule.on_resume=recipe"]))
        assert f"checkpoint.init_from={hf_llama} is ignored" in proc.stdout
        assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r][-1] == 3
        # A checkpoint of this project is a source too (its step and optimizer are left behind).
        check(run_pretrain(["recipes/shakespeare-char.yaml", *char_overrides(tmp_path), *LLAMA, *FROZEN,
                            f"checkpoint.dir={tmp_path}/ck2", f"checkpoint.init_from={ck}",
                            f"logging.dir={tmp_path}/run2"]))
        _, _, again = read_model(tmp_path / "ck2")
        for name, value in read_model(ck)[2].items():
            torch.testing.assert_close(again[name], value, rtol=0, atol=0, msg=name)
        assert [r["step"] for r in read_metrics(tmp_path / "run2") if "loss" in r] == [1, 2]


def test_a_mismatching_recipe_is_refused_listing_every_parameter(hf_llama, tmp_path):
    from transformers import AutoConfig

    source = config_from_hf(AutoConfig.from_pretrained(hf_llama))
    # Another grouping of the heads and a LayerNorm: each k/v projection, and the norm kind.
    run = resolve_model(source.__class__(**{**source.__dict__, "n_kv_heads": 4, "norm": "layernorm",
                                             "rope_theta": 10000.0}), VOCAB, 64)
    with pytest.raises(ValueError) as e:
        load_initial_weights(str(hf_llama), run, print)
    message = str(e.value)
    for i in range(2):  # q|k|v of 4 query heads of 16 with 2 key/value heads; with 4 here
        assert f"blocks.{i}.attn.qkv_proj.weight (128, 64) in the source, (192, 64) here" in message
    assert "model.norm='layernorm', the source's is 'rmsnorm'" in message
    assert "model.n_kv_heads=4, the source's is 2" in message  # the field to set, not only its shapes
    assert "rope_theta" not in message  # a deliberate change (a context extension), only logged
    assert "4 problem(s)" in message  # q|k|v of each block, the norm, n_kv_heads

    proc = run_pretrain(["recipes/shakespeare-char.yaml", *char_overrides(tmp_path), *LLAMA, *FROZEN,
                         "model.n_layers=3", f"checkpoint.init_from={hf_llama}"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "checkpoint.init_from=" in lines[0], proc.stderr[-2000:]
    assert "blocks.2.attn.qkv_proj.weight (128, 64): not in the source" in proc.stderr
    assert "model.n_layers=3, the source's is 2" in proc.stderr

    # A directory that holds no model: one line naming the key, exit 2.
    (tmp_path / "empty").mkdir()
    proc = run_pretrain(["recipes/shakespeare-char.yaml", *char_overrides(tmp_path), *LLAMA, *FROZEN,
                         f"checkpoint.init_from={tmp_path}/empty"])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(f"error: checkpoint.init_from='{tmp_path}/empty': "), lines

    # A download cut short (a weight file that is no safetensors): one line, exit 2, nothing built.
    import shutil

    shutil.copytree(hf_llama, tmp_path / "cut")
    weights = tmp_path / "cut/model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    proc = run_pretrain(["recipes/shakespeare-char.yaml", *char_overrides(tmp_path), *LLAMA, *FROZEN,
                         f"checkpoint.dir={tmp_path}/ck-cut", f"checkpoint.init_from={tmp_path}/cut"])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "cannot read its weights (SafetensorError" in lines[0] and "download the model again" in lines[0]
    assert not (tmp_path / "ck-cut").exists()
