"""Preprocessing on several ranks (MPICH's mpiexec): one dataset, byte-identical to one process."""

import gzip
import json
import random
import shutil
import socket
import subprocess
import sys
import time

import pytest

from megatron_lite.data.preprocess import PreprocessError, PreprocessOptions, preprocess
from megatron_lite.data.preprocess.pieces import piece_blocks, rank_inputs
from megatron_lite.data.tokenizers import CharTokenizer
from tests.conftest import REPO, WORKS_JSONL, cpu_env, require_shared


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_every_line_goes_to_exactly_one_rank_in_order(tmp_path, world):
    rng = random.Random(world)
    files = []
    for i, n in enumerate([0, 1, 7, 40]):
        path = tmp_path / f"f{i}.jsonl"
        path.write_bytes(b"".join(b"x" * rng.randint(0, 30) + b"\n" for _ in range(n)) + b"tail" * (i % 2))
        files.append(path)
    gz = tmp_path / "z.jsonl.gz"  # compressed: a whole unit
    gz.write_bytes(gzip.compress(b"{}\n"))
    files.insert(2, gz)
    got, counted, read = [], [], 0
    for rank in range(world):
        for item in rank_inputs(files, rank, world):
            if hasattr(item, "start"):
                got.append((item.path, b"".join(b for b, _ in piece_blocks(item, 16, counted.append))))
                read += len(got[-1][1])
            else:
                got.append((item, item.read_bytes()))
    # The bytes the ranks report reading from pieces are the bytes they read (a summary's input).
    assert sum(counted) == read
    # Joined in rank order, the ranks' shares are the files, each byte once.
    for path in files:
        assert b"".join(data for p, data in got if p == path) == path.read_bytes()
    assert [p for p, _ in got] == sorted((p for p, _ in got), key=files.index)


def test_two_and_three_ranks_under_mpiexec_write_the_single_process_dataset(tmp_path):
    require_shared()
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:  # conftest puts the environment's bin first on PATH
        pytest.skip("no mpiexec: the test extra installs MPICH's (pip install -e '.[test]')")
    plays = [json.loads(line) for line in WORKS_JSONL.read_text().splitlines()][:12]
    data = tmp_path / "in"
    data.mkdir()
    lines = [json.dumps({"text": p["text"][:40_000]}) for p in plays]
    (data / "a.jsonl").write_text("\n".join(lines[:5]) + "\n")
    (data / "b.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines[5:7]) + "\n").encode()))
    # c: a bad line in the middle (counted once, by whichever rank holds it) and no final newline.
    (data / "c.jsonl").write_text("\n".join([*lines[7:10], "{not json", *lines[10:]]))
    chars = tmp_path / "chars.json"
    CharTokenizer.build("".join(sorted({c for line in lines for c in json.loads(line)["text"]})), chars)
    inputs = [str(data / n) for n in ("a.jsonl", "b.jsonl.gz", "c.jsonl")]
    quiet = PreprocessOptions("char", str(chars), show_progress=False)
    one = preprocess(inputs, str(tmp_path / "one"), quiet, log=lambda *_: None)
    assert one.documents == 12 and one.counts
    gz_only = preprocess([inputs[1]], str(tmp_path / "gz"), quiet, log=lambda *_: None)
    assert gz_only.documents == 2
    # 3 ranks over one compressed file: two ranks have nothing (empty parts merge too).
    cases = [(2, inputs, "one", 12), (3, inputs, "one", 12), (3, inputs[1:2], "gz", 2)]
    for world, files, reference, documents in cases:
        out = tmp_path / f"w{world}{reference}"
        proc = subprocess.run(
            [mpiexec, "-n", str(world), sys.executable, str(REPO / "tools" / "preprocess_data.py"),
             "--input", *files, "--output-prefix", str(out), "--tokenizer-type", "char",
             "--tokenizer-model", str(chars), "--no-progress"],
            cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        for suffix in (".bin", ".idx"):
            assert (tmp_path / f"{out.name}_text_document{suffix}").read_bytes() == \
                (tmp_path / f"{reference}_text_document{suffix}").read_bytes(), (world, suffix)
        # One rank merged and gave the whole summary; the parts and their markers are gone.
        assert proc.stdout.count("\nwrote ") == 1, proc.stdout
        assert f"\n{documents} documents, " in proc.stdout, proc.stdout
        assert sorted(p.name for p in tmp_path.glob(f"{out.name}*")) == [
            f"{out.name}_text_document.bin", f"{out.name}_text_document.idx"]


def test_bad_ranks_and_hub_datasets_on_several_ranks_are_refused(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "ab"}\n')
    CharTokenizer.build("ab", tmp_path / "chars.json")
    args = ([str(path)], str(tmp_path / "o"), PreprocessOptions("char", str(tmp_path / "chars.json")))
    with pytest.raises(PreprocessError, match="rank 2 is not in 0..1"):
        preprocess(*args, rank=2, world=2, log=lambda *_: None)
    with pytest.raises(PreprocessError, match="hf:wikitext is a Hugging Face dataset"):
        preprocess(["hf:wikitext"], *args[1:], rank=0, world=2, log=lambda *_: None)
    assert not list(tmp_path.glob("o*"))  # nothing written


# ---------------------------------------------------------------- parts from separate jobs

def _preprocess_cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(tmp_path / "in.jsonl"),
         "--output-prefix", str(tmp_path / "out" / "o"), "--tokenizer-type", "char",
         "--tokenizer-model", str(tmp_path / "chars.json"), "--no-progress", *args],
        cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=120)


@pytest.fixture()
def corpus(tmp_path):
    lines = [json.dumps({"text": f"a{'cab ' * (i + 3)}b{i}", "meta": i}) for i in range(12)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    CharTokenizer.build("".join(json.loads(line)["text"] for line in lines), tmp_path / "chars.json")
    return tmp_path


def _single_process_bytes(tmp_path) -> bytes:
    preprocess([str(tmp_path / "in.jsonl")], str(tmp_path / "ref"),
               PreprocessOptions("char", str(tmp_path / "chars.json"), show_progress=False),
               log=lambda *_: None)
    return b"".join((tmp_path / f"ref_text_document{s}").read_bytes() for s in (".bin", ".idx"))


def _written(tmp_path) -> bytes:
    return b"".join((tmp_path / "out" / f"o_text_document{s}").read_bytes() for s in (".bin", ".idx"))


def test_ranks_refuse_a_dataset_already_at_the_output_unless_each_is_told_to_replace_it(corpus):
    """A merged dataset appears only once every rank's part is in: one there when a rank starts
    is another run's, kept as one process keeps it (it was silently replaced)."""
    (corpus / "out").mkdir()
    for suffix in (".bin", ".idx"):
        (corpus / "out" / f"o_text_document{suffix}").write_bytes(
            (corpus / "chars.json").read_bytes())  # any bytes: it is not read, only kept
    before = _written(corpus)
    for rank in (0, 1):
        proc = _preprocess_cli(corpus, "--rank", str(rank), "--world-size", "2")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr.strip() == (f"error: {corpus}/out/o_text_document.bin/.idx exists; give another "
                                       "--output-prefix, or --overwrite (given to every rank) to replace it")
    assert _written(corpus) == before and not list((corpus / "out").glob("o.part-*"))
    assert _preprocess_cli(corpus, "--rank", "0", "--world-size", "2", "--overwrite").returncode == 3
    assert _preprocess_cli(corpus, "--rank", "1", "--world-size", "2", "--overwrite").returncode == 0
    assert _written(corpus) == _single_process_bytes(corpus)


def test_a_part_from_another_tokenizer_is_never_merged(corpus):
    first = _preprocess_cli(corpus, "--rank", "0", "--world-size", "2")
    # One rank alone: its part is committed, the dataset is not written yet -- not a success.
    assert first.returncode == 3, first.stdout + first.stderr
    assert "part(s) 1" in first.stderr and "--rank 1 --world-size 2" in first.stderr
    assert not (corpus / "out" / "o_text_document.bin").exists()
    # The tokenizer is retrained in place (same file name, other ids), then the other rank runs.
    chars = corpus / "chars.json"
    chars.write_text(json.dumps(json.loads(chars.read_text())[::-1]))
    second = _preprocess_cli(corpus, "--rank", "1", "--world-size", "2")
    assert second.returncode == 2, second.stdout + second.stderr
    assert "part 0 of 2" in second.stderr and "tokenizer contents" in second.stderr
    assert "--rank 0 --world-size 2" in second.stderr and len(second.stderr.strip().splitlines()) == 1
    assert not (corpus / "out" / "o_text_document.bin").exists()
    # Rank 0 again, with the tokenizer as it is now: it rebuilds its part and merges (rank 1's
    # committed part is reused), giving the single-process bytes of the new tokenizer.
    third = _preprocess_cli(corpus, "--rank", "0", "--world-size", "2")
    assert third.returncode == 0, third.stdout + third.stderr
    assert _written(corpus) == _single_process_bytes(corpus)
    left = sorted(p.name for p in (corpus / "out").iterdir())
    assert left == ["o_text_document.bin", "o_text_document.idx"]


@pytest.mark.parametrize("change", ["tokenizer contents", "json keys", "append-eod", "text split", "inputs"])
def test_the_signature_covers_everything_that_changes_the_bytes(tmp_path, change):
    from megatron_lite.data.preprocess.parts import (
        differences,
        signature,
        signature_fields,
        tokenizer_fingerprint,
    )

    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "ab"}\n')
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "model.safetensors").write_bytes(b"weights")  # not the tokenizer: not hashed

    def fields(**kw):
        options = PreprocessOptions("huggingface", str(tok), **kw)
        tokenizer = tokenizer_fingerprint("huggingface", str(tok))
        return signature_fields([src], 2, options.output_fields(tokenizer, "no separator"))

    before = fields()
    (tok / "model.safetensors").write_bytes(b"other weights")
    assert signature(fields()) == signature(before)
    if change == "tokenizer contents":
        (tok / "tokenizer.json").write_text('{"changed": 1}')
        after = fields()
    elif change == "inputs":
        src.write_text('{"text": "abc"}\n')
        after = fields()
    else:
        after = fields(**{"json keys": {"json_keys": ("body",)}, "append-eod": {"append_eod": True},
                          "text split": {"text_split": "blank-line"}}[change])
    assert signature(after) != signature(before)
    assert differences(after, before).startswith(change.split(" (")[0])


def test_a_stale_merge_lock_is_taken_over_or_refused_with_the_command(corpus):
    out = corpus / "out"
    out.mkdir()
    lock = out / "o.merging"
    # A lock of unknown holding (a merger killed before it wrote who it was), seen by a rank that
    # may not wait: refused, naming the rm to run; nothing is merged or lost.
    lock.touch()
    assert _preprocess_cli(corpus, "--rank", "0", "--world-size", "2").returncode == 3
    refused = _preprocess_cli(corpus, "--rank", "1", "--world-size", "2")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"rm {lock}" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    assert (out / "o.part-00000-of-00002.done.json").exists()
    # A lock whose holder (a process on this host) is dead: taken over, the dataset written.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "since": 0}))
    took = _preprocess_cli(corpus, "--rank", "1", "--world-size", "2")
    assert took.returncode == 0, took.stdout + took.stderr
    assert f"took over {lock}" in took.stdout and "reused" in took.stdout
    assert _written(corpus) == _single_process_bytes(corpus)
    assert not lock.exists()


def test_an_unrefreshed_lock_is_taken_over_and_a_waiting_rank_sees_the_merge(corpus, monkeypatch):
    from megatron_lite.data.preprocess import merge

    monkeypatch.setattr(merge, "LOCK_STALE_S", 1.0)
    monkeypatch.setattr(merge, "POLL_S", 0.1)
    (corpus / "out").mkdir()
    (corpus / "out" / "o.merging").write_text(json.dumps({"host": "elsewhere", "pid": 1, "since": 0}))
    chars = str(corpus / "chars.json")
    args = ([str(corpus / "in.jsonl")], str(corpus / "out" / "o"),
            PreprocessOptions("char", chars, show_progress=False))
    # Rank 0 waits in another process for rank 1's merge (its default wait under a launcher).
    waiting = subprocess.Popen(
        [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", args[0][0], "--output-prefix",
         args[1], "--tokenizer-type", "char", "--tokenizer-model", chars, "--no-progress", "--rank", "0",
         "--world-size", "2", "--wait", "120"],
        cwd=REPO, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (corpus / "out" / "o.part-00000-of-00002.done.json").exists():
            assert waiting.poll() is None and time.monotonic() < deadline, waiting.stdout.read()
            time.sleep(0.1)
        logs = []
        whole = preprocess(*args, rank=1, world=2, wait=30, log=logs.append)
        assert any("has not refreshed it" in line for line in logs), logs
        assert whole.documents == 12
        out, _ = waiting.communicate(timeout=60)
    finally:
        waiting.kill()
    assert waiting.returncode == 0, out
    assert "written by another rank and verified (12 documents)" in out
    assert _written(corpus) == _single_process_bytes(corpus)


def test_a_typo_in_json_keys_writes_nothing_and_names_the_keys(corpus):
    # One process, then two ranks (the whole run has no document: the last rank refuses to merge
    # and removes the parts, which can never make a dataset).
    for ranks in ([], ["--rank", "1", "--world-size", "2"]):
        if ranks:
            first = _preprocess_cli(corpus, "--json-keys", "txt", "--rank", "0", "--world-size", "2")
            assert first.returncode == 3, first.stderr
        proc = _preprocess_cli(corpus, "--json-keys", "txt", *ranks)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "no document written" in proc.stderr and "'txt'" in proc.stderr
        assert "'meta', 'text'" in proc.stderr
        assert not list((corpus / "out").glob("o_txt_document*")), list((corpus / "out").iterdir())
        assert not list((corpus / "out").glob("*.done.json"))
    # Only the keys no record has are named; the typo fixed, the ranks write the dataset.
    proc = _preprocess_cli(corpus, "--json-keys", "text", "txt")
    assert proc.returncode == 2 and "no record has the key(s) 'txt' (" in proc.stderr, proc.stderr
    assert _preprocess_cli(corpus, "--rank", "0", "--world-size", "2").returncode == 3
    assert _preprocess_cli(corpus, "--rank", "1", "--world-size", "2").returncode == 0
    assert _written(corpus) == _single_process_bytes(corpus)


def test_a_damaged_committed_part_is_rebuilt_not_reused(corpus):
    assert _preprocess_cli(corpus, "--rank", "0", "--world-size", "2").returncode == 3
    part = corpus / "out" / "o_text_document.part-00000-of-00002.bin"
    part.write_bytes(part.read_bytes()[:-4])  # a truncated copy, a disk error
    again = _preprocess_cli(corpus, "--rank", "0", "--world-size", "2")
    assert again.returncode == 3 and "reused" not in again.stdout, again.stdout + again.stderr
    assert _preprocess_cli(corpus, "--rank", "1", "--world-size", "2").returncode == 0
    assert _written(corpus) == _single_process_bytes(corpus)


def test_a_rank_that_fails_stops_the_ranks_waiting_for_it(tmp_path):
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:  # conftest puts the environment's bin first on PATH
        pytest.skip("no mpiexec: the test extra installs MPICH's (pip install -e '.[test]')")
    # Rank 1's share has a bad line and --strict refuses it; rank 0 finishes its part first and
    # waits for rank 1 (an hour by default under a launcher, which does not stop it): it must stop
    # with rank 1's reason instead.
    lines = [json.dumps({"text": f"ab{'ba' * (i + 5)}"}) for i in range(20)]
    lines[15] = "{not json"
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    CharTokenizer.build("ab", tmp_path / "chars.json")
    proc = subprocess.run(
        [mpiexec, "-n", "2", sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input",
         str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "out" / "o"), "--tokenizer-type",
         "char", "--tokenizer-model", str(tmp_path / "chars.json"), "--no-progress", "--strict"],
        cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "malformed JSON (--strict)" in proc.stderr, proc.stderr
    assert "error: rank 1 of 2 failed: " in proc.stderr, proc.stderr
    assert not (tmp_path / "out" / "o_text_document.bin").exists()
