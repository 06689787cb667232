"""Continued pretraining end to end (docs/continued-pretraining.md, at toy size): a small random
Llama-3 with llama3 RoPE scaling imported from transformers, a run started from its weights, a
second data phase with another blend during a WSD cooldown, a resume in the middle of the
cooldown equal bit for bit to the uninterrupted run, the export loaded by transformers, and
tools/evaluate.py scoring what lm-eval's Hugging Face model scores on a local task."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_lite.checkpoint.convert import read_model
from megatron_lite.model import build_model
from tests.conftest import REPO, check, cpu_env, read_metrics, run_pretrain
from tests.harness_tasks import MAX_LEN, WORDS, hflm_results, save_llama, save_tokenizer, write_tasks

pytest.importorskip("lm_eval", reason="the eval extra: pip install -e '.[eval]'")

TASKS = ["tiny_mc", "tiny_ppl"]


def _tool(*args) -> subprocess.CompletedProcess:
    return check(subprocess.run([sys.executable, *map(str, args)], cwd=REPO, env=cpu_env(),
                                capture_output=True, text=True, timeout=600))


def _corpus(path, words: list[str], seed: int) -> None:
    """Documents of random sentences over ``words``: two sources a blend can tell apart."""
    gen = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(120):
        n = int(torch.randint(5, 40, (1,), generator=gen))
        docs.append(" ".join(words[i] for i in torch.randint(0, len(words), (n,), generator=gen).tolist()))
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


def _losses(run_dir) -> dict[int, tuple]:
    return {r["step"]: (r["loss"], r["grad_norm"], r["lr"]) for r in read_metrics(run_dir) if "loss" in r}


def test_import_continue_in_two_phases_resume_in_the_cooldown_export_and_evaluate(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = tmp_path / "hf"
    save_tokenizer(hf)
    save_llama(hf, len(AutoTokenizer.from_pretrained(hf)))
    _tool("tools/convert_checkpoint.py", "--from", "hf", hf, tmp_path / "imported")

    half = len(WORDS) // 2
    for name, words, seed in (("a", WORDS[:half], 1), ("b", WORDS[half:], 2)):
        _corpus(tmp_path / f"{name}.jsonl", words, seed)
        _tool("tools/preprocess_data.py", "--input", tmp_path / f"{name}.jsonl", "--output-prefix",
              tmp_path / "data" / name, "--json-keys", "text", "--tokenizer-type", "huggingface",
              "--tokenizer-model", hf, "--append-eod", "--workers", "1")
    a = f"{{prefix: {tmp_path}/data/a_text_document, weight: 1.0, name: a}}"
    b = f"{{prefix: {tmp_path}/data/b_text_document, weight: 1.0, name: b}}"

    base = ["recipes/shakespeare-char.yaml", "data.prefix=null", "data.build_from=null",
            "data.tokenizer.type=huggingface", f"data.tokenizer.model={hf}",
            "data.tokenizer.vocab_size=null", "data.seq_length=32",
            "data.split=90,5,5",
            # The source's model (save_llama): Llama-3 with llama3 RoPE scaling.
            "model.position=rope", "model.norm=rmsnorm", "model.activation=swiglu", "model.bias=false",
            "model.tie_embeddings=false", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
            "model.d_model=32", "model.ffn_hidden=64", "model.norm_eps=1e-6", "model.rope_theta=500000",
            "model.rope_scaling=llama3", "model.rope_scaling_factor=8", "model.rope_original_max_len=16",
            f"model.max_seq_len={MAX_LEN}", "model.vocab_multiple=1",
            "training.micro_batch_size=4", "training.global_batch_size=8", "training.eval_iters=1",
            "training.eval_interval=0", "training.sample_tokens=0", "training.log_interval=1",
            "checkpoint.save_interval=1", f"checkpoint.init_from={tmp_path}/imported",
            # Warm-up-stable-decay over 10 steps: the cooldown is steps 7-10.
            "optimizer.lr=1e-3", "optimizer.min_lr=1e-4", "schedule.warmup_iters=1",
            "schedule.decay_style=wsd", "schedule.decay_fraction=0.5", "schedule.decay_iters=10"]
    phase1 = [*base, f"data.blend=[{a}]"]
    phase2 = [*base, f"data.blend=[{a},{b}]", "data.on_resume=new_phase"]
    ck, ref = tmp_path / "ck", tmp_path / "ck-uninterrupted"

    proc = check(run_pretrain([*phase1, "training.iters=5", f"checkpoint.dir={ck}",
                               f"logging.dir={tmp_path}/run1"]))
    assert f"init_from: weights of the checkpoint {tmp_path}/imported" in proc.stdout
    assert "test_loss" in proc.stdout  # the test split, at the end
    shutil.copytree(ck, ref)

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_tasks(tasks, torch.Generator().manual_seed(0))
    # Phase 2 without a stop ...
    check(run_pretrain([*phase2, "training.iters=10", f"checkpoint.dir={ref}",
                        f"logging.dir={tmp_path}/ref"]))
    # ... and with one in the middle of the cooldown, scoring a task at its last step (which
    # must leave the training as it was: the resumed steps are compared bit for bit below).
    proc = check(run_pretrain([*phase2, "training.iters=8", f"checkpoint.dir={ck}",
                               f"logging.dir={tmp_path}/run2", "eval.harness_tasks=[tiny_mc]",
                               f"eval.harness_include_path={tasks}"]))
    assert "data phase 1 from step 5" in proc.stdout
    assert "val_loss/a" in proc.stdout and "val_loss/b" in proc.stdout  # each blend entry's own
    in_training = [r for r in read_metrics(tmp_path / "run2") if "harness/tiny_mc/acc" in r]
    assert [r["step"] for r in in_training] == [8]
    check(run_pretrain([*phase2, "training.iters=10", f"checkpoint.dir={ck}",
                        f"logging.dir={tmp_path}/run2"]))

    uninterrupted, resumed = _losses(tmp_path / "ref"), _losses(tmp_path / "run2")
    lrs = [uninterrupted[s][2] for s in range(6, 11)]
    # Held, then the cooldown.
    assert lrs[0] == lrs[1] == 1e-3 and lrs[2] < 1e-3 and lrs == sorted(lrs, reverse=True), lrs
    for step in (9, 10):
        assert resumed[step] == uninterrupted[step], step
    weights = read_model(ck)[2]
    for name, value in read_model(ref)[2].items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=name)
    phases = json.loads((ck / "step_00000010" / "manifest.json").read_text())["data"]["phases"]
    assert [(p["phase"], p["step"], len(p["data"]["blend"])) for p in phases] == [(0, 0, 1), (1, 5, 2)]

    # Export: transformers loads it and computes our logits.
    out = tmp_path / "exported"
    _tool("tools/convert_checkpoint.py", "--to", "hf", ck, out, "--tokenizer", hf)
    _, cfg, _ = read_model(ck)
    ours = build_model(cfg).eval()
    ours.load_state_dict(weights, strict=True)
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert theirs.config.rope_scaling["rope_type"] == "llama3"
    tokens = torch.randint(0, cfg.vocab_size, (2, MAX_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=0, atol=1e-5)

    # Evaluation: our adapter on the checkpoint, lm-eval's Hugging Face model on the export; and
    # the trainer's own scoring at step 8 is the tool's on that step's checkpoint.
    _tool("tools/evaluate.py", ck / "step_00000008", "--tasks", "tiny_mc", "--include-path", tasks,
          "--output", tmp_path / "step8.json")
    step8 = json.loads((tmp_path / "step8.json").read_text())["metrics"]
    for name, value in step8.items():
        assert in_training[0][name] == pytest.approx(value, rel=1e-6), name
    for file in [*hf.glob("tokenizer*"), *hf.glob("special_tokens_map.json")]:
        shutil.copy(file, out / file.name)  # HFLM reads the tokenizer beside the weights
    _tool("tools/evaluate.py", ck, "--tasks", ",".join(TASKS), "--include-path", tasks,
          "--output", tmp_path / "scores.json")
    mine = json.loads((tmp_path / "scores.json").read_text())["metrics"]
    hflm = hflm_results(out, tasks, TASKS)["results"]
    assert {"harness/tiny_mc/acc", "harness/tiny_ppl/word_perplexity"} <= set(mine)
    for name, value in mine.items():
        _, task, metric = name.split("/")
        assert value == pytest.approx(hflm[task][f"{metric},none"], rel=1e-5, abs=1e-5), name
