import subprocess
import sys

import numpy as np

from megatron_lite.data.indexed import IndexedDatasetWriter
from megatron_lite.data.tokenizers import CharTokenizer
from tests.conftest import REPO, cpu_env


def _inspect(*args):
    return subprocess.run([sys.executable, str(REPO / "tools/inspect_data.py"), *map(str, args)],
                          env=cpu_env(), capture_output=True, text=True, timeout=600)


def test_stats_doc_and_lint(tmp_path):
    tok = CharTokenizer.build("abc|", tmp_path / "c.json")  # '|' stands for a separator id
    sep = tok.encode("|")[0]
    w = IndexedDatasetWriter(tmp_path / "clean", np.uint16)
    w.add_documents([tok.encode("abc|"), tok.encode("ca|")])
    w.finalize()
    tk = ["--tokenizer-type", "char", "--tokenizer-model", tmp_path / "c.json"]
    out = _inspect(tmp_path / "clean", "stats")
    assert out.returncode == 0 and "documents: 2" in out.stdout and "tokens: 7" in out.stdout
    assert _inspect(tmp_path / "clean", "doc", 1, *tk).stdout.strip() == "ca|"
    # The char vocabulary has no separator of its own: lint the ids of '|' by hand.
    from megatron_lite.data.indexed import IndexedDataset
    from tools.inspect_data import lint  # noqa: PLC0415
    assert lint(IndexedDataset(tmp_path / "clean"), 4, [sep]) == []
    w = IndexedDatasetWriter(tmp_path / "dirty", np.uint16)
    w.add_documents([tok.encode("ab|"), [sep, 1], [], [9]])  # doubled across a boundary, empty, id 9
    w.finalize()
    problems = lint(IndexedDataset(tmp_path / "dirty"), 4, [sep])
    assert len(problems) == 3
    assert "1 empty document(s), first: [2]" in problems[0]
    assert "1 doubled separator(s)" in problems[1] and "[3]" in problems[1]
    assert "1 token id(s) outside the vocabulary of 4" in problems[2]
    cli = _inspect(tmp_path / "dirty", "lint", *tk)
    assert cli.returncode == 1 and "outside the vocabulary" in cli.stdout
