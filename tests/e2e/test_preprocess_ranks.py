"""Preprocessing on several ranks (MPICH's mpiexec): one dataset, byte-identical to one process."""

import gzip
import json
import random
import shutil
import subprocess
import sys

import pytest

from megatron_lite.data.preprocess import PreprocessError, preprocess
from megatron_lite.data.preprocess_ranks import piece_blocks, rank_inputs
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
    got = []
    for rank in range(world):
        for item in rank_inputs(files, rank, world):
            if hasattr(item, "start"):
                got.append((item.path, b"".join(b for b, _ in piece_blocks(item, 16, lambda n: None))))
            else:
                got.append((item, item.read_bytes()))
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
    one = preprocess(inputs, str(tmp_path / "one"), ["text"], "char", str(chars), log=lambda *_: None,
                     show_progress=False)
    assert one.documents == 12 and one.counts
    gz_only = preprocess([inputs[1]], str(tmp_path / "gz"), ["text"], "char", str(chars), log=lambda *_: None,
                         show_progress=False)
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
    args = ([str(path)], str(tmp_path / "o"), ["text"], "char", str(tmp_path / "chars.json"))
    with pytest.raises(PreprocessError, match="rank 2 is not in 0..1"):
        preprocess(*args, rank=2, world=2, log=lambda *_: None)
    with pytest.raises(PreprocessError, match="hf:wikitext is a Hugging Face dataset"):
        preprocess(["hf:wikitext"], *args[1:], rank=0, world=2, log=lambda *_: None)
    assert not list(tmp_path.glob("o*"))  # nothing written
