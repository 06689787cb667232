"""pretrain.py as a user runs it: a subprocess from the repository root."""

import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import (
    NO_TENSORBOARD,
    RECIPE_ALLOCATION,
    REPO,
    char_overrides,
    check,
    cpu_env,
    pretrain_command,
    pretrain_main,
    read_metrics,
    run_pretrain,
    torchrun,
)

RECIPE = "recipes/shakespeare-char.yaml"


def test_help():
    proc = check(run_pretrain(["--help"]))
    assert "--print-config" in proc.stdout and "--dry-run" in proc.stdout


@pytest.mark.parametrize("flags", [["--dry-run", "--plan"], ["--print-config", "--dry-run"], ["--suggest"],
                                   ["--dry-run", "--suggest"]])
def test_two_modes_at_once_are_a_usage_error_not_one_of_them_silently(flags):
    proc = pretrain_main(["recipes/quickstart.yaml", *flags])
    assert proc.returncode == 2 and proc.stdout == ""
    said = f"error: {' '.join(flags)}: give one of --print-config, --dry-run, --plan"
    assert proc.stderr.startswith(said), proc.stderr


def test_print_config_applies_overrides():
    proc = check(run_pretrain([RECIPE, "--print-config", "model.n_layers=7"]))
    assert "n_layers: 7" in proc.stdout


def test_dry_run_prints_parameters_and_flops():
    proc = check(run_pretrain(["recipes/llama2-7b.yaml", "--dry-run"]))
    assert "parameters: 6,738,415,616" in proc.stdout and "flops_per_token" in proc.stdout


@pytest.mark.parametrize("flag", ["--dry-run", "--plan"])
def test_every_recipe_dry_runs_and_plans_before_any_data_exists(tmp_path, monkeypatch, capsys, flag):
    """From a directory with no data, tokenizer or checkpoint: exact sizes from each recipe's
    word for its tokenizer (data.tokenizer.vocab_size), not an assumed vocabulary."""
    spec = importlib.util.spec_from_file_location("pretrain_cli", REPO / "pretrain.py")
    pretrain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pretrain)
    monkeypatch.chdir(tmp_path)
    recipes = sorted((REPO / "recipes").glob("*.yaml"))
    assert len(recipes) >= 9
    for recipe in recipes:
        where = RECIPE_ALLOCATION.get(recipe.name, []) if flag == "--plan" else []
        assert pretrain.main([str(recipe), flag, *where]) == 0, recipe.name
        out = capsys.readouterr()
        assert "does not exist yet" not in out.out + out.err, (recipe.name, out.err)
        assert "parameters:" in out.out, recipe.name
    assert not list(tmp_path.iterdir())  # nothing was built or written


def test_dry_run_and_plan_take_the_vocabulary_without_the_network(tmp_path):
    """gpt2-124m's tokenizer (data/gpt2, which could be a Hub name) is not on disk, and the recipe
    states its vocabulary: sizing the model uses that, never a Hub download (without a network,
    about 40 s of retries). A tokenizer neither on disk nor in the Hub cache, with no vocabulary
    stated, is a one-line error, at once."""
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}  # nothing answers
    for flag in ("--dry-run", "--plan"):
        proc = check(run_pretrain(["recipes/gpt2-124m.yaml", flag], env=env, timeout=120))
        assert "Retrying" not in proc.stderr and "127.0.0.1:9" not in proc.stderr, proc.stderr[-2000:]
        assert ("vocab_size: 50304" if flag == "--dry-run" else "parameters: 124,475,904") in proc.stdout
        if flag == "--dry-run":  # GPT-2's own count (transformers: 124,439,808), the padding apart
            assert "parameters: 124,439,808 (+36,096 in the vocabulary's padding rows)" in proc.stdout
    for model, says in (("./nope/tok", "tokenizer './nope/tok', which does not exist yet"),
                        ("nope-org/nope-tok", "'nope-org/nope-tok' is neither a local directory nor in "
                                              "the Hugging Face cache")):
        proc = run_pretrain(["recipes/gpt2-124m.yaml", "--dry-run", "data.tokenizer.vocab_size=null",
                             f"data.tokenizer.model={model}"], env=env, timeout=120)
        assert proc.returncode == 1, proc.stdout
        (line,) = proc.stderr.strip().splitlines()
        assert says in line and "set data.tokenizer.vocab_size=N" in line, line



def test_a_tokenizer_that_cannot_be_sized_is_one_line_for_plan_and_dry_run(tmp_path):
    """--plan refuses as --dry-run does (no assumed vocabulary: it would size another model),
    with exit 2 (1 is a plan that does not fit). A missing path shaped like a Hub id whose
    directory exists is a missing local copy, not a Hub download; a Hub name is not said to
    "not exist yet"; a tokenizer.json that does not parse is named."""
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}  # nothing answers
    broken = tmp_path / "tok"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("")
    (broken / "tokenizer_config.json").write_text("{}")
    cases = (
        ("recipes/gpt2-tokenizer", ["tokenizer 'recipes/gpt2-tokenizer', which does not exist yet",
                                    "save the tokenizer there"], "hf download"),
        ("nope-org/nope-tok", ["'nope-org/nope-tok' is neither a local directory nor in the Hugging "
                               "Face cache", "hf download nope-org/nope-tok --local-dir DIR"],
         "does not exist yet"),
        (str(broken), [f"{broken / 'tokenizer.json'}: Expecting value: line 1 column 1"], "Traceback"),
    )
    # --plan sizes the vocabulary through --dry-run's code: one case of it shows it refuses too.
    for flag, status, which in (("--dry-run", 1, cases), ("--plan", 2, cases[:1])):
        for model, says, never in which:
            proc = run_pretrain(["recipes/gpt2-124m.yaml", flag, "data.tokenizer.vocab_size=null",
                                 f"data.tokenizer.model={model}"], env=env, timeout=120)
            assert proc.returncode == status, (flag, model, proc.stdout, proc.stderr)
            (line,) = proc.stderr.strip().splitlines()
            assert line.startswith("error: ") and all(s in line for s in says), (flag, line)
            assert never not in line and "assumed" not in proc.stdout + line, (flag, line)

def test_plan_refuses_a_machine_that_cannot_be():
    """A negative world, no devices per node or an MFU of 4000% are mistakes, not plans."""
    for option, value in (("--world-size", "-8"), ("--gpus-per-node", "0"), ("--mfu", "40"),
                          ("--host-memory-gb", "0")):
        proc = pretrain_main(["recipes/llama2-7b-polaris.yaml", "--plan", option, value])
        assert proc.returncode == 2, proc.stdout
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(f"error: {option} {value}: give "), line
        assert option != "--mfu" or "(0.4 for 40%)" in line


def test_a_deepspeed_section_that_is_not_a_mapping_is_refused_before_anything_is_built(tmp_path):
    """deepspeed.zero_optimization=false would replace the generated section (a ZeRO-3 recipe
    training at stage 0, its manifest saying 3); deepspeed.bf16=true fails inside DeepSpeed."""
    for override, named in (("deepspeed.zero_optimization=false", "'deepspeed.zero_optimization' = False"),
                            ("deepspeed.bf16=true", "'deepspeed.bf16' = True"),
                            ("deepspeed.timers=false", "'deepspeed.timers' = False")):
        proc = run_pretrain([RECIPE, *char_overrides(tmp_path), "parallel.zero_stage=3", override])
        assert proc.returncode == 2, proc.stdout[-2000:]
        assert f"{named} must be a mapping" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()


def test_misspelled_key_fails_before_anything_is_built(tmp_path):
    proc = run_pretrain([RECIPE, *char_overrides(tmp_path), "training.itres=5"])
    assert proc.returncode == 2
    assert "training.itres" in proc.stderr and "did you mean 'training.iters'" in proc.stderr
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()


def test_a_vocabulary_smaller_than_the_tokenizers_is_a_recipe_error(tmp_path):
    """Found once the tokenizer is read: the recipe's mistake (exit 2, as a wrong layout), one
    line with the fix, no traceback."""
    cases = (("model.vocab_size=32", "error: model.vocab_size=32 is smaller than the tokenizer's vocabulary "
              "(65): set it to null (sized from the tokenizer) or to at least that"),
             ("model.tokenizer_vocab_size=32", "error: model.tokenizer_vocab_size=32 is smaller than the "
              "tokenizer's 65; leave it null"))
    for override, says in cases:
        proc = run_pretrain([RECIPE, *char_overrides(tmp_path), override])
        assert proc.returncode == 2, proc.stderr[-2000:]
        (line,) = proc.stderr.strip().splitlines()
        assert line == says, line


def test_missing_dataset_is_a_one_line_error(tmp_path):
    """pretrain.py's main as its __main__ calls it, then a look at what the failure left: the
    process groups are torn down on the failure path too (left to interpreter exit, gloo's
    threads can abort the process with SIGABRT instead of the exit status 1)."""
    args = [RECIPE, f"data.prefix={tmp_path}/none_text_document", "data.build_from=null",
            f"logging.dir={tmp_path}/run"]
    script = ("import sys, torch.distributed as dist, pretrain\n"
              f"rc = pretrain.main({args!r})\n"
              "print('groups left:', dist.is_initialized())\n"
              "sys.exit(rc)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=cpu_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "preprocess_data.py" in proc.stderr.strip().splitlines()[-1]
    assert "groups left: False" in proc.stdout


def test_a_dataset_built_with_another_tokenizer_is_one_line_before_training(tmp_path):
    """Ids from a 500-id tokenizer under shakespeare-char's 65 characters would index past the
    embedding steps into the run (an IndexError traceback on CPU, a device-side assert on a
    GPU): refused before the model is built, naming both sizes."""
    import numpy as np

    from megatron_lite.data.indexed import IndexedDatasetWriter

    chars = tmp_path / "chars.json"
    chars.write_text(json.dumps([chr(c) for c in range(32, 32 + 65)]))
    writer = IndexedDatasetWriter(tmp_path / "bpe_text_document", np.dtype(np.uint16))
    rng = np.random.default_rng(0)
    writer.add_documents([rng.integers(0, 500, 3000) for _ in range(40)])
    writer.finalize()
    proc = subprocess.run([sys.executable, "pretrain.py", RECIPE, f"data.prefix={tmp_path}/bpe_text_document",
                           "data.build_from=null", f"data.tokenizer.model={chars}", "training.iters=2",
                           f"logging.dir={tmp_path}/run"], cwd=REPO, env=cpu_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "holds token id 499, but the tokenizer (char " in last and "has 65 ids" in last, last
    assert "Traceback" not in proc.stderr


def test_shakespeare_char_learns(tmp_path):
    """200 steps of the nanoGPT CPU configuration: a broken model stays above ~3.3 nats."""
    proc = check(run_pretrain([RECIPE, *char_overrides(tmp_path), "training.iters=200",
                               "training.log_interval=20", "training.eval_interval=0",
                               "training.eval_iters=40", "training.sample_tokens=60",
                               "logging.tensorboard=true"]))
    run = tmp_path / "run"
    records = read_metrics(run)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in train] == list(range(20, 201, 20))
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "consumed_samples"):
        assert all(r[key] is not None for r in train), key
    assert train[-1]["consumed_samples"] == 200 * 12
    assert len(evals) == 1 and evals[0]["val_loss"] <= 2.65, evals
    assert train[-1]["loss"] < train[0]["loss"] - 0.5
    assert (run / "config.yaml").is_file() and list(run.glob("events.out.tfevents.*"))
    assert "final validation loss" in proc.stdout and "sample at step 200" in proc.stdout
    # The dataset was built once and is reused; a failing end-of-run sample does not fail the run.
    again = check(run_pretrain([RECIPE, *char_overrides(tmp_path), "training.iters=2",
                                "training.eval_iters=1", f"logging.dir={tmp_path}/run2",
                                "training.sample_tokens=4"],
                               env={"FAULT_SAMPLE_ERROR": "1"}))
    assert "building dataset" in proc.stdout and "building dataset" not in again.stdout
    assert ("warning: sampling at step 2 failed (IndexError: list index out of range (injected))"
            in again.stdout)


def test_llama_quickstart_recipe_with_wandb_offline_and_resume(tmp_path, sp_data):
    common = ["recipes/quickstart.yaml", f"data.prefix={sp_data}/works_text_document",
              f"data.tokenizer.model={sp_data}/sp.model", "model.n_layers=2", "data.seq_length=64",
              "training.micro_batch_size=4", "training.global_batch_size=8", "training.log_interval=1",
              "training.eval_iters=2", "training.sample_tokens=8", f"checkpoint.dir={tmp_path}/ckpt",
              "checkpoint.save_interval=2", "logging.wandb_mode=offline"]
    first = check(run_pretrain([*common, "training.iters=4", f"logging.dir={tmp_path}/a"]))
    assert "saved checkpoint" in first.stdout
    assert list((tmp_path / "a" / "wandb").glob("offline-run-*"))
    second = check(run_pretrain([*common, "training.iters=6", f"logging.dir={tmp_path}/b"]))
    assert "resumed from" in second.stdout
    steps = [r["step"] for r in read_metrics(tmp_path / "b") if "loss" in r]
    assert steps == [5, 6]
    assert read_metrics(tmp_path / "b")[-1]["consumed_samples"] == 6 * 8


def test_blend_of_two_datasets_trains_and_reuses_its_index_cache(tmp_path, sp_data):
    import shutil

    for name in ("a", "b"):  # two copies: a blend of distinct datasets
        for suffix in (".bin", ".idx"):
            shutil.copy(f"{sp_data}/works_text_document{suffix}", tmp_path / f"{name}_text_document{suffix}")
    blend = (f"data.blend=[{{prefix: {tmp_path}/a_text_document, weight: 0.75}},"
             f"{{prefix: {tmp_path}/b_text_document, weight: 0.25}}]")
    args = ["recipes/quickstart.yaml", "data.prefix=null", blend, f"data.tokenizer.model={sp_data}/sp.model",
            "model.n_layers=1", "data.seq_length=32", "training.micro_batch_size=4",
            "training.global_batch_size=4", "training.iters=3", "training.eval_iters=1",
            "training.sample_tokens=0", f"data.cache_dir={tmp_path}/cache", f"logging.dir={tmp_path}/run",
            'data.split="90,5,5"']
    first = check(run_pretrain(args))
    manifests = sorted(p.name for p in (tmp_path / "cache").glob("*.json"))
    # Of each dataset: train, validation and test indices (its validation alone reads fewer
    # samples than an epoch of its split, as its share of the blend's does: one entry); two
    # blend orders (validation and test have as many samples: one order).
    assert len(manifests) == 8, manifests
    # One validation loss per dataset beside the blend's, and the test split's at the end.
    (last,) = [r for r in read_metrics(tmp_path / "run") if "val_loss" in r]
    a, b = last["val_loss/a_text_document"], last["val_loss/b_text_document"]
    assert a == b != last["val_loss"]  # two copies of one dataset; the blend interleaves them
    assert math.isfinite(last["test_loss"]) and last["test_loss"] not in (a, last["val_loss"])
    assert f"val_loss/a_text_document {a:.4f}" in first.stdout and "test_loss" in first.stdout
    second = check(run_pretrain(args))
    assert sorted(p.name for p in (tmp_path / "cache").glob("*.json")) == manifests
    # A second run that resumes nothing (no checkpoint.dir): the file holds its records alone.
    assert len([r for r in read_metrics(tmp_path / "run") if "val_loss" in r]) == 1
    assert f"{tmp_path}/run/metrics.jsonl from an earlier run moved to {tmp_path}/run/metrics.1.jsonl" \
        in second.stdout
    earlier = map(json.loads, (tmp_path / "run/metrics.1.jsonl").read_text().splitlines())
    assert [r["val_loss"] for r in earlier if "val_loss" in r] == [last["val_loss"]]


def test_a_stale_deepspeed_build_lock_is_named_not_waited_on(tmp_path):
    """A build of DeepSpeed's CPU op stopped midway leaves torch's lock file; torch would wait for
    it forever in silence. The run stops at once, naming the file and the fix."""
    ext = tmp_path / "ext"
    build = ext / "deepspeed_shm_comm"
    build.mkdir(parents=True)
    (build / "lock").touch()
    old = time.time() - 3600
    os.utime(build / "lock", (old, old))
    os.utime(build, (old, old))
    proc = run_pretrain([RECIPE, *char_overrides(tmp_path)], env={"TORCH_EXTENSIONS_DIR": str(ext)},
                        timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    reason = proc.stderr.strip().splitlines()[-1]
    assert f"rm {build / 'lock'}" in reason and "left by a stopped build" in reason


def test_a_signal_before_training_is_a_one_line_reason(tmp_path):
    """SIGTERM while the run starts (here: while it builds its dataset) ends it with the signal
    named and status 143, not a silent kill."""
    proc = subprocess.Popen(pretrain_command([RECIPE, *char_overrides(tmp_path)]), cwd=REPO, env=cpu_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "building dataset" in line:
            proc.send_signal(signal.SIGTERM)
            break
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("error: stopped by SIGTERM")


def test_nvme_offload_on_a_machine_without_libaio_is_refused_before_anything_is_built(tmp_path):
    """Without libaio DeepSpeed's async-I/O op cannot be built: refused at start (exit 2, one line
    with the fix), not in the engine's first swap with DeepSpeed's "Unable to JIT load"."""
    from deepspeed.ops.op_builder.cpu import AsyncIOBuilder

    if AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("libaio is installed here: the op builds (tests/distributed/test_layouts.py trains it)")
    proc = run_pretrain([RECIPE, *char_overrides(tmp_path), "parallel.zero_stage=3",
                         "parallel.offload_params=nvme", f"parallel.nvme_path={tmp_path}/nvme"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: parallel.offload_params=nvme needs DeepSpeed's async-I/O op") \
        and "apt install libaio-dev" in line, line
    assert not (tmp_path / "nvme").exists() and not (tmp_path / "data").exists()  # before any work


def test_liger_kernels_off_a_gpu_are_refused_before_anything_is_built(tmp_path):
    """One line, exit 2, before the dataset: not a traceback from the model's build."""
    proc = run_pretrain([RECIPE, *char_overrides(tmp_path), "training.kernels=liger"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: training.kernels=liger runs Liger Kernel's Triton kernels, which need "
                           "a CUDA GPU; this run is on 'cpu'"), line
    assert not (tmp_path / "data").exists()


def test_cuda_asked_for_on_a_node_without_it_is_said_by_every_rank(tmp_path):
    """Found before the process groups exist, and nodes differ: each rank says it for itself
    (tests/unit/test_exit_reason.py: rank 1 alone), not DeepSpeed's set_device traceback."""
    proc = run_pretrain([RECIPE, *char_overrides(tmp_path), "training.device=cuda",
                         "training.micro_batch_size=6"], nproc=2)
    assert proc.returncode != 0
    # Each rank that gets to speak before the launcher stops it names itself.
    said = re.findall(r"error: rank (\d): training.device=cuda, but this torch is built without CUDA",
                      proc.stderr)
    assert said and len(said) == len(set(said)), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "data").exists()


PRETEND_DEEPSPEED = """
import runpy, sys
from packaging.version import Version
from megatron_lite.engine import versions
pretended = Version(sys.argv.pop(1))
versions.deepspeed_version = lambda: pretended
sys.argv = ["pretrain.py", *sys.argv[1:]]
runpy.run_path("pretrain.py", run_name="__main__")
"""


def test_a_pipeline_on_a_deepspeed_whose_pipeline_is_wrong_is_refused_on_every_rank(tmp_path):
    """From 0.18.3 until 0.19.6 DeepSpeed's pipeline engine trains with other gradients than one
    process (the norm up to 2x: versions.PIPELINE_GRADIENTS_WRONG, measured on those releases):
    refused before anything is built, the line once, both ranks out (here pretending 0.19.5; the
    releases on each side of the range train)."""
    script = tmp_path / "pretend_deepspeed.py"
    script.write_text(PRETEND_DEEPSPEED)
    args = [RECIPE, *char_overrides(tmp_path), "training.iters=1", "training.eval_iters=1",
            "training.sample_tokens=0", "parallel.pipeline=2"]
    proc = subprocess.run([*torchrun(2), str(script), "0.19.5", *args, NO_TENSORBOARD], cwd=REPO,
                          env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: parallel.pipeline=2 does not train correctly on DeepSpeed 0.19.5: from 0.18.3 "
                      "until 0.19.6 its pipeline engine's gradients differ from one process's (the gradient "
                      "norm, and so clipping, is off by up to 2x): pip install 'deepspeed>=0.19.6' (or "
                      "'<0.18.3'), or train without parallel.pipeline"], proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr  # the refusal's status, not a crash's
    # Before any work: no dataset built, no checkpoint.
    assert not (tmp_path / "data").exists() and not list(tmp_path.glob("**/step_*"))


COUNT_CPU_READS = """
import runpy, sys, cpuinfo
real, calls = cpuinfo.get_cpu_info, []
def counted():
    calls.append(1)
    return real()
cpuinfo.get_cpu_info = counted
import atexit
atexit.register(lambda: print(f"cpu read {len(calls)} time(s)", file=sys.stderr))
sys.argv = ["pretrain.py", *sys.argv[1:]]
runpy.run_path("pretrain.py", run_name="__main__")
"""


def test_a_zero_offload_rank_reads_the_cpu_once(tmp_path):
    """DeepSpeed asks py-cpuinfo three times as CPU Adam loads, and each answer is a Python
    process of its own (a second of each rank's start): asked once."""
    script = tmp_path / "count_cpu_reads.py"
    script.write_text(COUNT_CPU_READS)
    proc = subprocess.run([sys.executable, str(script), RECIPE, *char_overrides(tmp_path), "training.iters=1",
                           "training.eval_iters=1", "training.sample_tokens=0", "parallel.zero_stage=1",
                           "parallel.offload_optimizer=cpu"],
                          cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cpu read 1 time(s)" in proc.stderr, proc.stderr[-2000:]
