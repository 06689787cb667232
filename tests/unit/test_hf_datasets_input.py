"""Hugging Face datasets as preprocessing input: the same bytes as the same documents in jsonl,
for any worker count; the same bad-input policy; a Hub name without network is one line naming
the dataset; a Hub tokenizer id fails the same way, a local tokenizer directory always loads."""

from __future__ import annotations

import json
import subprocess
import sys

import datasets
import pytest

from megatron_lite.data.preprocess import PreprocessError, PreprocessOptions, preprocess
from megatron_lite.data.tokenizers import CharTokenizer, load_tokenizer
from tests.conftest import REPO, WORKS_JSONL, cpu_env, require_shared

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The works as documents, with the rows a crawl has (an empty text, a missing one, a
    number), as jsonl and as a saved dataset (one split, and a train/validation dict)."""
    require_shared()
    d = tmp_path_factory.mktemp("hfds")
    texts = [json.loads(line)["text"][:20000] for line in WORKS_JSONL.read_text().splitlines()[:12]]
    rows = [*({"text": t, "title": f"play {i}"} for i, t in enumerate(texts)),
            {"text": "   ", "title": "blank"}, {"text": None, "title": "none"}]
    with open(d / "docs.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    datasets.Dataset.from_list(rows).save_to_disk(str(d / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:6]),
                          "validation": datasets.Dataset.from_list(rows[6:])}).save_to_disk(str(d / "dict"))
    CharTokenizer.build("".join(sorted(set("".join(texts)))), d / "chars.json")
    return d


def _bytes(prefix) -> tuple[bytes, bytes]:
    return tuple(open(f"{prefix}_text_document.{ext}", "rb").read() for ext in ("bin", "idx"))


def _run(corpus, out, inputs, **kw):
    return preprocess([str(i) for i in inputs], str(out),
                      PreprocessOptions("char", str(corpus / "chars.json"), show_progress=False, **kw),
                      log=lambda *_: None)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_saved_dataset_preprocesses_to_the_bytes_of_the_same_jsonl(tmp_path, corpus, workers):
    want = _run(corpus, tmp_path / "jsonl", [corpus / "docs.jsonl"], workers=workers)
    got = _run(corpus, tmp_path / "saved", [corpus / "saved"], workers=workers)
    assert _bytes(tmp_path / "saved") == _bytes(tmp_path / "jsonl")
    assert got.documents == want.documents == 12
    # The bad rows are counted as in jsonl (the same policy), located by row.
    assert got.counts == want.counts == {"empty or whitespace-only document": 1, "missing key": 1}
    assert got.first_locations["missing key"] == [f"{corpus / 'saved'}:row 14"]
    # Its Arrow file, read directly, is the same input.
    arrow = sorted((corpus / "saved").glob("*.arrow"))
    _run(corpus, tmp_path / "arrow", arrow, workers=workers)
    assert _bytes(tmp_path / "arrow") == _bytes(tmp_path / "jsonl")


def test_a_split_of_a_dataset_dict(tmp_path, corpus):
    _run(corpus, tmp_path / "val", [corpus / "dict"], split="validation")
    whole = _run(corpus, tmp_path / "all", [corpus / "saved"])
    train = _run(corpus, tmp_path / "train", [corpus / "dict"])
    val = _run(corpus, tmp_path / "val", [corpus / "dict"], split="validation")
    assert train.documents + val.documents == whole.documents
    with pytest.raises(PreprocessError, match="no split 'test' .*train, validation.*--split"):
        _run(corpus, tmp_path / "t", [corpus / "dict"], split="test")


def test_a_hub_dataset_without_network_is_one_line_naming_it(tmp_path, corpus):
    proc = subprocess.run(
        [sys.executable, "tools/preprocess_data.py", "--input", "hf:wikitext:wikitext-2-raw-v1",
         "--output-prefix", str(tmp_path / "w"), "--tokenizer-type", "char", "--tokenizer-model",
         str(corpus / "chars.json")], cwd=REPO, env={**cpu_env(), **OFFLINE}, capture_output=True,
        text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot load the Hugging Face dataset "
                                                   "'wikitext' (config wikitext-2-raw-v1), split 'train'")
    assert "save_to_disk" in lines[0]
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_hub_tokenizer_id_without_network_names_it_and_a_local_directory_loads(tmp_path, corpus):
    proc = subprocess.run(
        [sys.executable, "tools/preprocess_data.py", "--input", str(corpus / "docs.jsonl"),
         "--output-prefix", str(tmp_path / "w"), "--tokenizer-type", "huggingface",
         "--tokenizer-model", "openai-community/gpt2"], cwd=REPO, env={**cpu_env(), **OFFLINE},
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: tokenizer 'openai-community/gpt2' is not a local directory and did not load from the "
        "Hugging Face Hub"), proc.stderr
    with pytest.raises(FileNotFoundError, match="does not exist"):  # a path, never a Hub id
        load_tokenizer("huggingface", "./no/such/dir")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<eos>": 2, "<unk>": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    hf.save_pretrained(tmp_path)
    local = load_tokenizer("huggingface", tmp_path)
    assert local.encode("a b a") == [0, 1, 0] and local.eod_id == 2
