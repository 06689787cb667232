"""The options of a preprocessing run, in one frozen object: what the output's bytes depend on
besides the inputs (``output_fields``, which a rank's part signature hashes) and how the work
runs."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.data.preprocess.records import TEXT_SPLITS, PreprocessError


@dataclass(frozen=True)
class PreprocessOptions:
    tokenizer_type: str
    """The tokenizer's type (``data/tokenizers.py``: char, gpt2, sentencepiece, huggingface, ...)."""
    tokenizer_model: str
    """Its file, directory or Hub id."""
    json_keys: tuple[str, ...] = ("text",)
    """The record fields tokenized, each into a dataset of its own."""
    append_eod: bool = False
    """Add the end-of-document token where nothing marks a document's end already."""
    text_split: str = "file"
    """A plain-text file is one document (``file``) or one per blank-line-separated block."""
    strict: bool = False
    """Any bad input is an error (naming its file and line) and nothing is written."""
    workers: int = 1
    """Encoding processes (1: the main process encodes)."""
    split: str = "train"
    """The split of a Hugging Face dataset input."""
    streaming: bool = False
    """Stream a Hugging Face dataset input instead of downloading it whole."""
    show_progress: bool | None = None
    """A progress bar: always, never, or on a terminal (None)."""

    def __post_init__(self) -> None:
        keys = (self.json_keys,) if isinstance(self.json_keys, str) else tuple(self.json_keys)
        object.__setattr__(self, "json_keys", keys)  # one key given as a string is that key
        if self.text_split not in TEXT_SPLITS:
            raise PreprocessError(f"text split '{self.text_split}' is not one of {TEXT_SPLITS}")
        if self.workers < 1:
            raise PreprocessError(f"workers {self.workers}: must be at least 1")
        if not self.json_keys:
            raise PreprocessError("json_keys: at least one key is needed")

    def output_fields(self, tokenizer: dict, separators: str) -> dict:
        """What the output's bytes depend on besides the inputs: the keys, the tokenizer (its
        fingerprint), the separators and the text split; never how the work ran."""
        return {"json keys": list(self.json_keys), "tokenizer": tokenizer, "append-eod": self.append_eod,
                "text split": self.text_split, "separators": separators}
