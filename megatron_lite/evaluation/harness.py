"""Downstream tasks through lm-evaluation-harness (``pip install 'megatron_lite[eval]'``).

An ``lm_eval`` model over the plain single-process ``Transformer``: scores requests the way
lm-eval's own ``HFLM`` does (its ``TemplateLM`` base encodes context and continuation together
and splits them; contexts truncated from the left to the model's length), so a checkpoint and
its Hugging Face export get the same numbers. ``lm_eval`` is imported inside functions only:
the package imports, and trains, without the extra.
"""

from __future__ import annotations

import difflib
import functools
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from megatron_lite.data.tokenizers import Tokenizer, load_tokenizer
from megatron_lite.model import build_model
from megatron_lite.model.transformer import Transformer

INSTALL_HINT = "downstream evaluation needs lm-evaluation-harness: pip install 'megatron_lite[eval]'"
DEFAULT_MAX_GEN_TOKS = 256  # HFLM's: a task that sets no max_gen_toks generates as much


class MissingExtraError(ImportError):
    """lm_eval is not installed (one line naming the install)."""


class UnknownTaskError(ValueError):
    """A task name neither lm_eval nor the include path defines."""


def require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise MissingExtraError(INSTALL_HINT) from None


class _Scoring:
    """The adapter's work, without lm_eval's base class (combined with ``TemplateLM`` in
    ``adapter_class``, so that defining it needs no lm_eval)."""

    def __init__(self, model: nn.Module, tokenizer: Any, max_len: int, device: str | torch.device,
                 batch_size: int = 8, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS):
        super().__init__()
        self.model, self.tok = model, tokenizer
        self._max_len, self.batch_size, self.max_gen_toks = max_len, batch_size, max_gen_toks
        self._device = torch.device(device)
        # A Hugging Face tokenizer is called as HFLM calls it (its own special tokens, written
        # special tokens parsed): the encodings, hence the scores, are HFLM's.
        self.hf = _transformers_tokenizer(tokenizer)

    @property
    def device(self) -> torch.device:  # lm_eval's base has it only from 0.4.10
        return self._device

    @property
    def max_length(self) -> int:
        return self._max_len

    @property
    def eot_token_id(self) -> int | None:
        return self.hf.eos_token_id if self.hf is not None else self.tok.eod_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context (and a perplexity document) is conditioned on: HFLM's choice
        (BOS, else EOS) for a Hugging Face tokenizer; for ours, what preceded a document in
        training: BOS where the tokenizer adds it itself, else the end-of-document token."""
        if self.hf is not None:
            ids = (self.hf.bos_token_id, self.hf.eos_token_id)
        else:
            bos = self.tok.bos_id
            leads = bos is not None and list(self.tok.encode("a"))[:1] == [bos]
            ids = (bos, self.tok.eod_id) if leads else (self.tok.eod_id, bos)
        chosen = next((i for i in ids if i is not None), None)
        if chosen is None:
            raise ValueError("the tokenizer has neither a BOS nor an end-of-document token: tasks with "
                             "empty contexts and perplexity tasks need one to condition on")
        return chosen

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.hf, "name_or_path", "") or type(self.tok).__name__

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        if self.hf is None:  # sentencepiece and char tokenizers add no special tokens to skip
            return [int(i) for i in self.tok.encode(string)]
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        # HFLM: a string that already starts with the BOS text gets no second one.
        if add_special_tokens is None and string.startswith(self.hf.decode(self.prefix_token_id)):
            options = {"add_special_tokens": False}
        return self.hf.encode(string, **options)

    def tok_decode(self, ids: Sequence[int]) -> str:
        if self.hf is not None:
            return self.hf.decode(list(ids), skip_special_tokens=True)
        return self.tok.decode(list(ids))

    @torch.no_grad()
    def _logits(self, rows: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        """(B, T, V) logits of right-padded rows, and each row's length: causal attention
        keeps a row's positions blind to the padding after them, and RoPE positions start at 0
        in every row, as HF's left padding with an attention mask gives them."""
        lengths = [len(r) for r in rows]
        batch = torch.zeros(len(rows), max(lengths), dtype=torch.long)
        for i, row in enumerate(rows):
            batch[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        return self.model(batch.to(self._device)), lengths

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(log-probability, greedy?) of each continuation; longest first so batches pad little."""
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1] + requests[i][2]))
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            rows = []
            for i in chunk:
                _, context, continuation = requests[i]
                if not context or not continuation or len(continuation) > self._max_len:
                    raise ValueError(f"a request of {len(context)} context and {len(continuation)} "
                                     f"continuation tokens cannot be scored within {self._max_len}")
                # HFLM's left truncation: the last max_len+1 tokens, the final one only predicted.
                rows.append((context + continuation)[-(self._max_len + 1):][:-1])
            logits, lengths = self._logits(rows)
            for row, i, n in zip(range(len(chunk)), chunk, lengths, strict=True):
                string, _, continuation = requests[i]
                # The positions that predict the continuation: the last len(continuation) inputs.
                logp = F.log_softmax(logits[row, n - len(continuation):n].float(), dim=-1)
                target = torch.tensor(continuation, device=logp.device)
                answer = (float(logp.gather(1, target[:, None]).sum()),
                          bool((logp.argmax(dim=-1) == target).all()))
                out[i] = answer
                if string is not None:  # rolling windows are cached per document instead
                    self.cache_hook.add_partial("loglikelihood", string, answer)
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owner = [], []
        for k, (string,) in enumerate(r.args for r in requests):
            for context, target in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self._max_len, context_len=1)):
                windows.append((None, context, target))
                owner.append(k)
        scores = self._loglikelihood_tokens(windows)
        totals = [0.0] * len(requests)
        for k, (logp, _) in zip(owner, scores, strict=True):
            totals[k] += logp
        for r, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}  # one decoding setting per batch, as HFLM groups them
        for i, r in enumerate(requests):
            groups.setdefault(json.dumps(r.args[1], sort_keys=True, default=str), []).append(i)
        for members in groups.values():
            until, max_new = self._generation_settings(requests[members[0]].args[1])
            # An empty prompt is conditioned on the prefix token, as scoring conditions one.
            contexts = {i: (self.tok_encode(requests[i].args[0]) or [self.prefix_token_id])
                        [-(self._max_len - max_new):] for i in members}
            members.sort(key=lambda i: -len(contexts[i]))
            for start in range(0, len(members), self.batch_size):
                chunk = members[start:start + self.batch_size]
                texts = self._greedy([contexts[i] for i in chunk], until, max_new)
                for i, text in zip(chunk, texts, strict=True):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out  # type: ignore[return-value]

    def _generation_settings(self, kwargs: dict) -> tuple[list[str], int]:
        """(stop strings with the EOS text added, tokens to generate at most), as HFLM reads a
        task's generation_kwargs; anything but greedy decoding is refused, not ignored."""
        temperature = float(kwargs.get("temperature", 0.0) or 0.0)
        if kwargs.get("do_sample") or (kwargs.get("do_sample") is None and temperature > 0):
            raise ValueError(f"generation_kwargs {kwargs} ask for sampling; this model decodes greedily "
                             "only (set do_sample: false)")
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = next((int(kwargs[k]) for k in ("max_gen_toks", "max_new_tokens", "max_tokens")
                        if kwargs.get(k) is not None), self.max_gen_toks)
        if max_new >= self._max_len:
            raise ValueError(f"max_gen_toks={max_new} leaves no room for a context within the model's "
                             f"{self._max_len} positions")
        eos = self.eot_token_id
        if eos is not None:
            text = self.hf.decode(eos) if self.hf is not None else self.tok.decode([eos])
            if text and text not in until:
                until.append(text)
        return until, max_new

    @torch.no_grad()
    def _greedy(self, contexts: list[list[int]], until: list[str], max_new: int) -> list[str]:
        """Greedy continuations of a batch, each cut before its first stop string. No KV cache:
        the whole window again per token (fine for the short answers tasks ask for)."""
        rows = [list(c) for c in contexts]
        new: list[list[int]] = [[] for _ in rows]
        live = set(range(len(rows)))
        for _ in range(max_new):
            if not live:
                break
            order = sorted(live)
            logits, lengths = self._logits([rows[i] for i in order])
            picks = logits[torch.arange(len(order)), torch.tensor(lengths) - 1].argmax(dim=-1).tolist()
            for i, token in zip(order, picks, strict=True):
                rows[i].append(token)
                new[i].append(token)
                if token == self.eot_token_id or any(s and s in self.tok_decode(new[i]) for s in until):
                    live.discard(i)
        texts = []
        for ids in new:
            text = self.tok_decode(ids)
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            texts.append(text)
        return texts


def _transformers_tokenizer(tokenizer: Any) -> Any:
    """The transformers tokenizer inside ours (``HFTokenizer.tok``), or the one given; None for
    sentencepiece and character tokenizers."""
    candidate = getattr(tokenizer, "tok", tokenizer)
    return candidate if callable(getattr(candidate, "convert_tokens_to_ids", None)) else None


@functools.cache
def adapter_class() -> type:
    """``MegatronLM``: ``lm_eval.api.model.TemplateLM`` with this module's scoring (built on
    first use, so that only evaluation imports lm_eval)."""
    require_lm_eval()
    from lm_eval.api.model import TemplateLM

    return type("MegatronLM", (_Scoring, TemplateLM), {"__module__": __name__, "__doc__": _Scoring.__doc__})


def harness_lm(model: nn.Module, tokenizer: Any, max_len: int, device: str | torch.device = "cpu",
               batch_size: int = 8, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS) -> Any:
    """An ``lm_eval`` LM over ``model`` (token ids (B, T) -> logits (B, T, V): the plain
    ``Transformer``) and ``tokenizer`` (one of ``data.tokenizers``' or a transformers one)."""
    return adapter_class()(model, tokenizer, max_len, device, batch_size, max_gen_toks)


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", tokenizer: str | Path | None = None,
                    tokenizer_type: str | None = None) -> tuple[Transformer, Tokenizer, dict]:
    """(model in eval mode on ``device``, tokenizer, manifest) of a checkpoint directory or
    ``checkpoint.dir``. The tokenizer: ``tokenizer`` where given, else the recipe's, else the
    Hugging Face directory an imported checkpoint came from."""
    from megatron_lite.checkpoint.convert import read_model

    manifest, cfg, weights = read_model(Path(path))
    tok = checkpoint_tokenizer(manifest, tokenizer, tokenizer_type)
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"tokenizer of {tok.vocab_size} ids is larger than the checkpoint's vocabulary "
                         f"({cfg.vocab_size}): not the tokenizer it was trained with")
    # Built on meta, then filled: the per-name initial values would be drawn only to be replaced.
    model = build_model(cfg, device="meta").to_empty(device=device)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight
    missing, extra = model.load_state_dict(weights, strict=False)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or extra:
        raise ValueError(f"checkpoint {path}: weights missing {missing[:3]}, unexpected {extra[:3]}")
    model.reset_buffers()
    return model.eval(), tok, manifest


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def checkpoint_tokenizer(manifest: dict, override: str | Path | None = None,
                         kind: str | None = None) -> Tokenizer:
    """The tokenizer for a checkpoint's manifest; FileNotFoundError (one line) where none is
    named or on disk."""
    try:
        recipe = yaml.safe_load(manifest.get("config") or "") or {}
    except yaml.YAMLError:
        recipe = {}
    data = recipe.get("data") if isinstance(recipe, dict) and isinstance(recipe.get("data"), dict) else {}
    spec = data.get("tokenizer") if isinstance(data.get("tokenizer"), dict) else {}
    if override is not None:
        return load_tokenizer(kind or _kind_of(Path(override), spec.get("type")), override)
    if isinstance(spec.get("type"), str) and isinstance(spec.get("model"), str):
        if Path(spec["model"]).exists() or spec["type"] == "huggingface":
            return load_tokenizer(kind or spec["type"], spec["model"])
        raise FileNotFoundError(f"the checkpoint's tokenizer {spec['model']} (data.tokenizer.model) is not "
                                "here; pass the tokenizer's path (--tokenizer PATH)")
    imported = (manifest.get("topology") or {}).get("imported_from")
    if imported and any((Path(imported) / f).is_file() for f in TOKENIZER_FILES):
        return load_tokenizer(kind or "huggingface", imported)
    raise FileNotFoundError("the checkpoint names no tokenizer on disk (an import whose source directory "
                            "has none, or is gone); pass the tokenizer's path (--tokenizer PATH)")


def _kind_of(path: Path, recipe_kind: str | None) -> str:
    """A tokenizer's type from its path (the recipe's where the path fits it)."""
    looks = "huggingface" if path.is_dir() or not path.suffix else \
        "sentencepiece" if path.suffix == ".model" else "char"
    fits = recipe_kind == looks or (recipe_kind == "megatron-sentencepiece" and looks == "sentencepiece")
    return recipe_kind if fits else looks  # type: ignore[return-value]


@functools.cache
def task_manager(include_path: str | None, defaults: bool = True) -> Any:
    """lm_eval's task index (built once per process: indexing its thousands of YAML files takes
    seconds)."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=defaults)


def resolve_tasks(tasks: Sequence[str], include_path: str | None = None) -> Any:
    """The task manager that knows every one of ``tasks``: the include path's alone where it
    has them all (skipping the index of lm_eval's own), else with lm_eval's own.
    UnknownTaskError (one line, with the closest names) for any it does not know."""
    if include_path is not None and not Path(include_path).is_dir():
        raise UnknownTaskError(f"--include-path {include_path} is not a directory of task YAML files")
    if include_path is not None:
        own = task_manager(str(include_path), defaults=False)
        if set(tasks) <= set(own.all_tasks):
            return own
    manager = task_manager(None if include_path is None else str(include_path))
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        close = difflib.get_close_matches(unknown[0], manager.all_tasks, n=3)
        where = "lm_eval's tasks" + (f" or {include_path}" if include_path else "")
        hint = f"; closest: {', '.join(close)}" if close else ""
        raise UnknownTaskError(f"unknown task(s) {', '.join(unknown)}: not in {where}{hint}")
    return manager


def run_tasks(lm: Any, tasks: Sequence[str], limit: int | None = None, include_path: str | None = None,
              num_fewshot: int | None = None, log_samples: bool = False) -> dict:
    """lm_eval's results dict for ``tasks`` on ``lm``. Python's, numpy's and torch's random
    states are put back afterwards: ``simple_evaluate`` seeds them all, which would otherwise
    change the rest of a training run (its dropout, its data order)."""
    require_lm_eval()
    from lm_eval import simple_evaluate

    manager = resolve_tasks(tasks, include_path)
    state = random.getstate(), np.random.get_state()
    device = torch.device(getattr(lm, "device", None) or "cpu")
    accelerators = [device] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=accelerators, device_type=device.type if accelerators else "cuda"):
        try:
            # bootstrap_iters=0: no resampled standard errors (seconds each, in worker processes).
            results = simple_evaluate(model=lm, tasks=list(tasks), limit=limit, num_fewshot=num_fewshot,
                                      task_manager=manager, bootstrap_iters=0, log_samples=log_samples)
        finally:
            random.setstate(state[0])
            np.random.set_state(state[1])
    return results or {}  # None off lm_eval's rank 0 (LOCAL_RANK != 0)


def flat_metrics(results: dict) -> dict[str, float]:
    """``harness/<task>/<metric>`` -> value for every numeric metric of lm_eval's results
    (standard errors left out; a filter other than ``none`` appended: ``exact_match/strict``)."""
    flat = {}
    for task, metrics in (results.get("results") or {}).items():
        for key, value in metrics.items():
            name, comma, kept = key.partition(",")  # lm_eval's "metric,filter"; others are counts
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)  # numpy's too
            if not comma or "_stderr" in name or not numeric:
                continue
            flat[f"harness/{task}/{name}" + (f"/{kept}" if kept and kept != "none" else "")] = float(value)
    return flat


def evaluate_tasks(model: nn.Module, tokenizer: Any, tasks: list[str], limit: int | None, max_len: int,
                   device: str | torch.device, include_path: str | None = None,
                   batch_size: int = 8) -> dict[str, float]:
    """Flat metrics (``flat_metrics``) of ``tasks`` on a plain model, for the trainer: the model
    is in eval mode during the call and back in its own mode after it, and no random state
    changes. Single process: call it where the whole model is on one rank."""
    lm = harness_lm(model, tokenizer, max_len, device, batch_size)
    training = model.training
    model.eval()
    try:
        return flat_metrics(run_tasks(lm, tasks, limit=limit, include_path=include_path))
    finally:
        model.train(training)
