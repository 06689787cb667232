"""Bad input never crashes preprocessing and never silently loses a valid document."""

import gzip
import json
import subprocess
import sys

import pytest

from megatron_lite.data.indexed import IndexedDataset, merge
from megatron_lite.data.preprocess import PreprocessError, PreprocessOptions, preprocess
from megatron_lite.data.tokenizers import CharTokenizer
from tests.conftest import REPO, cpu_env

ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,;:!?'\n\ufffd"


@pytest.fixture()
def chars(tmp_path):
    CharTokenizer.build(ALPHABET, tmp_path / "chars.json")
    return str(tmp_path / "chars.json")


def _run(tmp_path, chars, inputs, **kw):
    keys = tuple(kw.pop("keys", ["text"]))
    summary = preprocess([str(p) for p in inputs], str(tmp_path / "out"),
                         PreprocessOptions("char", chars, keys, show_progress=False, **kw),
                         log=lambda *_: None)
    return summary


def _texts(prefix, chars):
    tok = CharTokenizer(chars)
    ds = IndexedDataset(prefix)
    return [tok.decode(ds[i]) for i in range(len(ds))]


def test_every_bad_jsonl_case_is_counted_located_and_valid_documents_kept(tmp_path, chars):
    good = ["First good document.", "Second, good!", "Third one; fine."]
    lines = [
        b"\xef\xbb\xbf" + json.dumps({"text": good[0]}).encode(),             # 1 BOM: repaired
        b'{"text": "broken',                                                  # 2 malformed
        json.dumps({"other": "x"}).encode(),                                  # 3 missing key
        json.dumps({"text": 42}).encode(),                                    # 4 non-string
        json.dumps({"text": good[1]}).encode() + b"\r",                       # 5 CRLF: fine
        b'{"text": "bad \xff byte"}',                                         # 6 invalid UTF-8
        json.dumps({"text": ""}).encode(),                                    # 7 empty
        json.dumps({"text": "  \n "}).encode(),                               # 8 whitespace only
        json.dumps({"text": good[2]}).encode(),                               # 9
        b'{"text": "half \\ud800 pair"}',                                      # 10 lone surrogate
    ]
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    s = _run(tmp_path, chars, [src])
    assert s.counts == {"byte-order mark": 1, "malformed JSON": 1, "missing key": 1,
                        "non-string value": 1, "CRLF line endings": 1, "invalid UTF-8": 1,
                        "empty or whitespace-only document": 2, "lone surrogate": 1}
    assert s.first_locations["malformed JSON"] == [f"{src}:2"]
    assert s.first_locations["empty or whitespace-only document"] == [f"{src}:7", f"{src}:8"]
    assert s.first_locations["lone surrogate"] == [f"{src}:10"]
    assert _texts(tmp_path / "out_text_document", chars) == [good[0], good[1], "bad \ufffd byte", good[2],
                                                             "half \ufffd pair"]


@pytest.mark.parametrize("line, problem", [(b'{"text": "broken', "malformed JSON"),
                                           (b'{"text": "bad \xff"}', "invalid UTF-8"),
                                           (b'{"text": " "}', "empty or whitespace-only document")])
def test_strict_names_file_and_line_and_writes_nothing(tmp_path, chars, line, problem):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"text": "ok"}\n' + line + b"\n")
    with pytest.raises(PreprocessError, match=f"{src}:2: {problem}"):
        _run(tmp_path, chars, [src], strict=True)
    assert not list(tmp_path.glob("out*"))


def test_strict_cli_exit_code(tmp_path, chars):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"text": "ok"}\n{oops\n')
    proc = subprocess.run([sys.executable, str(REPO / "tools/preprocess_data.py"), "--input", str(src),
                           "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "char",
                           "--tokenizer-model", chars, "--strict"], env=cpu_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode != 0 and f"{src}:2" in proc.stderr


def test_a_killed_worker_fails_clearly_and_writes_nothing(tmp_path, chars):
    """A tokenizer worker killed mid-batch (FAULT_KILL_TOKENIZER_ON: the OOM killer on a huge
    line) ends preprocessing with a one-line error; no output, no hang."""
    src = tmp_path / "in.jsonl"
    with open(src, "w") as f:
        for i in range(4000):
            f.write(json.dumps({"text": "a huge line" if i == 2500 else f"doc {i}. " * 20}) + "\n")
    proc = subprocess.run([sys.executable, str(REPO / "tools/preprocess_data.py"), "--input", str(src),
                           "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "char",
                           "--tokenizer-model", chars, "--workers", "2"],
                          env={**cpu_env(), "FAULT_KILL_TOKENIZER_ON": "a huge line"}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "a tokenizer worker process died" in proc.stderr.strip().splitlines()[-1]
    assert not list(tmp_path.glob("o_*"))


def test_plain_text_files_blocks_crlf_and_gzip(tmp_path, chars):
    (tmp_path / "a.txt").write_bytes(b"Para one\r\nline two\r\n\r\n\r\nPara two\r\n")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "Zipped doc."}) + "\n")
    s = _run(tmp_path, chars, [tmp_path / "a.txt", tmp_path / "b.jsonl.gz"], text_split="blank-line")
    assert _texts(tmp_path / "out_text_document", chars) == ["Para one\nline two\n", "Para two\n",
                                                            "Zipped doc."]
    assert s.counts == {"CRLF line endings": 2}
    _run(tmp_path, chars, [tmp_path / "a.txt"], text_split="file")
    assert _texts(tmp_path / "out_text_document", chars) == ["Para one\nline two\n\n\nPara two\n"]


def test_very_long_document_is_kept_whole(tmp_path, chars):
    doc = ("All the world's a stage, and all the men and women merely players.\n" * 800_000)[:50 << 20]
    (tmp_path / "big.txt").write_text(doc)
    s = _run(tmp_path, chars, [tmp_path / "big.txt"])
    assert s.counts == {"long document": 1} and s.documents == 1
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert ds.lengths.tolist() == [len(doc)]
    assert CharTokenizer(chars).decode(ds[0]) == doc


def test_glob_of_inputs_in_sorted_order(tmp_path, chars):
    for name in ("b", "a", "c"):
        (tmp_path / f"part-{name}.jsonl").write_text(json.dumps({"text": f"doc {name}"}) + "\n")
    _run(tmp_path, chars, [tmp_path / "part-*.jsonl"])
    assert _texts(tmp_path / "out_text_document", chars) == ["doc a", "doc b", "doc c"]


def test_several_keys_give_aligned_datasets(tmp_path, chars):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": f"doc {c}", "title": f"T{c}"}) + "\n" for c in "abc"))
    _run(tmp_path, chars, [src], keys=["text", "title"])
    assert _texts(tmp_path / "out_text_document", chars) == ["doc a", "doc b", "doc c"]
    assert _texts(tmp_path / "out_title_document", chars) == ["Ta", "Tb", "Tc"]


def test_parquet_input_or_a_clear_error(tmp_path, chars):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # optional dependency: without it the error must say what to install
        (tmp_path / "x.parquet").write_bytes(b"PAR1")
        with pytest.raises(PreprocessError, match="install pyarrow"):
            _run(tmp_path, chars, [tmp_path / "x.parquet"])
        return
    pq.write_table(pa.table({"text": ["one doc", None, "two docs"]}), tmp_path / "x.parquet")
    s = _run(tmp_path, chars, [tmp_path / "x.parquet"])
    assert _texts(tmp_path / "out_text_document", chars) == ["one doc", "two docs"]
    assert s.counts == {"missing key": 1}


def test_merge_concatenates_in_order(tmp_path, chars):
    for name, docs in (("a", ["one", "two"]), ("b", ["three"])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        preprocess([str(tmp_path / f"{name}.jsonl")], str(tmp_path / name),
                   PreprocessOptions("char", chars, show_progress=False), log=lambda *_: None)
    docs, _ = merge([str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")],
                    str(tmp_path / "ab"), chunk_tokens=4)
    assert docs == 3 and _texts(tmp_path / "ab", chars) == ["one", "two", "three"]


def test_progress_bar_reports_rates(tmp_path, chars, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": "Some text."}) + "\n" for _ in range(100)))
    _run_progress = preprocess([str(src)], str(tmp_path / "o"),
                               PreprocessOptions("char", chars, show_progress=True), log=lambda *_: None)
    err = capsys.readouterr().err
    assert _run_progress.documents == 100
    assert "preprocess" in err and "docs/s" in err and "tok/s" in err


def test_a_char_vocabulary_without_the_letter_a_preprocesses(tmp_path):
    # A DNA vocabulary: separator detection must not encode a probe the tokenizer cannot.
    src = tmp_path / "dna.jsonl"
    src.write_text('{"text": "ACGTTGCA"}\n{"text": "GGGTTTAAACCC"}\n')
    (tmp_path / "chars.json").write_text('["A", "C", "G", "T"]')
    proc = subprocess.run([sys.executable, str(REPO / "tools/preprocess_data.py"), "--input", str(src),
                           "--output-prefix", str(tmp_path / "dna"), "--tokenizer-type", "char",
                           "--tokenizer-model", str(tmp_path / "chars.json"), "--no-progress"],
                          cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    texts = _texts(tmp_path / "dna_text_document", str(tmp_path / "chars.json"))
    assert texts == ["ACGTTGCA", "GGGTTTAAACCC"]
