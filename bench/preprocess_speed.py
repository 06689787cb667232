#!/usr/bin/env python
"""Preprocessing speed: ours vs the per-document scheme of Megatron-LM's preprocess_data.py.

Megatron-LM's tool hands one JSON line at a time to the pool (``imap`` with chunks of 32 lines),
each worker parses and tokenizes that one document and returns a Python list, and the main
process writes each document's tokens separately. The baseline here re-implements that scheme
(same tokenizer, same worker count) so both run in one invocation on the same generated corpus.
Prints tokens/s and MiB/s of each and the ratio, for 1 and 2 workers.

    python bench/preprocess_speed.py [--mb 64] [--workers 1 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from megatron_lite.data.indexed import IndexedDataset, token_dtype  # noqa: E402
from megatron_lite.data.preprocess import preprocess  # noqa: E402
from megatron_lite.data.tokenizers import load_tokenizer  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "shakespeare_works.jsonl"


def make_corpus(path: Path, megabytes: int) -> None:
    """Documents of 1-40 paragraphs of Shakespeare (or random words when the text is absent)."""
    rng = random.Random(0)
    if SHARED.is_file():
        texts = [json.loads(line)["text"] for line in SHARED.open()]
        paragraphs = [p for t in texts for p in t.split("\n\n") if p.strip()]
    else:
        words = ["".join(rng.choice("etaoinshrdlu") for _ in range(rng.randint(1, 9))) for _ in range(5000)]
        paragraphs = [" ".join(rng.choice(words) for _ in range(60)) for _ in range(20000)]
    target, size = megabytes << 20, 0
    with path.open("w") as f:
        while size < target:
            doc = "\n\n".join(rng.choice(paragraphs) for _ in range(rng.randint(1, 40)))
            line = json.dumps({"text": doc}) + "\n"
            f.write(line)
            size += len(line)


# ---- the baseline: one document per task, one write per document (Megatron-LM's scheme) ----
_tok = None


def _baseline_init(model: str) -> None:
    global _tok
    _tok = load_tokenizer("sentencepiece", model)


def _baseline_encode(line: str):
    ids = list(_tok.encode(json.loads(line)["text"]))
    ids.append(_tok.eod_id)
    return ids, len(line)


def baseline(corpus: Path, prefix: Path, model: str, workers: int, vocab: int) -> int:
    dtype = token_dtype(vocab)
    sizes = []
    with mp.get_context("spawn").Pool(workers, _baseline_init, (model,)) as pool, \
            corpus.open() as fin, open(f"{prefix}.bin", "wb") as out:
        for ids, _ in pool.imap(_baseline_encode, fin, 32):
            out.write(np.array(ids, dtype=dtype).tobytes(order="C"))
            sizes.append(len(ids))
    return sum(sizes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=64, help="corpus size in MiB (at least 50)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--vocab", type=int, default=8192)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.jsonl"
        make_corpus(corpus, a.mb)
        mib = corpus.stat().st_size / 2**20
        import sentencepiece as spm

        with corpus.open() as f:
            sample = [json.loads(f.readline())["text"][:2000] for _ in range(3000)]
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sample),
            model_prefix=str(tmp / "sp"), vocab_size=a.vocab, model_type="bpe", byte_fallback=True,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, num_threads=2)
        model = str(tmp / "sp.model")
        print(f"corpus: {mib:.1f} MiB jsonl, sentencepiece BPE vocab {a.vocab}")
        for w in a.workers:
            t = time.perf_counter()
            s = preprocess([str(corpus)], str(tmp / f"ours{w}"), ["text"], "sentencepiece", model,
                           append_eod=True, workers=w, log=lambda *_: None, show_progress=False)
            ours_s = time.perf_counter() - t
            ours_tokens = s.tokens["text"]
            t = time.perf_counter()
            base_tokens = baseline(corpus, tmp / f"base{w}", model, w, a.vocab)
            base_s = time.perf_counter() - t
            assert base_tokens == ours_tokens == IndexedDataset(tmp / f"ours{w}_text_document").n_tokens
            print(f"workers {w}: ours {ours_tokens / ours_s:,.0f} tokens/s ({mib / ours_s:.1f} MiB/s) | "
                  f"per-document baseline {base_tokens / base_s:,.0f} tokens/s ({mib / base_s:.1f} MiB/s) | "
                  f"ratio {base_s / ours_s:.2f}")


if __name__ == "__main__":
    main()
