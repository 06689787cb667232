#!/usr/bin/env python
r"""Train a tokenizer on a corpus: sentencepiece (BPE or unigram) or a char-level vocabulary.

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
from tools._cli_args import positive_int  # noqa: E402


class InputError(ValueError):
    """A corpus file that cannot be read as asked (named, with its line)."""


def iter_texts(paths: list[str], key: str) -> Iterator[str]:
    for path in paths:
        try:
            if path.endswith((".jsonl", ".json")):
                with open(path, encoding="utf-8") as f:
                    for n, line in enumerate(f, 1):
                        if line.strip():
                            yield _json_text(line, key, path, n)
            else:
                yield Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _json_text(line: str, key: str, path: str, n: int) -> str:
    try:
        doc = json.loads(line)
    except ValueError as e:
        raise InputError(f"{path} line {n} is not JSON ({e}); give .jsonl with one document per "
                         "line, or plain text under another extension") from None
    if not isinstance(doc, dict) or key not in doc:
        keys = ", ".join(map(repr, doc)) if isinstance(doc, dict) else "none: not an object"
        raise InputError(f"{path} line {n} has no key '{key}' (its keys: {keys}); pass --json-key KEY")
    if not isinstance(doc[key], str):
        raise InputError(f"{path} line {n}: '{key}' is a {type(doc[key]).__name__}, not text")
    return doc[key]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help=".jsonl or plain-text files")
    p.add_argument("--json-key", default="text", help="the key of each .jsonl document's text")
    p.add_argument("--type", choices=["sentencepiece", "char"], default="sentencepiece",
                   help="subword (sentencepiece) or one token per character (char)")
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe",
                   help="sentencepiece algorithm")
    p.add_argument("--vocab-size", type=positive_int, default=4096, help="sentencepiece vocabulary size")
    p.add_argument("--output", required=True,
                   help="output prefix: writes OUTPUT.model (sentencepiece) or OUTPUT.json (char); "
                        "a name already ending in that suffix is taken as the file's name")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing tokenizer file (datasets built with it then no longer match)")
    args = p.parse_args(argv)
    suffix = ".json" if args.type == "char" else ".model"
    output = args.output.removesuffix(suffix)
    if Path(output + suffix).exists() and not args.overwrite:
        print(f"error: {output + suffix} exists (datasets built with it hold its ids); give another "
              "--output, or --overwrite to replace it", file=sys.stderr)
        return 2
    missing = [path for path in args.input if not Path(path).is_file()]
    if missing:
        print(f"error: --input {missing[0]} does not exist or is not a file"
              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""), file=sys.stderr)
        return 2
    if output.endswith("/") or not Path(output).name:
        print(f"error: --output {args.output} names a directory; give a file prefix such as "
              f"{args.output.rstrip('/')}/tok", file=sys.stderr)
        return 2
    try:
        return _train(args, output)
    except (InputError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _train(args: argparse.Namespace, output: str) -> int:
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    if args.type == "char":
        text = "".join(iter_texts(args.input, args.json_key))
        if not text:
            raise InputError(f"{', '.join(args.input)}: no text to build a vocabulary from")
        tok = CharTokenizer.build(text, output + ".json")
        print(f"wrote {output}.json ({tok.vocab_size} characters)")
        return 0
    import sentencepiece as spm

    texts = (line for text in iter_texts(args.input, args.json_key)
             for line in text.splitlines() if line.strip())
    try:
        _train_sentencepiece(spm, texts, output, args)
    except RuntimeError as e:  # sentencepiece's own checks: a vocabulary larger than the corpus allows
        print(f"error: sentencepiece refused: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"wrote {output}.model (vocab {args.vocab_size}, {args.model_type})")
    return 0


def _train_sentencepiece(spm, texts: Iterator[str], output: str, args: argparse.Namespace) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=texts,
        model_prefix=output, vocab_size=args.vocab_size, model_type=args.model_type,
        character_coverage=1.0, byte_fallback=True, split_digits=True,
        # Ids as Llama lays them out: <unk>=0, <s>=1, </s>=2 (the end-of-document token).
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=2,
        input_sentence_size=2_000_000, shuffle_input_sentence=True, minloglevel=2,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
    )


if __name__ == "__main__":
    sys.exit(main())
