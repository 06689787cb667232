"""Export a trained checkpoint to Hugging Face transformers and import it back."""

import subprocess
import sys

import torch

from megatron_lite.checkpoint.convert import read_model
from megatron_lite.model import build_model
from tests.conftest import REPO, char_overrides, check, cpu_env, run_pretrain

LLAMA = ["model.position=rope", "model.norm=rmsnorm", "model.activation=swiglu", "model.bias=false",
         "model.tie_embeddings=false", "model.n_kv_heads=2", "model.n_layers=2", "model.d_model=64",
         "training.iters=3", "training.micro_batch_size=4", "training.global_batch_size=4",
         "training.eval_iters=1", "training.sample_tokens=0"]


def _convert(*args):
    return check(subprocess.run([sys.executable, str(REPO / "tools/convert_checkpoint.py"), *args],
                                cwd=REPO, env=cpu_env(), capture_output=True, text=True))


def test_hf_export_matches_our_logits_and_imports_back(tmp_path):
    from transformers import AutoModelForCausalLM

    ck = tmp_path / "ck"
    check(run_pretrain(["recipes/shakespeare-char.yaml", *char_overrides(tmp_path), *LLAMA,
                        f"checkpoint.dir={ck}"]))
    _convert("--to", "hf", str(ck), str(tmp_path / "hf"))
    assert (tmp_path / "hf/model.safetensors").is_file() and (tmp_path / "hf/config.json").is_file()

    _, cfg, weights = read_model(ck)
    ours = build_model(cfg).eval()
    ours.load_state_dict(weights, strict=True)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=0, atol=1e-5)

    _convert("--from", "hf", str(tmp_path / "hf"), str(tmp_path / "imported"))
    _, _, back = read_model(tmp_path / "imported")
    assert back.keys() == weights.keys()
    for name, value in weights.items():
        torch.testing.assert_close(back[name], value, rtol=0, atol=0, msg=name)
    proc = check(run_pretrain(["recipes/shakespeare-char.yaml", *char_overrides(tmp_path), *LLAMA,
                               f"checkpoint.dir={tmp_path}/imported", f"logging.dir={tmp_path}/run2"]))
    assert "step_00000000 at step 0" in proc.stdout


def test_a_hub_model_id_without_network_is_one_line_naming_it(tmp_path):
    # A local directory is the path the test above takes; a Hub id goes through transformers.
    proc = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "--from", "hf",
                           "openai-community/gpt2", str(tmp_path / "ck")], cwd=REPO,
                          env={**cpu_env(), "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: openai-community/gpt2: "), proc.stderr
    assert not (tmp_path / "ck").exists()
