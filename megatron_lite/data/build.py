"""First-run dataset building from ``data.build_from`` (e.g. shakespeare-char's raw text)."""

from __future__ import annotations

import shutil
from pathlib import Path

from megatron_lite.config.schema import DataConfig
from megatron_lite.data.indexed import dataset_exists, datasets_under
from megatron_lite.data.preprocess import PreprocessOptions, preprocess
from megatron_lite.data.tokenizers import CharTokenizer

SUFFIX = "_text_document"


def is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def fetched(url: str, folder: Path, log=print, timeout_s: float = 60.0) -> Path:
    """``url`` downloaded into ``folder`` under its file name, once: a file already there is
    used as it is. Written to a temporary name and renamed when complete, so an interrupted
    download is never taken for the text. FileNotFoundError naming the URL and the way round it
    (a compute node without the internet) when the download fails."""
    import http.client
    import os
    import urllib.error
    import urllib.parse
    import urllib.request

    name = Path(urllib.parse.urlparse(url).path).name or "build_from.txt"
    dest = folder / name
    if dest.is_file():
        return dest
    folder.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(f".{name}.{os.getpid()}.part")  # one per process: ranks may race
    log(f"downloading {url} to {dest}")
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response, open(partial, "wb") as out:
            shutil.copyfileobj(response, out)
            expected = response.headers.get("Content-Length")
        got = partial.stat().st_size
        if expected is not None and got != int(expected):
            raise OSError(f"the connection ended after {got} of {expected} bytes")
    except (OSError, ValueError, http.client.HTTPException) as e:
        # (URLError and HTTPError are OSErrors; a cut-off body is an HTTPException; a malformed
        # URL a ValueError.)
        partial.unlink(missing_ok=True)
        raise FileNotFoundError(f"data.build_from: downloading {url} failed ({e}); download it "
                                f"where the network allows, then set data.build_from=PATH (or put "
                                f"it at {dest})") from None
    os.replace(partial, dest)
    return dest


def ensure_dataset(cfg: DataConfig, log=print) -> None:
    """Build ``cfg.prefix`` (and a missing char vocabulary) from ``cfg.build_from`` if absent.

    Call on one rank only; the others wait at a barrier. Reuses what exists.
    """
    assert cfg.tokenizer.model is not None
    if cfg.prefix is None:  # a blend: its datasets must have been built beforehand
        missing = [e.prefix for e in cfg.blend if not dataset_exists(e.prefix)]
        if missing:
            raise FileNotFoundError(f"blended dataset(s) {missing} do not exist; build them with "
                                    "tools/preprocess_data.py")
        return
    if dataset_exists(cfg.prefix):
        return
    if cfg.build_from is None:
        meant = datasets_under(cfg.prefix)
        if meant:  # the --output-prefix given to preprocess_data.py, which adds _KEY_document
            raise FileNotFoundError(f"dataset '{cfg.prefix}.bin/.idx' does not exist; did you mean "
                                    f"{' or '.join(f'data.prefix={m}' for m in meant[:3])}?")
        raise FileNotFoundError(
            f"dataset '{cfg.prefix}.bin/.idx' does not exist; build it with tools/preprocess_data.py "
            "or set data.build_from to the raw text to build it from")
    source = (fetched(cfg.build_from, Path(cfg.prefix).parent, log) if is_url(cfg.build_from)
              else Path(cfg.build_from))
    if not source.is_file():
        raise FileNotFoundError(f"data.build_from: '{source}' does not exist")
    if not cfg.prefix.endswith(SUFFIX):
        raise ValueError(f"data.prefix '{cfg.prefix}' must end with '{SUFFIX}' to be built from "
                         "data.build_from (Megatron's PREFIX_text_document naming)")
    tok = cfg.tokenizer
    if tok.type == "char" and not Path(tok.model).exists():
        text = source.read_text(encoding="utf-8") if source.suffix not in (".jsonl", ".json") else None
        if text is None:
            raise ValueError("a char vocabulary can only be built from a plain-text data.build_from")
        CharTokenizer.build(text, tok.model)
        log(f"built char vocabulary {tok.model}")
    log(f"building dataset {cfg.prefix} from {source}")
    preprocess([str(source)], cfg.prefix[: -len(SUFFIX)],
               PreprocessOptions(tok.type, tok.model, append_eod=tok.type != "char", show_progress=False),
               log=log)
