"""Raw text -> tokenized Megatron indexed datasets, streaming, parallel and robust.

Pipeline: the main process reads raw records (jsonl lines, text blocks or files, parquet rows,
Hugging Face dataset rows)
in batches of about ``BATCH_BYTES``; workers decode, validate and tokenize a whole batch and
return flat numpy arrays (cheap to pickle); results are taken in input order, so the output
bytes do not depend on the worker count; one writer per JSON key streams to ``.tmp`` files that are
renamed into place only when everything succeeded.

Bad input never crashes a run and is never dropped silently. Policies (``POLICIES``):
skipped and counted — malformed JSON, a missing key, a non-string value, an empty or
whitespace-only document; repaired and counted — invalid UTF-8 (replaced by U+FFFD), a
byte-order mark (removed), CRLF line endings (to LF; in jsonl they only end the line); kept and
counted — documents over ``LONG_DOC_BYTES``. ``strict=True`` turns any of them into an error
naming the file and line, and no output is written.
"""

from megatron_lite.data.preprocess.driver import format_summary, preprocess
from megatron_lite.data.preprocess.options import PreprocessOptions
from megatron_lite.data.preprocess.parts import PartsPending
from megatron_lite.data.preprocess.records import POLICIES, TEXT_SPLITS, PreprocessError, Summary
from megatron_lite.data.preprocess.separators import SeparatorPolicy, one_separator, separator_policy

__all__ = ["POLICIES", "TEXT_SPLITS", "PartsPending", "PreprocessError", "PreprocessOptions",
           "SeparatorPolicy", "Summary", "format_summary", "one_separator", "preprocess", "separator_policy"]
