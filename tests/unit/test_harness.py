"""Downstream evaluation (lm-evaluation-harness): a checkpoint scored through our adapter gets
lm-eval's own HFLM's numbers for the Hugging Face model it was imported from, request by request,
on local tasks of each kind (multiple choice, generation, perplexity); a tool's mistakes are
one line and exit 2."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.conftest import REPO, cpu_env
from tests.harness_tasks import MAX_LEN, TASKS, hflm_results, save_llama, save_tokenizer, write_tasks

pytest.importorskip("lm_eval", reason="the eval extra: pip install -e '.[eval]'")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(checkpoint root, tasks folder, HFLM's results). Half the generation targets are HFLM's
    own answers, so that exact_match is neither 0 nor 1."""
    from megatron_lite.checkpoint.convert import import_hf

    d = tmp_path_factory.mktemp("harness")
    hf_dir, tasks_dir = d / "hf", d / "tasks"
    tasks_dir.mkdir()
    save_tokenizer(hf_dir)
    from transformers import AutoTokenizer

    save_llama(hf_dir, len(AutoTokenizer.from_pretrained(hf_dir)))
    write_tasks(tasks_dir, torch.Generator().manual_seed(0))
    first = hflm_results(hf_dir, tasks_dir, ["tiny_gen"])["samples"]["tiny_gen"]
    answers = {s["doc_id"]: s["filtered_resps"][0] for s in first}
    write_tasks(tasks_dir, torch.Generator().manual_seed(0),
                 [answers[i] if i % 2 == 0 else "no" for i in range(len(answers))])
    import_hf(hf_dir, d / "ck")
    return d / "ck", tasks_dir, hflm_results(hf_dir, tasks_dir, TASKS)


def _evaluate(*args, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools/evaluate.py"), *map(str, args)], cwd=REPO,
                          env=cpu_env(), capture_output=True, text=True, timeout=timeout)


def _responses(samples: list[dict]) -> dict[int, list]:
    """doc id -> its filtered responses, tuples as lists (as JSON has them)."""
    return {s["doc_id"]: json.loads(json.dumps(s["filtered_resps"])) for s in samples}


def test_scores_equal_lm_evals_hflm_request_by_request(setup, tmp_path):
    ck, tasks_dir, theirs = setup
    proc = _evaluate(ck, "--tasks", ",".join(TASKS), "--include-path", tasks_dir, "--batch-size", 3,
                     "--output", tmp_path / "out.json", "--log-samples")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = json.loads((tmp_path / "out.json").read_text())
    assert re.search(r"^tiny_mc +acc_norm +[0-9.]+$", proc.stdout, re.M), proc.stdout  # the table

    expected = {"harness/tiny_mc/acc", "harness/tiny_mc/acc_norm", "harness/tiny_gen/exact_match",
                "harness/tiny_ppl/word_perplexity", "harness/tiny_ppl/byte_perplexity",
                "harness/tiny_ppl/bits_per_byte"}
    assert set(ours["metrics"]) == expected
    for name in expected:
        _, task, metric = name.split("/")
        assert ours["metrics"][name] == pytest.approx(theirs["results"][task][f"{metric},none"],
                                                      rel=1e-5, abs=1e-5), name
    assert 0 < ours["metrics"]["harness/tiny_gen/exact_match"] < 1

    for task in TASKS:
        mine, hf = _responses(ours["samples"][task]), _responses(theirs["samples"][task])
        assert mine.keys() == hf.keys()
        for doc in hf:
            if task == "tiny_gen":
                assert mine[doc] == hf[doc], doc
                continue
            if task == "tiny_mc":  # (log-likelihood, greedy) per choice
                assert [g for _, g in mine[doc]] == [g for _, g in hf[doc]], doc
                mine[doc], hf[doc] = [x for x, _ in mine[doc]], [x for x, _ in hf[doc]]
            # Log-likelihood sums of up to 64 tokens in fp32 kernels (ours fuses q|k|v into one
            # product, transformers does not): a few units in the last place of sums up to ~750.
            assert mine[doc] == pytest.approx(hf[doc], rel=1e-6, abs=1e-5), (task, doc)
    generated = [r[0] for r in _responses(ours["samples"]["tiny_gen"]).values()]
    assert any(generated) and len(set(generated)) > 1, generated


def test_the_tokenizer_comes_from_the_import_or_the_override(setup):
    from megatron_lite.checkpoint.convert import read_model
    from megatron_lite.evaluation import checkpoint_tokenizer

    ck, _, _ = setup
    manifest = read_model(ck)[0]
    source = manifest["topology"]["imported_from"]
    assert checkpoint_tokenizer(manifest).tok.name_or_path == source
    override = checkpoint_tokenizer({}, source)
    assert override.encode("the cat") == checkpoint_tokenizer(manifest).encode("the cat") != []
    with pytest.raises(FileNotFoundError, match="--tokenizer PATH"):
        checkpoint_tokenizer({"topology": {}})


def test_evaluate_tasks_keeps_the_models_mode_and_the_random_state(setup):
    """What the trainer calls between steps: the same numbers, and the run unchanged after it."""
    from megatron_lite.evaluation import evaluate_tasks, load_checkpoint

    ck, tasks_dir, theirs = setup
    model, tok, _ = load_checkpoint(ck)
    model.train()
    before = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    metrics = evaluate_tasks(model, tok, ["tiny_mc"], limit=4, max_len=MAX_LEN, device="cpu",
                             include_path=str(tasks_dir), batch_size=2)
    assert model.training
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2])
    assert set(metrics) == {"harness/tiny_mc/acc", "harness/tiny_mc/acc_norm"}
    mine = [s for s in theirs["samples"]["tiny_mc"] if s["doc_id"] < 4]
    assert metrics["harness/tiny_mc/acc"] == pytest.approx(np.mean([s["acc"] for s in mine]), abs=1e-9)


def _run_main(argv: list, capsys) -> tuple[int, list[str]]:
    from tools.evaluate import main

    status = main([str(a) for a in argv])
    return status, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_an_unknown_task_is_one_line_naming_the_closest(setup, capsys):
    ck, tasks_dir, _ = setup
    status, err = _run_main([ck, "--tasks", "tiny_mcq", "--include-path", tasks_dir], capsys)
    assert status == 2
    assert len(err) == 1 and err[0].startswith("error: unknown task(s) tiny_mcq") and "tiny_mc" in err[0], err


def test_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    status, err = _run_main([tmp_path / "nowhere", "--tasks", "tiny_mc"], capsys)
    assert status == 2
    assert err == [f"error: checkpoint {tmp_path / 'nowhere'} does not exist (give a checkpoint step "
                   "directory, or a checkpoint.dir whose 'latest' names one)"]


def test_importing_the_package_needs_no_lm_eval():
    probe = ("import sys; sys.modules['lm_eval'] = None\n"
             "import megatron_lite.evaluation as e\n"
             "try:\n    e.adapter_class()\nexcept e.MissingExtraError as err:\n    print(err)\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=cpu_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip() == "downstream evaluation needs lm-evaluation-harness: " \
                                 "pip install 'megatron_lite[eval]'", out.stderr
