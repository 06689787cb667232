"""Exactly one separator at every document boundary, whatever the tokenizer adds by itself."""

import json

import numpy as np
import pytest

from megatron_lite.data.indexed import IndexedDataset
from megatron_lite.data.preprocess import preprocess
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
    ("<s> $A", "BOS"), ("$A </s>", "appends EOS"), (None, "appended once")],
    ids=["adds-bos", "adds-eos", "adds-neither"])
def test_one_separator_per_boundary(tmp_path, template, policy):
    path = _hf_tokenizer(tmp_path / "tok", template)
    tok = load_tokenizer("huggingface", path)
    src = tmp_path / "in.jsonl"
    # The last document already ends with the separator's text: still only one.
    docs = [*DOCS, "final words</s>"]
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    summary = preprocess([str(src)], str(tmp_path / "out"), ["text"], "huggingface", str(path),
                         append_eod=True, log=lambda *_: None, show_progress=False)
    assert policy in summary.separator_policy
    assert summary.counts.get("doubled separator", 0) == (0 if template is None else 1)
    stream = IndexedDataset(tmp_path / "out_text_document").tokens
    separators = np.isin(stream, [tok.bos_id, tok.eod_id])
    assert separators.sum() == len(docs)  # one per document: boundaries + one at an end
    assert not np.any(separators[1:] & separators[:-1]), "two separators in a row"
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert [tok.decode(ds[i]) for i in range(len(ds))] == [*DOCS, "final words"]
