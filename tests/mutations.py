"""Mutation check of the suite's headline claims: each mutation breaks one claim with a one-line
change, in a copy of the working tree, and runs the tests that guard it; a mutation the tests
do not kill is a claim the suite does not protect.

    python tests/mutations.py                 # all, a Markdown table on stdout
    python tests/mutations.py --only resume-rng --keep

Hand-written rather than mutmut and kin: those mutate operators at random over a whole package
and run the whole suite each time (hours here), while the claims worth guarding are few, named,
and each has its own few tests. Results: docs/testing.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    claim: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = [
    Mutation("no-parallelize", "every layout really applies tensor, sequence and Ulysses parallelism",
             "megatron_lite/parallel/build.py", "    parallelize(model, dims)\n", "    pass\n",
             ("tests/distributed/test_layouts.py::test_layout_matches_single_process[tp2-megatron-sp]",
              "tests/distributed/test_layouts.py::test_layout_matches_single_process[tp2xpp2]")),
    Mutation("zero-falls-back-to-0", "the ZeRO stage asked for is the one DeepSpeed runs",
             "megatron_lite/engine/config.py",
             '"zero_optimization": {"stage": cfg.parallel.deepspeed_zero_stage}',
             '"zero_optimization": {"stage": min(cfg.parallel.deepspeed_zero_stage, 1)}',
             ("tests/distributed/test_layouts.py::test_layout_matches_single_process[dp2-zero2]",)),
    Mutation("resume-rng", "a resume restores the random state (dropout) bit for bit",
             "megatron_lite/checkpoint/load.py",
             'if same_layout and own is not None and own["rng"] is not None:', "if False:",
             ("tests/distributed/test_checkpoint.py::test_resume_after_kill_is_bitwise_exact[one-process]",)),
    Mutation("latest-before-commit", "`latest` moves only once its checkpoint is complete and in place",
             "megatron_lite/checkpoint/store.py", '    final = root / step_name(manifest["step"])\n',
             '    final = root / step_name(manifest["step"])\n'
             '    write_bytes_durably(root / LATEST, (final.name + "\\n").encode())\n',
             ("tests/distributed/test_checkpoint_faults.py::test_crash_inside_a_save_keeps_the_previous_checkpoint",)),
    Mutation("unpickle-anything", "a checkpoint file never runs code when loaded",
             "megatron_lite/checkpoint/store.py", "weights_only=True, mmap=True",
             "weights_only=False, mmap=True",
             ("tests/distributed/test_checkpoint.py::"
              "test_a_planted_file_that_would_run_code_is_refused_on_resume_and_on_conversion",)),
    Mutation("export-padding", "an export holds the tokenizer's rows only (the padding is ours)",
             "megatron_lite/model/hf_convert.py", "    if used < cfg.vocab_size:  # the padding rows",
             "    if False:  # the padding rows",
             ("tests/unit/test_hf_equivalence.py::test_a_padded_vocabulary_is_exported_as_the_tokenizers_rows",)),
    Mutation("checkpoint-padding", "a checkpoint's padded vocabulary is read as the tokenizer's rows",
             "megatron_lite/checkpoint/mapped.py",
             "value = full[:self._vocab] if name in VOCAB_PARAMETERS else full", "value = full",
             ("tests/e2e/test_convert_checkpoint.py::test_a_padded_gpt2_vocabulary_exports_the_tokenizers_rows_only",)),
    Mutation("no-device-skip", "a non-finite update is never applied when judged after it",
             "megatron_lite/training/step.py", "opt.found_inf = skip", "pass",
             ("tests/distributed/test_step_syncs.py::"
              "test_a_nonfinite_step_skipped_by_the_device_equals_one_declined_by_the_host",)),
    Mutation("no-partitioned-init", "a ZeRO-3 rank never builds its whole part of the model",
             "megatron_lite/engine/initialize.py",
             "if cfg.parallel.deepspeed_zero_stage != 3 or cfg.model.fp8:", "if True:",
             ("tests/distributed/test_partitioned_init.py::"
              "test_a_zero3_rank_never_holds_more_than_its_share_and_one_parameter",)),
    Mutation("init-from-ignored-by-stages", "checkpoint.init_from's weights reach every pipeline stage",
             "megatron_lite/parallel/build.py", "materialize(model, cfg, device, seed, initial=initial),",
             "materialize(model, cfg, device, seed),",
             ("tests/e2e/test_init_from.py::test_every_layout_starts_from_the_hf_weights",)),
    Mutation("new-phase-ignored", "a new data phase reads the new data from its first sample",
             "megatron_lite/training/trainer.py", '        if phase["start"] > 0:', "        if False:",
             ("tests/e2e/test_data_phases.py::test_a_new_phase_reads_the_new_data_from_its_first_sample",)),
    Mutation("ramp-boundary", "a batch ramp-up's steps accumulate exactly their micro-batches",
             "megatron_lite/training/step.py",
             "                engine.set_gradient_accumulation_boundary(last)", "                pass",
             ("tests/e2e/test_batch_rampup.py::"
              "test_a_ramped_run_trains_megatrons_batches_in_every_layout_and_resumes_exactly",)),
    Mutation("pipeline-bf16-output-layer-cleared", "a bf16 pipeline without ZeRO trains its last stage's "
             "output layer (DeepSpeed's bf16 optimizer clears it when the backward starts)",
             "megatron_lite/engine/pipeline.py", "    opt.backward_prologue = lambda: None\n", "",
             ("tests/distributed/test_pipeline_bf16.py::test_a_bf16_pipeline_trains_as_one_process",)),
    Mutation("nvme-without-libaio-unchecked", "NVMe offload on a machine without libaio is refused at start "
             "with the fix", "megatron_lite/training/build.py",
             "devmod.nvme_problem(acc, p.offload_optimizer, p.offload_params)", "None",
             ("tests/e2e/test_pretrain_cli.py::"
              "test_nvme_offload_on_a_machine_without_libaio_is_refused_before_anything_is_built",)),
    Mutation("pipeline-on-wrong-deepspeed-unchecked", "a pipeline is refused at start on the DeepSpeed "
             "releases whose pipeline gradients are wrong", "megatron_lite/training/build.py",
             "pipeline_problem(p.pipeline)", "None",
             ("tests/e2e/test_pretrain_cli.py::"
              "test_a_pipeline_on_a_deepspeed_whose_pipeline_is_wrong_is_refused_on_every_rank",)),
    Mutation("cpu-info-read-each-time", "a rank loading ZeRO-Offload's CPU Adam reads the CPU once, not "
             "three times (a Python process each)", "megatron_lite/engine/initialize.py",
             "        ask_cpu_info_once()  # CPU Adam's load", "        pass  # CPU Adam's load",
             ("tests/e2e/test_pretrain_cli.py::test_a_zero_offload_rank_reads_the_cpu_once",)),
    Mutation("init-from-checkpoint-whole", "a rank starting from a checkpoint of this project holds one "
             "of its parameters at a time, not the whole model", "megatron_lite/checkpoint/mapped.py",
             "        self._names = sorted(assembler.names())",
             "        self._names = sorted(assembler.names())\n"
             "        self._whole = [assembler.full(name, 'param') for name in self._names]",
             ("tests/unit/test_checkpoint_source.py::"
              "test_a_rank_reading_in_its_models_order_holds_one_parameter_at_a_time",)),
    Mutation("checkpoint-values-unchecked", "a checkpoint's gaps and non-finite weights are refused when "
             "it is opened, before anything is built", "megatron_lite/checkpoint/convert.py",
             "            assembler.check_values(name)", "            pass",
             ("tests/unit/test_checkpoint_source.py::"
              "test_a_gap_or_a_non_finite_weight_is_refused_when_the_checkpoint_is_opened",)),
    Mutation("mapped-files-unchecked", "a weight file changed in place while the model is built is an "
             "error naming it, not a crash or other weights", "megatron_lite/checkpoint/mapped.py",
             "        for file in files:\n            dev, ino, size, mtime = self._seen[file]",
             "        for file in ():\n            dev, ino, size, mtime = self._seen[file]",
             ("tests/unit/test_checkpoint_source.py::test_a_rank_file_changed_while_the_model_is_built",)),
]


def copy_tree(dest: Path) -> Path:
    """The working tree's files (tracked and untracked, not ignored) under ``dest/NAME``, with
    ``dest/shared`` pointing at the test corpus the suite reads from ``../shared``."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    root = dest / REPO.name
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / name)
    shared = REPO.parent / "shared"
    if shared.exists():
        (dest / "shared").symlink_to(shared.resolve())
    return root


def _pytest(root: Path, tests: tuple[str, ...], timeout: int) -> int | None:
    """pytest's exit status on ``tests`` in ``root``; None when they ran past ``timeout``."""
    try:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                              cwd=root, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "DS_ACCELERATOR": "cpu"}).returncode
    except subprocess.TimeoutExpired:
        return None


def run(mutation: Mutation, root: Path, timeout: int) -> tuple[str, float]:
    """The verdict: ``killed`` only when the tests pass on the unmutated tree and fail (not time
    out, not error) on the mutated one."""
    target = root / mutation.file
    text = target.read_text()
    if text.count(mutation.old) != 1:
        return "stale (the line to change is not there once: update the mutation)", 0.0
    started = time.monotonic()
    baseline = _pytest(root, mutation.tests, timeout)
    if baseline != 0:
        what = f"ran past {timeout} s" if baseline is None else f"fail (pytest exit {baseline})"
        return f"no verdict: the tests {what} without the mutation", time.monotonic() - started
    target.write_text(text.replace(mutation.old, mutation.new))
    try:
        status = _pytest(root, mutation.tests, timeout)
    finally:
        target.write_text(text)
    verdict = {0: "survived", 1: "killed", None: f"no verdict: ran past {timeout} s"}.get(
        status, f"error (pytest exit {status})")
    return verdict, time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", help="a mutation's name (repeatable); default: all")
    parser.add_argument("--timeout", type=int, default=900,
                        help="seconds per run of its tests (each runs twice: unmutated, then mutated)")
    parser.add_argument("--keep", action="store_true", help="keep the copy of the tree (its path is printed)")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"unknown mutation(s) {sorted(unknown)}; choose from {[m.name for m in MUTATIONS]}")
    dest = Path(tempfile.mkdtemp(prefix="mutations-"))
    try:
        root = copy_tree(dest)
        print("| mutation | claim | tests | result |\n|---|---|---|---|")
        survived = 0
        for m in chosen:
            verdict, seconds = run(m, root, args.timeout)
            survived += verdict != "killed"
            tests = "<br>".join(t.split("::", 1)[1] for t in m.tests)
            print(f"| `{m.name}` | {m.claim} | {tests} | {verdict} ({seconds:.0f} s) |", flush=True)
    finally:
        if args.keep:
            print(f"\nthe copy: {dest}")
        else:
            shutil.rmtree(dest, ignore_errors=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
