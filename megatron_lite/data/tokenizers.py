"""Tokenizers behind one small interface: sentencepiece, Hugging Face, character-level.

Only a Hugging Face tokenizer named by its Hub id (``meta-llama/Llama-3.2-1B``; not a local
directory) touches the network, through transformers (or transformers' cache of it); a local
directory loads with ``local_files_only``. Sizing a model without training it (``--dry-run``,
``--plan``) never touches the network: ``vocab_size_offline``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np


class Tokenizer(Protocol):
    vocab_size: int
    eod_id: int | None
    """End-of-document id appended between documents (None when the vocabulary has none)."""
    bos_id: int | None
    special_texts: tuple[str, ...]
    """The written forms of the special tokens (``</s>``, ``<|endoftext|>``). Raw text that holds
    one is encoded as text, never as the token: a page that quotes ``<|endoftext|>`` must not
    end its document in the middle."""

    def encode(self, text: str) -> Sequence[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[Sequence[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class CharTokenizer:
    """One id per character, from a JSON list of characters (nanoGPT shakespeare_char style)."""

    bos_id = None
    special_texts = ()

    def __init__(self, path: str | Path):
        chars = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(chars, list) or not all(isinstance(c, str) and len(c) == 1 for c in chars):
            raise ValueError(f"char vocabulary '{path}' must be a JSON list of single characters")
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.vocab_size = len(chars)
        self.eod_id = None
        self._table = np.full(max(map(ord, chars), default=0) + 1, -1, dtype=np.int64)
        self._table[[ord(c) for c in chars]] = np.arange(len(chars))

    @staticmethod
    def build(text: str, path: str | Path) -> CharTokenizer:
        """Write the sorted character set of ``text`` to ``path`` and load it."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(sorted(set(text)), ensure_ascii=False), encoding="utf-8")
        return CharTokenizer(path)

    def encode(self, text: str) -> np.ndarray:
        # Vectorised: code points through a lookup table (a 50 MB document takes a fraction of a
        # second, where a Python loop takes many and a list of ints gigabytes).
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        if points.size and points.max() >= self._table.size:
            bad = chr(int(points[points >= self._table.size][0]))
            raise ValueError(f"character {bad!r} is not in the char vocabulary")
        ids = self._table[points]
        if ids.size and ids.min() < 0:
            raise ValueError(f"character {chr(int(points[ids < 0][0]))!r} is not in the char vocabulary")
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[int(i)] for i in ids)


class SentencePieceTokenizer:
    def __init__(self, path: str | Path):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self.sp.get_piece_size()
        self.eod_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        # Control and unknown pieces: sentencepiece encodes their written forms as plain text.
        self.special_texts = tuple(self.sp.id_to_piece(i) for i in range(self.vocab_size)
                                   if self.sp.is_control(i) or self.sp.is_unknown(i))
        self.num_threads = -1  # preprocessing workers set 1: the processes are the parallelism
        self._numpy_output = _has_numpy_output(self.sp)

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # sentencepiece encodes a list in its own C++ threads (all cores unless limited).
        return self.sp.encode(list(texts), num_threads=self.num_threads)

    def encode_batch_arrays(self, texts: Sequence[str]) -> list[np.ndarray] | None:
        """``encode_batch`` as int32 arrays, made without a Python int per token (a tenth of
        preprocessing's time); None where the installed sentencepiece has no such output."""
        if not self._numpy_output:
            return None
        return self.sp.encode(list(texts), num_threads=self.num_threads, out_type="numpy")

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode(list(ids))


def _has_numpy_output(sp) -> bool:
    """Whether this sentencepiece encodes to arrays (``out_type="numpy"``, newer releases)."""
    try:
        out = sp.encode(["a"], out_type="numpy")
    except (ValueError, TypeError, RuntimeError):
        return False
    return bool(out) and isinstance(out[0], np.ndarray)


class MegatronSentencePieceTokenizer(SentencePieceTokenizer):
    """Megatron-LM's ``SentencePieceTokenizer``, id for id. (Its ``GPTSentencePieceTokenizer`` is
    plain ``sentencepiece`` here: the model's own vocabulary, the model's EOS ends documents.)

    The sentencepiece vocabulary, then Megatron's special tokens appended in its order:
    ``<CLS> <SEP> <EOD> <MASK>``, then the model's pad, BOS and EOS pieces (``<PAD>``, ``<BOS>``,
    ``<EOS>`` where the model has none); a piece already in the vocabulary keeps its id. Written
    forms of these special tokens in the text are parsed as the tokens, as Megatron-LM does
    (the text between them is encoded piece by piece), and documents end with ``<EOD>``.
    """

    megatron_exact = True  # preprocessing reproduces Megatron's bytes (see separator_policy)

    def __init__(self, path: str | Path):
        super().__init__(path)
        self._numpy_output = False  # its encode splits at the special tokens first
        size = self.vocab_size
        vocab = {self.sp.id_to_piece(i): i for i in range(size)}
        self.specials: dict[str, int] = {}

        def add(piece: str) -> int:
            self.specials[piece] = vocab.setdefault(piece, len(vocab))
            return self.specials[piece]

        for piece in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            add(piece)
        ids = {}
        for name, sp_id, fallback in (("pad", self.sp.pad_id(), "<PAD>"), ("bos", self.sp.bos_id(), "<BOS>"),
                                      ("eos", self.sp.eos_id(), "<EOS>")):
            ids[name] = add(self.sp.id_to_piece(sp_id) if 0 <= sp_id < size else fallback)
        self.vocab_size = len(vocab)
        self.eod_id, self.bos_id = self.specials["<EOD>"], ids["bos"]
        self.special_texts = tuple(self.specials)
        self._pieces = {i: piece for piece, i in self.specials.items()}
        # Megatron takes the earliest special token in the text, the first added on a tie: the
        # leftmost match of an alternation in that order.
        self._split = re.compile("(" + "|".join(map(re.escape, self.specials)) + ")")

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        parts = self._split.split(text)
        for k, part in enumerate(parts):
            if k % 2:
                ids.append(self.specials[part])
            else:
                ids.extend(self.sp.encode(part))
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        out, run = [], []
        for i in ids:
            i = int(i)
            if i in self._pieces:
                out += [self.sp.decode(run), self._pieces[i]]
                run = []
            else:
                run.append(i)
        return "".join(out) + self.sp.decode(run)


class BackendTokenizer:
    """A Hugging Face fast tokenizer's own backend (the ``tokenizers`` library) with the ids that
    transformers resolved for it: encodes exactly as ``HFTokenizer`` does, without transformers'
    per-call Python work (its ``BatchEncoding``, attention masks, offsets) and without importing
    transformers, which imports torch (1.4 s in each preprocessing worker). Pickles as the
    backend's JSON, so worker processes get it from the parent."""

    def __init__(self, backend, vocab_size: int, eod_id: int | None, bos_id: int | None,
                 special_texts: tuple[str, ...]):
        self.backend = backend
        self.vocab_size, self.eod_id, self.bos_id = vocab_size, eod_id, bos_id
        self.special_texts = special_texts

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # Special tokens written in the text are text (transformers' split_special_tokens sets
        # the same switch, per call: the backend object is shared with it).
        self.backend.encode_special_tokens = True
        return [e.ids for e in self.backend.encode_batch_fast(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=True)


class HFTokenizer:
    """A local Hugging Face tokenizer, used as configured: special tokens it adds by itself (a
    Llama BOS, say) are kept, and preprocessing detects them (see ``separator_policy``)."""

    def __init__(self, path: str | Path):
        local = Path(path).exists()
        generic = _generic_fast_class(Path(path)) if local else None
        if generic is not None:
            self.tok = generic.from_pretrained(str(path), local_files_only=True)
        elif local:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        else:
            from transformers import AutoTokenizer

            try:
                self.tok = AutoTokenizer.from_pretrained(str(path))
            except Exception as e:  # the network, the Hub, a gated model: one line for each
                reason = " ".join(str(e).split())[:300] or type(e).__name__
                raise FileNotFoundError(
                    f"tokenizer '{path}' is not a local directory and did not load from the Hugging "
                    f"Face Hub ({reason}); where the network allows, save it (hf download {path} "
                    "--local-dir DIR) and pass DIR") from None
        self.vocab_size = len(self.tok)
        self.eod_id = self.tok.eos_token_id
        self.bos_id = self.tok.bos_token_id
        self.special_texts = tuple(self.tok.all_special_tokens)
        # What encodes, and what preprocessing's worker processes get instead of loading
        # transformers (None: the transformers path, loaded in each worker).
        self.fast = self._backend()

    def _backend(self) -> BackendTokenizer | None:
        """The backend alone where it gives transformers' ids (checked on a probe with special
        tokens written in it); None for tokenizers whose Python class adds its own steps."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is None or not getattr(self.tok, "is_fast", False):
            return None
        fast = BackendTokenizer(backend, self.vocab_size, self.eod_id, self.bos_id, self.special_texts)
        probe = ["a", " Two  spaces, a tab\tand ünïcode.\n", " ".join(("x", *self.special_texts, "y"))]
        ours = fast.encode_batch(probe)
        theirs = self.tok(probe, split_special_tokens=True)["input_ids"]
        return fast if [list(x) for x in ours] == [list(x) for x in theirs] else None

    # split_special_tokens: special tokens written in the text are text (see special_texts);
    # the ones the tokenizer adds by itself (a Llama BOS) are still added.
    def encode(self, text: str) -> list[int]:
        if self.fast is not None:
            return self.fast.encode(text)
        return self.tok.encode(text, split_special_tokens=True)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self.fast is not None:
            return self.fast.encode_batch(texts)
        return self.tok(list(texts), split_special_tokens=True)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


GENERIC_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _generic_fast_class(directory: Path):
    """transformers' generic fast class where ``AutoTokenizer`` resolves ``directory`` to it by
    the tokenizer's own files alone: no model config (``config.json`` steers AutoTokenizer by
    model type), no custom code, and ``tokenizer_config.json`` naming the generic class, as
    ``save_pretrained`` of a trained tokenizer writes it. Loading it directly skips the import of
    transformers' model configuration, which imports torch (slow, in every worker); else None."""
    config = directory / "tokenizer_config.json"
    if (directory / "config.json").exists() or not (directory / "tokenizer.json").is_file() \
            or not config.is_file():
        return None
    try:
        settings = json.loads(config.read_text())
    except (OSError, ValueError):
        return None  # AutoTokenizer reports it
    if not isinstance(settings, dict) or "auto_map" in settings:
        return None
    import transformers

    # transformers 5's generic class is TokenizersBackend; before it, PreTrainedTokenizerFast,
    # which those releases save without its "Fast" (AutoTokenizer adds it back).
    generic = getattr(transformers, "TokenizersBackend", None)
    names = GENERIC_FAST if generic is not None else (*GENERIC_FAST, "PreTrainedTokenizer")
    if settings.get("tokenizer_class") not in names:
        return None
    return generic or transformers.PreTrainedTokenizerFast


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def is_hub_id(name: str) -> bool:
    """``org/name`` or ``name`` as the Hugging Face Hub spells repositories (never a path that
    starts with ``/``, ``.`` or ``~``, and no deeper than one slash)."""
    return HUB_ID.fullmatch(name) is not None


def load_tokenizer(kind: str, path: str | Path) -> Tokenizer:
    """The tokenizer of ``kind`` ('char', 'sentencepiece', 'huggingface', 'megatron-sentencepiece')
    stored at ``path`` (for 'huggingface', also a Hub id)."""
    if not Path(path).exists() and not (kind == "huggingface" and is_hub_id(str(path))):
        raise FileNotFoundError(f"tokenizer '{path}' does not exist (data.tokenizer.model)")
    kinds = {"char": CharTokenizer, "sentencepiece": SentencePieceTokenizer, "huggingface": HFTokenizer,
             "megatron-sentencepiece": MegatronSentencePieceTokenizer}
    if kind not in kinds:
        raise ValueError(f"tokenizer type '{kind}' is not one of {', '.join(map(repr, kinds))}")
    try:
        return kinds[kind](path)
    except Exception as e:  # JSON, protobuf, UTF-8 or tokenizers errors that name no file
        if is_hub_id(str(path)) and not Path(path).exists():
            raise  # the Hub client's own error (network, gated model) says more
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        where = _unreadable_file(Path(path))
        raise ValueError(f"tokenizer '{path}' cannot be read as a {kind} tokenizer: {where}{reason}; "
                         f"{_tokenizer_fix(kind, Path(path))}") from None


def _tokenizer_fix(kind: str, path: Path) -> str:
    """What to do about a tokenizer file that did not load as ``kind``: the type its name says
    it is, where that differs, else to replace the file."""
    looks = ("huggingface" if path.is_dir() else "sentencepiece" if path.suffix == ".model"
             else "char" if path.suffix == ".json" else None)
    if looks and looks != kind and not (looks == "sentencepiece" and kind == "megatron-sentencepiece"):
        return (f"it looks like a {looks} tokenizer: set data.tokenizer.type={looks} "
                f"(--tokenizer-type {looks} for the tools)")
    return "save it again, or point data.tokenizer.model (--tokenizer-model) at a working copy"


def vocab_size_offline(kind: str, path: str | Path, stated: int | None) -> int:
    """The vocabulary size of the tokenizer at ``path``, for sizing a model that is not trained
    now (``--dry-run``, ``--plan``), without the network: the tokenizer's own where it is on disk
    (exact), else ``stated`` (the recipe's ``data.tokenizer.vocab_size``), else a Hub tokenizer's
    from the local Hugging Face cache. Without a network the Hub client retries for about 40 s
    before it gives up, for a number the recipe usually states. FileNotFoundError (one line) when
    none of them gives the size; ValueError (one line, naming the file) when the tokenizer on
    disk cannot be read."""
    if Path(path).exists():
        return load_tokenizer(kind, path).vocab_size
    if stated is not None:
        return stated
    fix = "set data.tokenizer.vocab_size=N (or model.vocab_size=N)"
    hub = kind == "huggingface" and is_hub_id(str(path))
    if hub:
        from transformers import AutoTokenizer

        try:
            return len(AutoTokenizer.from_pretrained(str(path), local_files_only=True))
        except Exception:  # not in the cache (or unreadable there): the same answer
            pass
    # 'data/gpt2' is spelled like a Hub id, but where its directory 'data' exists here it is
    # meant as a path: a download command for a Hub repository 'data/gpt2' would mislead.
    if hub and not _looks_local(str(path)):
        raise FileNotFoundError(
            f"tokenizer '{path}' is neither a local directory nor in the Hugging Face cache, and "
            f"sizing the model does not download it: {fix}, or save it first (hf download {path} "
            "--local-dir DIR) and pass DIR")
    make = "save the tokenizer there (save_pretrained)" if kind == "huggingface" else "build it"
    raise FileNotFoundError(f"the vocabulary size comes from the tokenizer '{path}', which does not "
                            f"exist yet (data.tokenizer.model): {make}, or {fix}")


def _looks_local(name: str) -> bool:
    """Whether a Hub-id-shaped ``name`` reads as a path here: its first directory exists."""
    parent = Path(name).parent
    return parent != Path(".") and parent.is_dir()


def _unreadable_file(path: Path) -> str:
    """'FILE: ' for the first JSON file of a tokenizer directory that does not parse (the parsers'
    messages give a line and column but no file name); '' where none is found."""
    if not path.is_dir():
        return f"{path}: "
    for file in sorted(path.glob("*.json")):
        try:
            json.loads(file.read_text())
        except (OSError, ValueError):
            return f"{file}: "
    return ""
