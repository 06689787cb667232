"""A user's mistake with a tool is one line naming the problem and the fix, with exit status 2
(usage, bad input), never a traceback: each mistake driven through the tool's command line
(its ``main(argv)``, in this process: the same parsing and the same messages)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_lite.data.indexed import IndexedDatasetWriter
from megatron_lite.data.tokenizers import CharTokenizer


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A two-document jsonl corpus, its char vocabulary, a dataset of it under the name
    preprocess_data.py gives ``--output-prefix corpus`` and a file that is no char vocabulary."""
    d = tmp_path_factory.mktemp("tool-errors")
    texts = ["to be or not to be", "that is the question"]
    (d / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = CharTokenizer.build("".join(texts), d / "chars.json")
    w = IndexedDatasetWriter(d / "corpus_text_document", np.uint16)
    w.add_documents([tok.encode(t) for t in texts])
    w.finalize()
    (d / "sp.model").write_bytes(b"\x0a\x80\x01binary protobuf")
    CharTokenizer.build("abc", d / "small.json")  # too few ids for the corpus
    (d / "empty.txt").write_text("")
    (d / "zebra.jsonl").write_text('{"text": "to be"}\n{"text": "zebra"}\n')  # z: not in chars.json
    (d / "run").mkdir()  # a run directory whose spikes.jsonl ends in a torn line
    (d / "run" / "spikes.jsonl").write_text('{"event": "sp')
    return d


def _run(tool: str, argv: list[str], capsys) -> tuple[int, list[str]]:
    """(exit status, the non-empty lines on stderr) of tools/TOOL.py with ``argv``."""
    main = importlib.import_module(f"tools.{tool}").main
    try:
        status = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's usage errors
        status = e.code
    err = capsys.readouterr().err
    return status, [line for line in err.splitlines() if line.strip()]


CASES = [
    ("train_tokenizer", ["--input", "{d}/missing.jsonl", "--output", "{d}/out/sp"],
     "error: --input {d}/missing.jsonl does not exist"),
    ("train_tokenizer", ["--input", "{d}/corpus.jsonl", "--json-key", "txt", "--output", "{d}/out/sp"],
     "error: {d}/corpus.jsonl line 1 has no key 'txt' (its keys: 'text'); pass --json-key KEY"),
    ("train_tokenizer", ["--input", "{d}/corpus.jsonl", "--vocab-size", "-5", "--output", "{d}/out/sp"],
     "argument --vocab-size: -5: must be at least 1"),
    ("train_tokenizer", ["--input", "{d}/corpus.jsonl", "--vocab-size", "abc", "--output", "{d}/out/sp"],
     "argument --vocab-size: 'abc': not a whole number"),
    ("train_tokenizer", ["--input", "{d}/empty.txt", "--type", "char", "--output", "{d}/out/e"],
     "error: {d}/empty.txt: no text to build a vocabulary from"),
    ("train_tokenizer", ["--input", "{d}/corpus.jsonl", "--vocab-size", "5000", "--output", "{d}/out/sp"],
     "error: sentencepiece refused: "),
    ("inspect_data", ["{d}/corpus_text_document", "doc", "999"],
     "error: document 999 does not exist: {d}/corpus_text_document has 2 document(s) (0..1)"),
    ("inspect_data", ["{d}/corpus_text_document", "sample", "99", "--seq-length", "8"],
     "error: sample 99 does not exist: {d}/corpus_text_document has 4 windows of 8 tokens"),
    ("inspect_data", ["{d}/corpus_text_document", "doc"], "doc needs a number: inspect_data.py PREFIX doc N"),
    ("inspect_data", ["{d}/corpus_text_document", "lint"],
     "lint needs --tokenizer-type and --tokenizer-model"),
    ("inspect_data", ["{d}/corpus", "stats"], "did you mean {d}/corpus_text_document?"),
    ("inspect_data", ["{d}/corpus_text_document.bin", "stats"],
     "did you mean {d}/corpus_text_document?"),
    ("inspect_data", ["{d}/corpus_text_document", "doc", "0", "--tokenizer-type", "char",
                      "--tokenizer-model", "{d}/sp.model"],
     "error: tokenizer '{d}/sp.model' cannot be read as a char tokenizer: {d}/sp.model: "),
    ("inspect_data", ["{d}/corpus_text_document", "sample", "0", "--seq-length", "0"],
     "argument --seq-length: 0: must be at least 1"),
    ("inspect_data", ["{d}/corpus_text_document", "doc", "0", "--tokenizer-type", "char",
                      "--tokenizer-model", "{d}/small.json"],
     "is outside the tokenizer's 3 ids: give the tokenizer the dataset was made with"),
    ("train_tokenizer", ["--input", "{d}/corpus.jsonl", "--type", "char",
                         "--output", "{d}/corpus.jsonl/sub/c"],
     "error: [Errno 20] Not a directory"),
    ("train_tokenizer", ["--input", "{d}/corpus.jsonl", "--type", "char", "--output", "{d}/out/"],
     "names a directory; give a file prefix"),
    ("spike_report", ["{d}/no-run"], "error: {d}/no-run is not a directory (give a run's logging.dir)"),
    ("spike_report", ["{d}/run", "--text", "--tokenizer-type", "char", "--tokenizer-model", "{d}/none.json"],
     "error: tokenizer '{d}/none.json' does not exist"),
    ("convert_checkpoint", ["--from", "hf", "/nonexistent", "{d}/imported"],
     "error: /nonexistent does not exist (a local Hugging Face model directory"),
    ("convert_checkpoint", ["--from", "hf", "{d}/llama-hf", "{d}/imported"],
     "error: {d}/llama-hf does not exist (a local Hugging Face model directory"),
    ("convert_checkpoint", ["--to", "hf", "{d}/no-checkpoint", "{d}/export"],
     "error: checkpoint {d}/no-checkpoint does not exist"),
    ("convert_checkpoint", ["--to", "hf", "{d}/no-checkpoint", "{d}"],
     "error: output {d} is not empty; give a new directory, or --overwrite"),
    ("spike_report", ["{d}/run", "--plot", "{d}/events.jsonl"],
     "argument --plot: {d}/events.jsonl: give a file ending in .png, .pdf, .svg, .jpg, .jpeg"),
    ("plot_run", ["{d}/run", "--output", "{d}/plot.txt"],
     "argument --output: {d}/plot.txt: give a file ending in .png"),
    ("spike_report", ["{d}/run", "--samples", "-3"], "argument --samples: -3: must be at least 1"),
    ("preprocess_data", ["--input", "{d}/corpus.jsonl", "--output-prefix", "{d}/out/", "--tokenizer-type",
                         "char", "--tokenizer-model", "{d}/chars.json"],
     "--output-prefix {d}/out/ is a directory; give a name in it"),
    ("preprocess_data", ["--input", "{d}/corpus.jsonl", "--output-prefix", "{d}/o", "--tokenizer-type",
                         "char", "--tokenizer-model", "{d}/chars.json", "--workers", "0"],
     "argument --workers: 0: must be at least 1"),
    ("preprocess_data", ["--input", "{d}/corpus.jsonl", "--output-prefix", "{d}/o", "--tokenizer-type",
                         "char", "--tokenizer-model", "{d}/chars.json", "--world-size", "0"],
     "argument --world-size: 0: must be at least 1"),
    ("preprocess_data", ["--input", "{d}/corpus.jsonl", "--output-prefix", "{d}/o", "--tokenizer-type",
                         "char", "--tokenizer-model", "{d}/chars.json", "--rank", "0", "--world-size", "2",
                         "--wait", "-1"],
     "argument --wait: -1: must be a finite number of at least 0"),
    ("inspect_data", ["{d}/corpus_text_document", "stats", "5"], "stats takes no number"),
    ("preprocess_data", ["--input", "{d}/zebra.jsonl", "--output-prefix", "{d}/zebra", "--tokenizer-type",
                         "char", "--tokenizer-model", "{d}/chars.json"],
     "error: {d}/zebra.jsonl:2: character 'z' is not in the char vocabulary"),
    # What datasets and runs are built on is replaced only when asked.
    ("train_tokenizer", ["--input", "{d}/corpus.jsonl", "--type", "char", "--output", "{d}/chars.json"],
     "error: {d}/chars.json exists (datasets built with it hold its ids); give another --output, or "
     "--overwrite"),
    ("preprocess_data", ["--input", "{d}/corpus.jsonl", "--output-prefix", "{d}/corpus", "--tokenizer-type",
                         "char", "--tokenizer-model", "{d}/chars.json"],
     "error: {d}/corpus_text_document.bin/.idx exists; give another --output-prefix, or --overwrite"),
    ("merge_datasets", ["--inputs", "{d}/corpus_text_document",
                        "--output-prefix", "{d}/corpus_text_document"],
     "error: {d}/corpus_text_document.bin/.idx exists; give another --output-prefix, or --overwrite"),
    # --overwrite replaces an earlier export, never a run, checkpoint or dataset directory.
    ("convert_checkpoint", ["--to", "hf", "{d}/no-checkpoint", "{d}", "--overwrite"],
     "error: output {d} is not an earlier export (it holds chars.json, corpus.jsonl, "
     "corpus_text_document.bin"),
    ("convert_checkpoint", ["--to", "hf", "{d}/no-checkpoint", "{d}/export", "--tokenizer", "{d}/chars.json"],
     "error: --tokenizer {d}/chars.json: not a Hugging Face tokenizer directory (no tokenizer_config.json)"),
]


@pytest.mark.parametrize("tool, argv, says", CASES, ids=[f"{t}-{i}" for i, (t, _, _) in enumerate(CASES)])
def test_a_mistake_is_one_line_with_status_2(files, capsys, tool, argv, says):
    status, lines = _run(tool, [a.format(d=files) for a in argv], capsys)
    assert status == 2, lines
    assert says.format(d=files) in lines[-1], lines
    assert not any("Traceback" in line for line in lines)
    # argparse prints its usage above the line; the tools' own errors are the only line.
    assert len(lines) == 1 or lines[0].startswith("usage:"), lines


def test_a_char_tokenizer_given_a_sentencepiece_model_names_the_type_to_use(files, capsys):
    status, (line,) = _run("inspect_data", [files / "corpus_text_document", "doc", "0", "--tokenizer-type",
                                            "char", "--tokenizer-model", files / "sp.model"], capsys)
    assert status == 2
    assert "it looks like a sentencepiece tokenizer: set data.tokenizer.type=sentencepiece" in line


def test_an_output_name_with_the_suffix_is_the_files_name(files, capsys):
    """``--output chars.json`` writes chars.json, not chars.json.json."""
    status, _ = _run("train_tokenizer", ["--input", files / "corpus.jsonl", "--type", "char",
                                         "--output", files / "out" / "chars.json"], capsys)
    assert status == 0 and sorted(p.name for p in (files / "out").iterdir()) == ["chars.json"]


class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


TOOLS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "tools").glob("*.py")
               if not p.stem.startswith("_")) + ["launch.ray_train"]  # (_*: shared helpers)


@pytest.mark.parametrize("tool", TOOLS)
def test_every_option_of_every_tool_says_what_it_does(tool, monkeypatch):
    """--help explains each argument, and the examples in a tool's description keep their line
    continuations (a backslash at a line's end inside a plain docstring joins the lines)."""
    import argparse

    def caught(self, *args, **kwargs):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_intermixed_args", caught)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", caught)
    module = importlib.import_module(tool if "." in tool else f"tools.{tool}")
    with pytest.raises(_Parsed) as e:
        module.main([])
    parser = e.value.parser
    silent = [a.option_strings or a.dest for a in parser._actions
              if a.help is None and a.help is not argparse.SUPPRESS]
    assert not silent, f"{tool}: no help for {silent}"
    source = Path(module.__file__).read_text()
    if " \\\n" in source.split('"""')[1]:
        assert " \\\n" in (module.__doc__ or ""), f"{tool}: its docstring's line continuations are lost"


def test_a_sentencepiece_output_named_like_the_model_file_is_that_file(files, capsys):
    """``--output sp4.model`` writes sp4.model (and sp4.vocab), not sp4.model.model."""
    status, _ = _run("train_tokenizer", ["--input", files / "corpus.jsonl", "--vocab-size", "280",
                                         "--output", files / "sp4" / "sp4.model"], capsys)
    assert status == 0 and sorted(p.name for p in (files / "sp4").iterdir()) == ["sp4.model", "sp4.vocab"]


def test_a_prefix_given_as_preprocess_datas_output_prefix_names_the_dataset_it_meant(files):
    """``data.prefix=data/quickstart/works`` (the --output-prefix value) points at
    ``works_text_document``."""
    from megatron_lite.config import load_config
    from megatron_lite.data.build import ensure_dataset
    from tests.conftest import REPO

    cfg = load_config(REPO / "recipes/quickstart.yaml", [
        f"data.prefix={files}/corpus", "data.build_from=null", f"data.tokenizer.model={files}/chars.json"])
    with pytest.raises(FileNotFoundError) as e:
        ensure_dataset(cfg.data)
    assert f"did you mean data.prefix={files}/corpus_text_document?" in str(e.value)


def test_a_torn_last_line_of_the_spike_log_is_skipped(files, capsys):
    status, _ = _run("spike_report", [files / "run"], capsys)
    assert status == 0


def test_a_missing_plotting_library_is_one_line_with_the_quoted_install(monkeypatch):
    from tools._cli_args import plotting_library

    monkeypatch.setitem(sys.modules, "plotext", None)  # what an install without .[report] has
    with pytest.raises(SystemExit, match=r"^error: --terminal needs plotext: pip install -e '\.\[report\]'$"):
        plotting_library("plotext", "--terminal")
