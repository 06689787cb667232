"""Exactly one separator at every document boundary, whatever the tokenizer adds by itself."""

import json

import numpy as np
import pytest

from megatron_lite.data.indexed import IndexedDataset
from megatron_lite.data.preprocess import PreprocessOptions, SeparatorPolicy, one_separator, preprocess
from megatron_lite.data.tokenizers import load_tokenizer

DOCS = ["the quick brown fox", "jumps over the lazy dog", "and runs away"]


def _hf_tokenizer(path, template: str | None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS * 20, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if template is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[("<s>", 1), ("</s>", 2)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)
    return path


@pytest.mark.parametrize("template, policy", [
    ("<s> $A", "BOS"), ("$A </s>", "appends EOS"), ("<s> $A </s>", "frames"), (None, "appended once")],
    ids=["adds-bos", "adds-eos", "adds-both", "adds-neither"])
def test_one_separator_per_boundary(tmp_path, template, policy):
    """Whatever the tokenizer adds, one boundary between documents (BOS and EOS both kept when it
    frames documents with both); a separator written in the text is text, and counted."""
    path = _hf_tokenizer(tmp_path / "tok", template)
    tok = load_tokenizer("huggingface", path)
    src = tmp_path / "in.jsonl"
    docs = [*DOCS, "final words</s>", "<s>quoted"]
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    summary = preprocess([str(src)], str(tmp_path / "out"),
                         PreprocessOptions("huggingface", str(path), append_eod=True, show_progress=False),
                         log=lambda *_: None)
    assert policy in summary.separator_policy
    assert summary.counts.get("doubled separator", 0) == 0
    assert summary.counts["special-token text"] == 2
    ds = IndexedDataset(tmp_path / "out_text_document")
    expected = {"<s> $A": ([tok.bos_id], []), "$A </s>": ([], [tok.eod_id]),
                "<s> $A </s>": ([tok.bos_id], [tok.eod_id]), None: ([], [tok.eod_id])}[template]
    for i, text in enumerate(docs):
        ids = [int(x) for x in ds[i]]
        head, tail = expected
        assert ids[:len(head)] == head and ids[len(ids) - len(tail):] == tail, (text, ids)
        inner = ids[len(head):len(ids) - len(tail)]
        assert not set(inner) & {tok.bos_id, tok.eod_id}, (text, ids)  # written ones stay text
        assert tok.decode(inner) == text


def test_framing_separators_are_kept_and_doubled_ones_inside_dropped():
    policy = SeparatorPolicy(False, 2, "frames", (1, 2), frames=True)
    docs = [[1, 5, 2, 2], [1, 1, 5, 2], [1, 2], [1, 5, 6, 2]]
    flat = np.concatenate([np.array(d) for d in docs])
    lengths = np.array([len(d) for d in docs])
    out, new_lengths, dropped = one_separator(flat, lengths, policy)
    assert out.tolist() == [1, 5, 2, 1, 5, 2, 1, 2, 1, 5, 6, 2]
    assert new_lengths.tolist() == [3, 3, 2, 4] and dropped.tolist() == [1, 1, 0, 0]


@pytest.mark.parametrize("template", ["<s> $A", "<s> $A </s>", None],
                         ids=["adds-bos", "adds-both", "adds-neither"])
def test_the_backend_encodes_as_transformers_does_in_this_process_and_in_workers(tmp_path, template):
    """The tokenizers backend that encodes (and that worker processes get, pickled, instead of
    importing transformers) gives transformers' own ids, special tokens written in the text
    included; two workers write the bytes of one process."""
    import pickle

    path = _hf_tokenizer(tmp_path / "tok", template)
    tok = load_tokenizer("huggingface", path)
    assert tok.fast is not None
    texts = [*DOCS, "final words</s>", "<s>quoted", "  two leading spaces\nand a line"]
    expected = tok.tok(texts, split_special_tokens=True)["input_ids"]
    assert tok.encode_batch(texts) == expected
    assert [tok.encode(t) for t in texts] == expected
    assert pickle.loads(pickle.dumps(tok.fast)).encode_batch(texts) == expected
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in texts * 50))
    for workers in (1, 2):
        preprocess([str(src)], str(tmp_path / f"w{workers}"),
                   PreprocessOptions("huggingface", str(path), append_eod=True, workers=workers,
                                     show_progress=False), log=lambda *_: None)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"w1_text_document.{ext}").read_bytes() == \
            (tmp_path / f"w2_text_document.{ext}").read_bytes()


def test_a_saved_tokenizer_loads_as_autotokenizer_loads_it(tmp_path):
    """A tokenizer directory of its own (no model config.json) loads through transformers'
    generic fast class directly: the class, ids and special tokens AutoTokenizer gives; with a
    model config.json next to it, AutoTokenizer itself decides."""
    from transformers import AutoTokenizer

    from megatron_lite.data.tokenizers import _generic_fast_class

    path = _hf_tokenizer(tmp_path / "tok", "<s> $A")
    assert _generic_fast_class(path) is not None
    tok, auto = load_tokenizer("huggingface", path), AutoTokenizer.from_pretrained(str(path))
    assert type(tok.tok) is type(auto)
    texts = [*DOCS, "final words</s>"]
    assert tok.encode_batch(texts) == auto(texts, split_special_tokens=True)["input_ids"]
    assert (tok.eod_id, tok.bos_id, tok.special_texts) == (auto.eos_token_id, auto.bos_token_id,
                                                           tuple(auto.all_special_tokens))
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert _generic_fast_class(path) is None
