import json
import subprocess
import sys

import pytest

from megatron_lite.data.indexed import IndexedDataset
from megatron_lite.data.preprocess import PreprocessOptions, preprocess
from megatron_lite.data.tokenizers import CharTokenizer, load_tokenizer
from tests.conftest import REPO, WORKS_JSONL, cpu_env

TEXTS = ["To be, or not to be, that is the question.", "Whether 'tis nobler in the mind to suffer",
         "The slings and arrows of outrageous fortune,", "Or to take arms against a sea of troubles"]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp") / "sp"
    subprocess.run([sys.executable, str(REPO / "tools/train_tokenizer.py"), "--input", str(WORKS_JSONL),
                    "--vocab-size", "512", "--output", str(out)], check=True, env=cpu_env(),
                   capture_output=True, timeout=600)
    return f"{out}.model"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(TEXTS * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.decoder = decoders.ByteLevel()
    path = tmp_path_factory.mktemp("hf")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>")
    fast.save_pretrained(path)
    return path


def test_char_round_trip(tmp_path):
    tok = CharTokenizer.build("hello world", tmp_path / "c.json")
    assert tok.vocab_size == len(set("hello world"))
    assert tok.decode(tok.encode("world hello")) == "world hello"
    with pytest.raises(ValueError, match="not in the char vocabulary"):
        tok.encode("xyz")


def test_sentencepiece_round_trip(sp_model):
    tok = load_tokenizer("sentencepiece", sp_model)
    assert tok.eod_id == 2 and tok.vocab_size == 512
    for text in TEXTS + ["  two spaces\nand a newline ~é"]:
        assert tok.decode(tok.encode(text)) == text


def test_sentencepiece_arrays_are_its_lists(sp_model):
    """Preprocessing's array output is sentencepiece's own ids, where the installed release
    makes arrays; Megatron's tokenizer (special tokens split out first) never takes it."""
    tok = load_tokenizer("sentencepiece", sp_model)
    arrays = tok.encode_batch_arrays(TEXTS)
    if arrays is None:  # an older sentencepiece: it really has no array output
        with pytest.raises((ValueError, TypeError, RuntimeError)):
            tok.sp.encode(TEXTS, out_type="numpy")
    else:
        assert [a.tolist() for a in arrays] == tok.encode_batch(TEXTS)
    assert load_tokenizer("megatron-sentencepiece", sp_model).encode_batch_arrays(TEXTS) is None


def test_one_process_encodes_in_two_threads_in_input_order(tmp_path, sp_model, monkeypatch):
    """Many small batches through the two encoding threads of a one-process run: every
    document comes out in input order, as sentencepiece encodes it alone."""
    import threading

    import sentencepiece as spm

    import megatron_lite.data.preprocess.encode as encode
    from megatron_lite.data.preprocess import readers

    monkeypatch.setattr(readers, "BATCH_BYTES", 2048)
    threads = set()
    encode_batch = encode.encode_batch

    def spy(batch):
        threads.add(threading.current_thread().name)
        return encode_batch(batch)

    monkeypatch.setattr(encode, "encode_batch", spy)
    docs = [f"{i}: " + " ".join(TEXTS[(i + k) % len(TEXTS)] for k in range(1 + i % 9)) for i in range(500)]
    _jsonl(tmp_path / "in.jsonl", docs)
    preprocess([str(tmp_path / "in.jsonl")], str(tmp_path / "out"),
               PreprocessOptions("sentencepiece", sp_model, append_eod=True, workers=1), log=lambda *a: None)
    assert len(threads) == 2 and all(name.startswith("encode") for name in threads), threads
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert [ds[i].tolist() for i in range(len(ds))] == [sp.encode(d) + [sp.eos_id()] for d in docs]


def test_huggingface_local_directory(hf_dir):
    tok = load_tokenizer("huggingface", hf_dir)
    assert tok.eod_id == 1
    assert tok.decode(tok.encode(TEXTS[0])) == TEXTS[0]
    assert tok.encode_batch(TEXTS[:2]) == [tok.encode(t) for t in TEXTS[:2]]


def _jsonl(path, docs, extra_lines=()):
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
        for line in extra_lines:
            f.write(line + "\n")


def test_preprocess_same_bytes_for_any_worker_count_and_eod_once(tmp_path, sp_model):
    docs = TEXTS * 200
    _jsonl(tmp_path / "in.jsonl", docs)
    outs = []
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        preprocess([str(tmp_path / "in.jsonl")], str(prefix),
                   PreprocessOptions("sentencepiece", sp_model, append_eod=True, workers=workers),
                   log=lambda *a: None)
        outs.append(((tmp_path / f"w{workers}_text_document.bin").read_bytes(),
                     (tmp_path / f"w{workers}_text_document.idx").read_bytes()))
    assert outs[0] == outs[1]
    ds = IndexedDataset(tmp_path / "w1_text_document")
    tok = load_tokenizer("sentencepiece", sp_model)
    assert len(ds) == len(docs)
    for i in (0, 1, 799):
        ids = ds[i].tolist()
        assert ids[-1] == tok.eod_id and ids[-2] != tok.eod_id  # exactly one separator
        assert tok.decode(ids[:-1]) == docs[i]


def test_preprocess_cli_uses_megatron_naming(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps(sorted(set("".join(TEXTS)))))
    (tmp_path / "a.txt").write_text(TEXTS[0])
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools/preprocess_data.py"), "--input", str(tmp_path / "a.txt"),
         "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "char",
         "--tokenizer-model", str(tmp_path / "c.json")],
        env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert IndexedDataset(tmp_path / "out_text_document")[0].size == len(TEXTS[0])
    bad = subprocess.run(
        [sys.executable, str(REPO / "tools/preprocess_data.py"), "--input", str(tmp_path / "a.txt"),
         "--output-prefix", str(tmp_path / "o2"), "--tokenizer-type", "char", "--append-eod",
         "--tokenizer-model", str(tmp_path / "c.json")],
        env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "end-of-document" in bad.stderr


def test_megatron_tokenizer_names_write_megatron_ids(tmp_path, sp_model):
    """Megatron-LM's --tokenizer-type names mean what they mean there. The expected ids are
    spelled out from Megatron-LM's tokenizers over sentencepiece itself:
    SentencePieceTokenizer appends <CLS> <SEP> <EOD> <MASK> (then <PAD>, as this model has no
    pad; its <s> and </s> keep their ids), parses those written in the text, and ends every
    document with <EOD> (even after one); GPTSentencePieceTokenizer is the model's own
    vocabulary, encodes the whole text and ends documents with the model's EOS."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=sp_model)
    n, eos = sp.get_piece_size(), sp.eos_id()
    assert sp.pad_id() < 0 and sp.id_to_piece(sp.bos_id()) == "<s>" and sp.id_to_piece(eos) == "</s>"
    eod = n + 2
    docs = ["To be<EOD>or not</s>to be", "it ends here<EOD>"]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    want = {
        "SentencePieceTokenizer": [
            [*sp.encode("To be"), eod, *sp.encode("or not"), eos, *sp.encode("to be"), eod],
            [*sp.encode("it ends here"), eod, *sp.encode(""), eod]],
        "GPTSentencePieceTokenizer": [[*sp.encode(d), eos] for d in docs],
    }
    for name, expected in want.items():
        proc = subprocess.run([sys.executable, str(REPO / "tools/preprocess_data.py"), "--input", str(src),
                               "--output-prefix", str(tmp_path / name), "--tokenizer-type", name,
                               "--tokenizer-model", sp_model, "--append-eod"],
                              env=cpu_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        ds = IndexedDataset(tmp_path / f"{name}_text_document")
        assert [ds[i].tolist() for i in range(len(ds))] == expected, name
    tok = load_tokenizer("megatron-sentencepiece", sp_model)
    assert tok.vocab_size == n + 5 and tok.eod_id == eod
    assert tok.decode(tok.encode(docs[0])) == docs[0]
