"""Export a trained checkpoint to Hugging Face transformers and import it back; import a
transformers model and export it back; refuse what our model would compute differently."""

import json
import subprocess
import sys

import pytest
import torch

from megatron_lite.checkpoint.convert import read_model
from megatron_lite.model import build_model
from tests.conftest import REPO, char_overrides, check, cpu_env, run_pretrain

LLAMA = ["model.position=rope", "model.norm=rmsnorm", "model.activation=swiglu", "model.bias=false",
         "model.tie_embeddings=false", "model.n_kv_heads=2", "model.n_layers=2", "model.d_model=64",
         "model.norm_eps=1e-6", "model.max_seq_len=96",
         "training.iters=3", "training.micro_batch_size=4", "training.global_batch_size=4",
         "training.eval_iters=1", "training.sample_tokens=0"]


def _convert(*args) -> None:
    """tools/convert_checkpoint.py ARGS in this process (a process's start-up is most of a small
    conversion; the tests below that read its error lines run it as a process). Its output goes
    to pytest's capture, shown when the test fails."""
    from tools.convert_checkpoint import main

    status = main([str(a) for a in args])
    assert status == 0, f"convert_checkpoint.py {' '.join(map(str, args))}: exit {status}"


def test_hf_export_matches_our_logits_and_imports_back(tmp_path):
    """Trained under TP=2 with the 65 characters padded to 80 rows (model.vocab_multiple 8 ×
    tensor 2): the export holds the tokenizer's rows only; imported back, it resumes in one
    process."""
    from transformers import AutoModelForCausalLM

    ck = tmp_path / "ck"
    check(run_pretrain(["recipes/shakespeare-char.yaml", *char_overrides(tmp_path), *LLAMA,
                        "parallel.tensor=2", "model.vocab_multiple=8", f"checkpoint.dir={ck}"], nproc=2))
    assert _saved_rows(ck) == 80  # the checkpoint holds the padding
    _convert("--to", "hf", str(ck), str(tmp_path / "hf"))
    assert (tmp_path / "hf/model.safetensors").is_file() and (tmp_path / "hf/config.json").is_file()
    # Fields the checkpoint's architecture leaves out come from the recipe it was trained with.
    exported = json.loads((tmp_path / "hf/config.json").read_text())
    assert (exported["rms_norm_eps"], exported["max_position_embeddings"]) == (1e-6, 96)
    assert exported["vocab_size"] == 65
    # The recipe's character vocabulary has no special tokens: none is written (Llama's 1 and 2
    # would be characters here).
    assert [exported[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == [None] * 3

    _, cfg, weights = read_model(ck)
    assert cfg.vocab_size == 65  # reading the checkpoint leaves the padding out
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


GPT = ["training.iters=3", "training.micro_batch_size=4", "training.global_batch_size=4",
       "training.eval_iters=1", "training.sample_tokens=0"]


def test_a_padded_gpt2_vocabulary_exports_the_tokenizers_rows_only(tmp_path):
    """The 65 characters padded to 128 rows (as GPT-2's 50257 to 50304), tied embeddings: the
    export holds the tokenizer's rows only. (Llama under TP=2: the test above.)"""
    from transformers import AutoModelForCausalLM

    ck = tmp_path / "ck"
    check(run_pretrain(["recipes/shakespeare-char.yaml", *char_overrides(tmp_path), *GPT,
                        "model.vocab_multiple=64", f"checkpoint.dir={ck}"]))
    assert _saved_rows(ck) == 128  # the checkpoint holds the padding ...
    _, cfg, weights = read_model(ck)
    assert cfg.vocab_size == 65  # ... which reading it leaves out
    _convert("--to", "hf", str(ck), str(tmp_path / "hf"))
    exported = json.loads((tmp_path / "hf/config.json").read_text())
    assert (exported["model_type"], exported["vocab_size"]) == ("gpt2", 65)
    ours = build_model(cfg).eval()
    missing, unexpected = ours.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if cfg.tie_embeddings else set())
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, 65, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens)[..., :65], rtol=0, atol=1e-5)


def _saved_rows(ck) -> int:
    """Rows of tok_emb.weight as the checkpoint's fragments record them (padding included)."""
    from megatron_lite.checkpoint import store
    from megatron_lite.checkpoint.shards import Assembler, file_fragments

    step = store.read_latest(ck)
    fragments = []
    for file in sorted(step.glob("rank_*.pt")):
        fragments += file_fragments(store.load_rank_file(file), file.stat().st_size)
    return Assembler(fragments).shape("tok_emb.weight")[0]


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


# Written by transformers from the config alone, not what the model computes.
NOT_ARCHITECTURE = {"transformers_version", "dtype", "use_cache", "initializer_range"}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _save_tiny_llama(out, **kwargs):
    """A small random Llama with non-default sizes, epsilon and base frequency, every weight
    perturbed (random init leaves norms at one), saved as transformers saves it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**{
        "vocab_size": 97, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 96,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "tie_word_embeddings": False,
        "bos_token_id": 5, "eos_token_id": 6, "pad_token_id": 7, **kwargs})
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(out)
    return model


def test_hf_import_then_export_gives_the_same_config_and_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    original = _save_tiny_llama(tmp_path / "hf")
    _convert("--from", "hf", str(tmp_path / "hf"), str(tmp_path / "ck"))
    _convert("--to", "hf", str(tmp_path / "ck"), str(tmp_path / "back"))

    # The special-token ids included: the model's own, not the class's defaults (1 and 2).
    before = json.loads((tmp_path / "hf/config.json").read_text())
    after = json.loads((tmp_path / "back/config.json").read_text())
    for field in sorted((before.keys() | after.keys()) - NOT_ARCHITECTURE):
        assert after.get(field) == before.get(field), field
    before = json.loads((tmp_path / "hf/generation_config.json").read_text())
    after = json.loads((tmp_path / "back/generation_config.json").read_text())
    assert {k: v for k, v in after.items() if "token_id" in k} == {k: v for k, v in before.items()
                                                                    if "token_id" in k} != {}
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    tokens = torch.randint(0, 97, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, original(tokens).logits, rtol=0, atol=1e-5)


def _older_config_json(hf_dir):
    """The same config as transformers < 5 wrote it: rope_theta at the top, a rope_scaling dict."""
    path = hf_dir / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    cfg["transformers_version"] = "4.46.0"
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("older", [False, True], ids=["rope_parameters", "rope_scaling"])
def test_llama3_rope_scaling_imports_and_exports_with_the_same_logits(tmp_path, older):
    """Llama 3.1 and later (rope_type llama3), from config.json as transformers 5 and 4 write it."""
    from transformers import AutoModelForCausalLM

    original = _save_tiny_llama(tmp_path / "hf", rope_parameters=LLAMA3_ROPE)
    if older:
        _older_config_json(tmp_path / "hf")
    _convert("--from", "hf", str(tmp_path / "hf"), str(tmp_path / "ck"))
    _convert("--to", "hf", str(tmp_path / "ck"), str(tmp_path / "back"))
    exported = json.loads((tmp_path / "back/config.json").read_text())
    rope = exported.get("rope_parameters") or {**exported["rope_scaling"],
                                               "rope_theta": exported["rope_theta"]}
    assert {k: rope[k] for k in LLAMA3_ROPE} == LLAMA3_ROPE
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    tokens = torch.randint(0, 97, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, original(tokens).logits, rtol=0, atol=1e-5)


def test_a_rope_scaling_not_implemented_is_refused_in_one_line_naming_it(tmp_path):
    _save_tiny_llama(tmp_path / "hf", rope_parameters={"rope_type": "yarn", "rope_theta": 500000.0,
                                                       "factor": 4.0, "original_max_position_embeddings": 16})
    proc = subprocess.run([sys.executable, str(REPO / "tools/convert_checkpoint.py"), "--from", "hf",
                           str(tmp_path / "hf"), str(tmp_path / "ck")], cwd=REPO, env=cpu_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    # Only the last line is ours: importing transformers may log warnings of its own first.
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {tmp_path / 'hf'}: "), proc.stderr
    assert "rope_parameters.rope_type='yarn' is not implemented" in last, proc.stderr
    assert not (tmp_path / "ck").exists()
