#!/usr/bin/env python
r"""Preprocessing speed against its limit: the tokenizer's own encode of the same documents.

For sentencepiece (BPE trained here) and a Hugging Face fast tokenizer (GPT-2 style byte-level
BPE files made here), at each worker count W, on one generated jsonl corpus:

- ours: ``tools/preprocess_data.py``'s ``preprocess`` end to end (loading the tokenizer,
  reading, JSON, tokenizing, writing .bin/.idx) with ``--workers W``, in a fresh process;
- the limit: W processes, each given its share of the documents already parsed in memory,
  encoding them with the tokenizer's fastest native batch call (sentencepiece's ``encode`` of a
  list, to arrays where the installed sentencepiece can; the ``tokenizers`` library's
  ``encode_batch_fast``), threaded as ours is (the tokenizer's own threads on every core in one
  process, one thread per process when W > 1); the time from a common start to the last
  process's end. Nothing a tool does
  besides tokenizing is in it, so ``limit / ours`` is at most about 1;
- for sentencepiece also Megatron-LM's per-document scheme (``imap`` of one JSON line per task,
  chunks of 32, one write per document), re-implemented with the same tokenizer.

    python bench/preprocess_speed.py [--mb 64] [--rounds 3] [--workers 1 2]
        [--tokenizers sentencepiece huggingface] [--no-baseline]
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from megatron_lite.data.indexed import IndexedDataset, token_dtype  # noqa: E402
from megatron_lite.data.preprocess import PreprocessOptions, preprocess  # noqa: E402
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


# ---- the limit: the tokenizer's own batch encode, W processes ----

def _native(tok):
    """The tokenizer's own batch call, without our wrapper."""
    if hasattr(tok, "sp"):  # its fastest output: arrays where this sentencepiece makes them
        out = {"out_type": "numpy"} if tok.encode_batch_arrays(["a"]) is not None else {}
        return lambda texts: tok.sp.encode(texts, num_threads=tok.num_threads, **out)
    backend = tok.tok.backend_tokenizer  # its fastest batch call: no offsets computed
    backend.encode_special_tokens = True
    return lambda texts: [e.ids for e in backend.encode_batch_fast(texts)]


def _limit_process(kind: str, model: str, corpus: str, rank: int, world: int, barrier, results) -> None:
    if world > 1:  # as preprocess's workers: one tokenizer thread each
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = load_tokenizer(kind, model)
    if world > 1 and hasattr(tok, "num_threads"):
        tok.num_threads = 1
    with open(corpus) as f:
        lines = f.readlines()
    share = lines[len(lines) * rank // world:len(lines) * (rank + 1) // world]
    texts = [json.loads(line)["text"] for line in share]
    encode = _native(tok)
    barrier.wait()
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(texts), 256):
        tokens += sum(len(ids) for ids in encode(texts[i:i + 256]))
    results.put((start, time.perf_counter(), tokens))


def _ours_process(kind: str, model: str, corpus: str, out: str, workers: int, results) -> None:
    import sentencepiece  # noqa: F401  (imports are before the clock, as the limit's)
    if kind == "huggingface":
        import transformers  # noqa: F401
    options = PreprocessOptions(kind, model, append_eod=True, workers=workers, show_progress=False)
    start = time.perf_counter()
    s = preprocess([corpus], out, options, log=lambda *_: None)
    results.put((time.perf_counter() - start, s.tokens["text"], s.documents))


def ours(kind: str, model: str, corpus: Path, out: Path, workers: int) -> tuple[float, int, int]:
    """(seconds, tokens written, documents) of ``preprocess`` in a fresh process, as a user runs
    it once (and as the limit runs: a process that has encoded a corpus before encodes the next
    one slower, the tokenizers library's memory in it scattered), from the call to its return:
    the tokenizer's loading from its files included, the interpreter's start and the imports
    (the tokenizer's library too: transformers takes 0.9 s) not."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_ours_process, args=(kind, model, str(corpus), str(out), workers, results))
    proc.start()
    got = results.get()
    proc.join()
    return got


def limit(kind: str, model: str, corpus: Path, workers: int) -> tuple[float, int]:
    """(seconds from the common start to the last process's end, tokens without separators)."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(workers), ctx.Queue()
    procs = [ctx.Process(target=_limit_process, args=(kind, model, str(corpus), r, workers, barrier, results))
             for r in range(workers)]
    for proc in procs:
        proc.start()
    got = [results.get() for _ in procs]
    for proc in procs:
        proc.join()
    return max(end for _, end, _ in got) - min(start for start, _, _ in got), sum(n for _, _, n in got)


def gpt2_style_tokenizer(sample: list[str], vocab: int, directory: Path) -> str:
    """Byte-level BPE files (vocab.json, merges.txt) trained on ``sample``, as a transformers
    GPT2TokenizerFast directory."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(sample, vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False)
    directory.mkdir(parents=True, exist_ok=True)
    bpe.save_model(str(directory))  # vocab.json and merges.txt, GPT-2's files
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                            bos_token="<|endoftext|>").save_pretrained(str(directory))
    return str(directory)


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
    p.add_argument("--mb", type=int, default=64, help="corpus size in MiB")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--tokenizers", nargs="+", default=["sentencepiece", "huggingface"],
                   choices=["sentencepiece", "huggingface"])
    p.add_argument("--rounds", type=int, default=3, help="runs of ours and of the limit, alternating")
    p.add_argument("--no-baseline", action="store_true", help="skip the per-document baseline")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.jsonl"
        make_corpus(corpus, a.mb)
        mib = corpus.stat().st_size / 2**20
        with corpus.open() as f:
            sample = [json.loads(line)["text"][:2000] for line in itertools.islice(f, 3000)]
        models = {}
        if "sentencepiece" in a.tokenizers:
            import sentencepiece as spm

            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sample),
                model_prefix=str(tmp / "sp"), vocab_size=a.vocab, model_type="bpe", byte_fallback=True,
                unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, num_threads=2)
            models["sentencepiece"] = str(tmp / "sp.model")
        if "huggingface" in a.tokenizers:
            models["huggingface"] = gpt2_style_tokenizer(sample, a.vocab, tmp / "gpt2")
        print(f"corpus: {mib:.1f} MiB jsonl, vocabularies of {a.vocab}, {os.cpu_count()} cores")
        for kind, model in models.items():
            for w in a.workers:
                ratios = []
                for rnd in range(a.rounds):
                    # Alternating which goes first: a machine's speed drifts within a round too.
                    if rnd % 2:
                        limit_s, limit_tokens = limit(kind, model, corpus, w)
                    out = tmp / f"ours{w}-{rnd}"
                    ours_s, ours_tokens, documents = ours(kind, model, corpus, out, w)
                    if not rnd % 2:
                        limit_s, limit_tokens = limit(kind, model, corpus, w)
                    assert ours_tokens == IndexedDataset(f"{out}_text_document").n_tokens
                    for suffix in (".bin", ".idx"):
                        Path(f"{out}_text_document{suffix}").unlink()
                    assert limit_tokens + documents == ours_tokens  # ours adds one EOD per document
                    ratios.append(limit_s / ours_s)
                    line = (f"{kind} workers {w} round {rnd + 1}: ours {ours_tokens / ours_s:,.0f} tokens/s "
                            f"({mib / ours_s:.1f} MiB/s) | tokenizer alone "
                            f"{limit_tokens / limit_s:,.0f} tokens/s | limit ratio {limit_s / ours_s:.2f}")
                    if kind == "sentencepiece" and not a.no_baseline and rnd == 0:
                        t = time.perf_counter()
                        base_tokens = baseline(corpus, tmp / f"base{w}", model, w, a.vocab)
                        base_s = time.perf_counter() - t
                        assert base_tokens == ours_tokens
                        line += (f" | per-document baseline {base_tokens / base_s:,.0f} tokens/s, "
                                 f"ratio {base_s / ours_s:.2f}")
                    print(line, flush=True)
                print(f"{kind} workers {w}: limit ratios {', '.join(f'{r:.2f}' for r in ratios)} "
                      f"(median {statistics.median(ratios):.2f})", flush=True)

if __name__ == "__main__":
    main()
