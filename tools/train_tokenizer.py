#!/usr/bin/env python
"""Train a tokenizer on a corpus: sentencepiece (BPE or unigram) or a char-level vocabulary.

Example:
    python tools/train_tokenizer.py --input data/works.jsonl --type sentencepiece \
        --vocab-size 4096 --output data/tokenizer/sp
writes data/tokenizer/sp.model (and sp.vocab). With --type char it writes OUTPUT.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.data.tokenizers import CharTokenizer  # noqa: E402


def iter_texts(paths: list[str], key: str) -> Iterator[str]:
    for path in paths:
        if path.endswith((".jsonl", ".json")):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        yield json.loads(line)[key]
        else:
            yield Path(path).read_text(encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help=".jsonl or plain-text files")
    p.add_argument("--json-key", default="text")
    p.add_argument("--type", choices=["sentencepiece", "char"], default="sentencepiece")
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe",
                   help="sentencepiece algorithm")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--output", required=True, help="output prefix (OUTPUT.model / OUTPUT.json)")
    args = p.parse_args(argv)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    if args.type == "char":
        tok = CharTokenizer.build("".join(iter_texts(args.input, args.json_key)), args.output + ".json")
        print(f"wrote {args.output}.json ({tok.vocab_size} characters)")
        return 0
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=(line for text in iter_texts(args.input, args.json_key)
                           for line in text.splitlines() if line.strip()),
        model_prefix=args.output, vocab_size=args.vocab_size, model_type=args.model_type,
        character_coverage=1.0, byte_fallback=True, split_digits=True,
        # Ids as Llama lays them out: <unk>=0, <s>=1, </s>=2 (the end-of-document token).
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=2,
        input_sentence_size=2_000_000, shuffle_input_sentence=True, minloglevel=2,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
    )
    print(f"wrote {args.output}.model (vocab {args.vocab_size}, {args.model_type})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
